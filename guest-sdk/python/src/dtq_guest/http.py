"""Outbound HTTP: a small blocking client on ``wasi:http/outgoing-handler``.

>>> rates = http.get("https://rates.example.com/eur").error_for_status().json()  # doctest: +SKIP
>>> reply = http.post_json("https://api.example.com/orders", {"id": "A-1"})      # doctest: +SKIP

The operator decides which hosts a handler may call (the deploy setting
``allow_hosts``, or ``dtq serve --allow-host TASK=PATTERN``); the host also
bounds every request's count, time and response size. A request sent inside
an idempotent operation carries an ``Idempotency-Key`` header the host adds,
the same on every retry of that operation of that task, unless the handler
sets one itself (:meth:`Request.idempotency_key`).

A request that cannot be sent as written (a URL that does not parse, a
forbidden header, a body that does not serialize) is a
:class:`~dtq_guest.FatalError`; every other failure (denied, refused, timed
out, cut off) is a :class:`~dtq_guest.RetryableError`. A response is not an
error whatever its status; :meth:`Response.error_for_status` makes one of a
non-2xx status. The semantics and messages are the Rust SDK's
(``guest-sdk/src/http.rs``).
"""

import json
from dataclasses import dataclass, field
from typing import List, Tuple

from . import _bindings
from .errors import FatalError, RetryableError

#: The header the host adds inside an idempotent operation.
IDEMPOTENCY_KEY = "Idempotency-Key"

#: The most bytes asked of the response stream in one read.
READ_CHUNK = 64 * 1024
#: The most bytes ``blocking-write-and-flush`` takes in one call.
WRITE_CHUNK = 4096

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def get(url):
    """Send ``GET url``."""
    return Request("GET", url).send()


def post_json(url, body):
    """Send ``POST url`` with ``body`` as JSON (``Content-Type: application/json``)."""
    return Request("POST", url).json(body).send()


@dataclass
class Response:
    """A response, read whole."""

    #: The status code.
    status: int
    #: The headers in the order received, names in lowercase.
    headers: List[Tuple[str, str]] = field(default_factory=list)
    #: The body.
    body: bytes = b""

    @property
    def is_success(self):
        """Whether the status is 2xx."""
        return 200 <= self.status < 300

    def header(self, name):
        """The first value of header ``name`` (any case), or None."""
        name = name.lower()
        return next((v for n, v in self.headers if n.lower() == name), None)

    def json(self):
        """The body parsed as JSON; a body that does not parse is retryable."""
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise RetryableError(
                f"the response body (HTTP {self.status}) is not the JSON expected: {e}"
            ) from None

    def text(self):
        """The body as text; a body that is not UTF-8 is retryable."""
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RetryableError(f"the response body is not UTF-8: {e}") from None

    def error_for_status(self):
        """This response if its status is 2xx, else a retryable error."""
        if self.is_success:
            return self
        raise RetryableError(f"the server answered HTTP {self.status}")


class Request:
    """A request being built; :meth:`send` sends it."""

    def __init__(self, method, url):
        self.method = method.upper()
        self.url = url
        self.headers = []
        self.body_bytes = None
        self._invalid = None
        if self.method not in METHODS:
            self._invalid = f"method {method!r} is not one of {', '.join(METHODS)}"

    def header(self, name, value):
        """Add the header ``name: value`` (a repeated name is sent repeated)."""
        self.headers.append((name, value.encode() if isinstance(value, str) else bytes(value)))
        return self

    def idempotency_key(self, key):
        """Send ``Idempotency-Key: key`` instead of the key the host would add."""
        return self.header(IDEMPOTENCY_KEY, key)

    def json(self, body):
        """Send ``body`` as JSON, with ``Content-Type: application/json``."""
        try:
            data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        except (TypeError, ValueError) as e:
            self._invalid = self._invalid or f"the JSON body does not serialize: {e}"
            return self
        return self.header("Content-Type", "application/json").body(data)

    def body(self, data):
        """Send ``data`` (bytes or str) as the body."""
        self.body_bytes = data.encode() if isinstance(data, str) else bytes(data)
        return self

    def send(self):
        """Send the request and read the whole response (blocking)."""
        try:
            target = _Target.parse(self.url)
        except ValueError as why:
            raise FatalError(f"{self.method} {self.url}: invalid URL: {why}") from None
        if self._invalid:
            raise FatalError(f"{self.method} {self.url}: {self._invalid}")
        types = _bindings.module("wasi_http_types")
        request = self._outgoing(types, target)
        try:
            return _exchange(types, request, self.body_bytes)
        except _Failed as failed:
            raise _request_error(target, failed.code) from None

    def _outgoing(self, types, target):
        headers = list(self.headers)
        if self.body_bytes is not None and not any(
            n.lower() == "content-length" for n, _ in headers
        ):
            # A known length: the host sends the body as is, not chunked.
            headers.append(("Content-Length", str(len(self.body_bytes)).encode()))
        invalid = lambda why: FatalError(f"{self.method} {self.url}: {why}")  # noqa: E731
        try:
            fields = types.Fields.from_list(headers)
        except Exception as e:  # noqa: BLE001 - Err(header-error)
            names = [n for n, _ in self.headers]
            raise invalid(f"invalid or forbidden header among {names}: {_err(e)}") from None
        request = types.OutgoingRequest(fields)
        method = getattr(types, "Method_" + self.method.capitalize())()
        scheme = types.Scheme_Http() if target.scheme == "http" else types.Scheme_Https()
        for part, setter, value in (
            ("method", request.set_method, method),
            ("scheme", request.set_scheme, scheme),
            ("authority", request.set_authority, target.authority),
            ("path", request.set_path_with_query, target.path_with_query),
        ):
            try:
                setter(value)
            except Exception:  # noqa: BLE001 - Err(None)
                raise invalid(f"the host refused the URL's {part}") from None
        return request


class _Failed(Exception):
    """A request failed with the wasi:http ``error-code`` ``code``."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


def _err(exc):
    value = _bindings.err_value(exc)
    return exc if value is None else value


def _exchange(types, request, body):
    """Hand ``request`` to the host, stream ``body`` to it, read the response."""
    outgoing = _bindings.module("outgoing_handler")
    outgoing_body = request.body() if body is not None else None
    # The request is handed over before its body is written: the body
    # streams to the host as it is written.
    try:
        future = outgoing.handle(request, None)
    except Exception as e:  # noqa: BLE001 - Err(error-code)
        raise _Failed(_err(e)) from None
    written = None
    if outgoing_body is not None:
        try:
            _write_body(types, outgoing_body, body)
        except _Failed as failed:
            written = failed
    future.subscribe().block()
    result = future.get()
    if result is None or type(result).__name__ == "Err":
        raise _Failed(types.ErrorCode_InternalError("the response was already taken"))
    inner = result.value
    if type(inner).__name__ == "Err":
        raise _Failed(inner.value)
    if written is not None:
        raise written
    return _read_response(types, inner.value)


def _write_body(types, outgoing_body, data):
    stream = outgoing_body.write()
    try:
        for start in range(0, len(data), WRITE_CHUNK):
            stream.blocking_write_and_flush(data[start : start + WRITE_CHUNK])
    except Exception as e:  # noqa: BLE001 - Err(stream-error)
        raise _Failed(_stream_error(types, _err(e))) from None
    finally:
        # The stream is a child of the body: dropped before the body finishes.
        stream.__exit__(None, None, None)
    try:
        types.OutgoingBody.finish(outgoing_body, None)
    except Exception as e:  # noqa: BLE001
        raise _Failed(_err(e)) from None


def _read_response(types, response):
    status = response.status()
    headers = [
        (name, value.decode("utf-8", "replace")) for name, value in response.headers().entries()
    ]
    incoming = response.consume()
    stream = incoming.stream()
    chunks = []
    try:
        while True:
            try:
                chunks.append(stream.blocking_read(READ_CHUNK))
            except Exception as e:  # noqa: BLE001 - Err(stream-error)
                value = _err(e)
                if type(value).__name__.endswith("_Closed"):
                    break
                raise _Failed(_stream_error(types, value)) from None
    finally:
        stream.__exit__(None, None, None)
    trailers = types.IncomingBody.finish(incoming)
    trailers.subscribe().block()
    ended = trailers.get()
    if ended is not None and type(ended).__name__ == "Ok" and type(ended.value).__name__ == "Err":
        raise _Failed(ended.value.value)
    return Response(status=status, headers=headers, body=b"".join(chunks))


def _stream_error(types, err):
    """The HTTP error code behind a failed stream operation."""
    if type(err).__name__.endswith("_Closed"):
        return types.ErrorCode_ConnectionTerminated()
    error = err.value
    code = types.http_error_code(error)
    if code is not None:
        return code
    detail = error.to_debug_string()
    # wasmtime-wasi-http keeps an error that ends a response body as its own
    # type, which `http-error-code` does not recognise: the body-size cap is
    # recognised from its text, as the Rust SDK does.
    prefix = "HTTP response body size exceeds limit"
    if detail.startswith(prefix):
        limit = detail[len(prefix) :].lstrip(": ").removesuffix(" bytes")
        return types.ErrorCode_HttpResponseBodySize(int(limit) if limit.isdigit() else None)
    return types.ErrorCode_InternalError(detail)


def _request_error(target, code):
    """The handler-facing error of a request to ``target`` that failed with ``code``."""
    origin = target.origin
    case = type(code).__name__.rpartition("_")[2]
    timeout = (
        "(the per-request timeout is --http-timeout-ms or the task's remaining deadline, "
        "whichever is sooner)"
    )
    if case == "HttpRequestDenied":
        text = (
            f"request to {origin} denied: the host is not in this handler's allow-list "
            "(deploy setting allow_hosts, or dtq serve --allow-host TASK=PATTERN)"
        )
    elif case == "ConnectionLimitReached":
        text = (
            f"request to {origin} refused: this attempt has made as many requests as the "
            "host allows (--http-max-requests)"
        )
    elif case == "ConnectionTimeout":
        text = f"request to {origin} timed out connecting {timeout}"
    elif case in ("HttpResponseTimeout", "ConnectionReadTimeout", "ConnectionWriteTimeout"):
        text = f"request to {origin} timed out waiting for the response {timeout}"
    elif case == "HttpResponseBodySize":
        limit = "" if code.value is None else f" of {code.value} bytes"
        text = (
            f"response from {origin} cut off: its body is over the host's limit{limit} "
            "(--http-max-response-bytes)"
        )
    elif case == "ConnectionRefused":
        text = f"request to {origin}: connection refused"
    elif case == "ConnectionTerminated":
        text = f"request to {origin}: the connection closed before the response ended"
    elif case in ("DnsError", "DnsTimeout", "DestinationNotFound"):
        text = f"request to {origin}: the host name does not resolve"
    elif case == "InternalError" and code.value is not None:
        text = f"request to {origin} failed: {code.value}"
    else:
        text = f"request to {origin} failed: {case}"
    return RetryableError(text)


@dataclass
class _Target:
    """Where a URL points, in the parts an ``outgoing-request`` takes."""

    scheme: str
    #: ``host[:port]`` as written in the URL.
    authority: str
    #: ``/path?query`` without the fragment; ``/`` when the URL has no path.
    path_with_query: str
    #: ``scheme://host:port`` with the port always written, as errors name it.
    origin: str

    @classmethod
    def parse(cls, url):
        scheme, sep, rest = url.partition("://")
        if not sep:
            raise ValueError("it has no scheme (http:// or https://)")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"scheme {scheme!r} is not http or https")
        rest = rest.split("#", 1)[0]
        end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        authority, path = rest[:end], rest[end:]
        if "@" in authority:
            raise ValueError("credentials in the URL are not supported; send a header")
        host, port = authority, None
        colon = authority.rfind(":")
        if colon >= 0 and "]" not in authority[colon:]:
            host, port_text = authority[:colon], authority[colon + 1 :]
            if not port_text.isdigit() or int(port_text) > 65535:
                raise ValueError(f"port {port_text!r} is not a number from 0 to 65535")
            port = int(port_text)
        if not host:
            raise ValueError("it has no host")
        path = path or "/"
        if path.startswith("?"):
            raise ValueError("a query needs a path before it (`/?…`)")
        port = port if port is not None else (80 if scheme == "http" else 443)
        return cls(scheme, authority, path, f"{scheme}://{host.lower()}:{port}")
