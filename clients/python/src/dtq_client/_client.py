"""The blocking client: one HTTP request per call, on the standard library."""

from __future__ import annotations

import collections
import datetime
import http.client
import json
import threading
import time
import urllib.parse
from typing import Any, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Union

from . import __version__
from ._errors import CONNECTION_FAILED, INVALID_RESPONSE, DtqError, WaitTimeout, error_from_answer
from ._sse import SseError, SseEvent, SseParser

#: The statuses a task ends in.
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "DEAD_LETTERED", "CANCELLED", "EXPIRED"})

#: How far before a task's creation :meth:`Client.wait` starts reading its
#: events (ms): the task id's time is the API's clock, the events' ids
#: Redis's.
EVENTS_CLOCK_SLACK_MS = 2_000

#: How long an event stream may stay silent before it is taken as broken and
#: opened again (s): the server sends a comment every 15 s.
STREAM_IDLE_S = 45.0

#: The longest pause between two reconnections of an event stream (s).
MAX_RECONNECT_PAUSE_S = 5.0

RunAt = Union[int, str, datetime.datetime]


def segment(name: str) -> str:
    """``name`` as one URL path segment: every reserved character escaped."""
    return urllib.parse.quote(name, safe="")


def task_created_ms(task_id: str) -> Optional[int]:
    """When task ``task_id`` was created (ms since the epoch), read from its
    UUIDv7 (a partitioned queue's ids carry ``.<partition>`` after it);
    None for an id that is not one."""
    head = task_id.split(".", 1)[0].replace("-", "")
    if len(head) != 32 or head[12] != "7":
        return None
    try:
        return int(head[:12], 16)
    except ValueError:
        return None


def run_at_value(run_at: RunAt) -> Union[int, str]:
    """``run_at`` as the API takes it: ms since the epoch, or an RFC 3339
    string. A ``datetime`` must carry its time zone."""
    if isinstance(run_at, datetime.datetime):
        if run_at.tzinfo is None:
            raise ValueError("run_at: a datetime needs its tzinfo (a naive one names no instant)")
        return int(run_at.timestamp() * 1000)
    return run_at


def submission(
    task: str,
    payload: Any,
    idempotency_key: Optional[str] = None,
    max_attempts: Optional[int] = None,
    delay_ms: Optional[int] = None,
    run_at: Optional[RunAt] = None,
    timeout_ms: Optional[int] = None,
    expires_in_ms: Optional[int] = None,
    group: Optional[str] = None,
) -> Dict[str, Any]:
    """The body of a submission (an item of a batch): the options given, by
    the API's field names."""
    body: Dict[str, Any] = {"task": task, "payload": payload}
    options = {
        "idempotency_key": idempotency_key,
        "max_attempts": max_attempts,
        "delay_ms": delay_ms,
        "run_at": None if run_at is None else run_at_value(run_at),
        "timeout_ms": timeout_ms,
        "expires_in_ms": expires_in_ms,
        "group": group,
    }
    body.update({k: v for k, v in options.items() if v is not None})
    return body


def _header_safe(value: str) -> bool:
    """Whether ``value`` can go in a header as it is: visible ASCII."""
    return all(0x20 < ord(c) < 0x7F for c in value)


def event_dict(event: SseEvent) -> Dict[str, Any]:
    """An event as :meth:`Client.events` yields it: its data's fields
    (``task_id``, ``status``, ``attempt``, ``at``; a ``gap``'s
    ``last_event_id`` and ``oldest_id``) with ``event`` (its name) and
    ``id`` (None for a gap)."""
    try:
        data = json.loads(event.data)
    except ValueError:
        data = event.data
    fields: Dict[str, Any] = dict(data) if isinstance(data, dict) else {"data": data}
    fields["event"] = event.event
    fields["id"] = event.id
    return fields


class _Stop:
    """A way to end a blocking call from another thread: sets a flag and
    shuts down the socket the call reads, so a read blocked in it returns
    at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._stream: Optional[_Stream] = None

    def watch(self, stream: Optional[_Stream]) -> None:
        with self._lock:
            self._stream = stream
            stopped = self.event.is_set()
        if stopped and stream is not None:
            stream.abort()

    def set(self) -> None:
        with self._lock:
            self.event.set()
            stream = self._stream
        if stream is not None:
            stream.abort()


class _Stopped(Exception):
    """A call ended by its :class:`_Stop`."""


class _Stream:
    """One open event stream: its connection, its socket and its parser."""

    def __init__(self, conn: http.client.HTTPConnection, sock: Any, resp: Any) -> None:
        self.conn = conn
        self.sock = sock
        self.resp = resp
        self.parser = SseParser()

    def read(self, timeout: float) -> Optional[List[SseEvent]]:
        """The events of the next chunk, waiting at most ``timeout`` s for it
        (``socket.timeout``, an OSError, past it); None at the end of the
        stream."""
        self.sock.settimeout(max(timeout, 0.001))
        chunk = self.resp.read1(65536)
        if not chunk:
            return None
        return self.parser.feed(chunk)

    def abort(self) -> None:
        import socket

        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.resp.close()
        finally:
            self.conn.close()


class Client:
    """A client of one dtq API.

    ``url`` is the API's base URL (``http://localhost:8080``; a path after
    the host is kept, for an API behind a proxy), ``token`` the bearer token
    (None for an open API), ``timeout`` the seconds a request may take to
    connect and each read of its answer. Each call opens a connection of its
    own, so a client may be shared between threads.
    """

    def __init__(self, url: str, token: Optional[str] = None, timeout: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        # Given always: http.client would read a port off an IPv6 address.
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # -- requests ---------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self, extra: Optional[Mapping[str, str]]) -> Dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": f"dtq-client-python/{__version__}"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        headers.update(extra or {})
        return headers

    def _send(
        self,
        method: str,
        path: str,
        body: Any,
        headers: Optional[Mapping[str, str]],
        timeout: float,
    ) -> "tuple[http.client.HTTPConnection, Any, http.client.HTTPResponse]":
        """Send a request; its connection, socket and response (headers
        read)."""
        data = None
        all_headers = self._headers(headers)
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            all_headers["Content-Type"] = "application/json"
        conn = self._connection(timeout)
        target = self._prefix + path
        try:
            conn.request(method, target, body=data, headers=all_headers)
            sock = conn.sock
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self._unreachable(method, path, e) from e
        return conn, sock, resp

    def _unreachable(self, method: str, path: str, e: BaseException) -> DtqError:
        url = self.url + path
        reason = str(e) or type(e).__name__
        return DtqError(
            CONNECTION_FAILED,
            f"{method} {url}: {reason}",
            None,
            {"url": url, "reason": reason},
        )

    def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> Any:
        """A request whose answer is JSON; the parsed answer, or the
        :class:`DtqError` it stands for."""
        conn, _, resp = self._send(method, path, body, headers, self.timeout)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise self._unreachable(method, path, e) from e
        finally:
            conn.close()
        if not 200 <= resp.status < 300:
            raise error_from_answer(resp.status, raw)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise DtqError(
                INVALID_RESPONSE,
                f"{method} {self.url + path}: HTTP {resp.status}, and the answer is not JSON",
                resp.status,
                {},
            ) from None

    def _open_events(self, path: str, last_event_id: Optional[str], timeout: float) -> _Stream:
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        conn, sock, resp = self._send("GET", path, None, headers, timeout)
        if resp.status != 200:
            try:
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                raw = b""
            finally:
                conn.close()
            raise error_from_answer(resp.status, raw)
        return _Stream(conn, sock, resp)

    # -- the API ----------------------------------------------------------

    def submit(
        self,
        queue: str,
        task: str,
        payload: Any,
        idempotency_key: Optional[str] = None,
        max_attempts: Optional[int] = None,
        delay_ms: Optional[int] = None,
        run_at: Optional[RunAt] = None,
        timeout_ms: Optional[int] = None,
        expires_in_ms: Optional[int] = None,
        group: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Submit ``task`` with ``payload`` (any JSON value) to ``queue``.

        Returns the API's answer: ``task_id``, ``queue``, ``task``,
        ``status`` and ``duplicate`` (True: the key's task had ended, and
        this is its record). ``run_at`` is ms since the epoch, an RFC 3339
        string or an aware ``datetime``. ``group`` names the task's group for
        the queue's ``group_concurrency`` limit. Raises :class:`DtqError`
        (``UNKNOWN_TASK``, ``IDEMPOTENCY_IN_PROGRESS`` with the task's
        ``task_id`` in ``details``, ``QUEUE_FULL``, ...).
        """
        body = submission(
            task, payload, None, max_attempts, delay_ms, run_at, timeout_ms, expires_in_ms, group
        )
        headers = {}
        if idempotency_key is not None:
            # The header, as the API documents it; a key a header cannot
            # carry (not visible ASCII) goes in the body's field instead.
            if _header_safe(idempotency_key):
                headers["Idempotency-Key"] = idempotency_key
            else:
                body["idempotency_key"] = idempotency_key
        return self._request("POST", f"/v1/queues/{segment(queue)}/tasks", body, headers)

    def submit_batch(self, queue: str, items: Iterable[Mapping[str, Any]]) -> Dict[str, Any]:
        """Submit 1 to 1000 tasks to ``queue`` in one request.

        Each item is a submission by the API's field names (``task``,
        ``payload``, ``idempotency_key``, ``max_attempts``, ``delay_ms``,
        ``run_at``, ``timeout_ms``, ``expires_in_ms``; :func:`submission`
        builds one). Returns the API's answer, ``{"results": [{"status",
        "body"}, ...]}``, one per item in order: each item is accepted or
        refused on its own, so check each ``status`` (202 new, 200 a
        replay, else ``body`` is an error body).
        """
        tasks = []
        for item in items:
            item = dict(item)
            if item.get("run_at") is not None:
                item["run_at"] = run_at_value(item["run_at"])
            tasks.append(item)
        return self._request("POST", f"/v1/queues/{segment(queue)}/tasks/batch", {"tasks": tasks})

    def status(self, queue: str, task_id: str) -> Dict[str, Any]:
        """Task ``task_id`` of ``queue`` as the API shows it: ``status``,
        ``attempts``, ``result``, ``error``, ``log``, the timestamps and
        ``attempt_history``. Raises :class:`DtqError` ``TASK_NOT_FOUND``."""
        return self._request("GET", f"/v1/queues/{segment(queue)}/tasks/{segment(task_id)}")

    def cancel(self, queue: str, task_id: str) -> Dict[str, Any]:
        """Cancel task ``task_id``: ``status`` ``CANCELLED`` when it was
        waiting, ``RUNNING`` with ``cancel_requested`` when its worker was
        asked to interrupt it. Raises :class:`DtqError` ``TASK_TERMINAL``
        when it had already ended."""
        return self._request(
            "POST", f"/v1/queues/{segment(queue)}/tasks/{segment(task_id)}/cancel"
        )

    def events(
        self, queue: str, since: Optional[str] = None, task_id: Optional[str] = None
    ) -> "EventStream":
        """Follow ``queue``'s lifecycle events, live (see :class:`EventStream`).

        The stream is open when this returns (its refusal raised here:
        ``EVENTS_OFF`` when the server runs with ``--events none``), so
        without ``since`` it holds every event that happens from then on;
        with an event id it continues after that event. ``task_id`` keeps
        one task's events.
        """
        path = f"/v1/queues/{segment(queue)}/events"
        if task_id is not None:
            path += "?" + urllib.parse.urlencode({"task_id": task_id})
        return EventStream(self, path, since)

    def wait(
        self,
        queue: str,
        task_id: str,
        timeout: float = 60.0,
        poll_interval: float = 1.0,
    ) -> Dict[str, Any]:
        """Wait until task ``task_id`` has ended; its record (as
        :meth:`status` returns it), whichever status it ended in
        (``SUCCEEDED``, ``FAILED``, ``DEAD_LETTERED``, ``CANCELLED``,
        ``EXPIRED``).

        Follows the task's live events; when they are off (``EVENTS_OFF``)
        or the stream breaks, polls the record, every ``poll_interval`` s at
        most. Raises :class:`WaitTimeout` (a :class:`DtqError` with code
        ``WAIT_TIMEOUT`` and a ``TimeoutError``) naming the task when it has
        not ended after ``timeout`` s.
        """
        return self._wait(queue, task_id, timeout, poll_interval, _Stop())

    # -- waiting ----------------------------------------------------------

    def _wait(
        self, queue: str, task_id: str, timeout: float, poll_interval: float, stop: _Stop
    ) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        task = self._follow(queue, task_id, deadline, stop)
        # The record decides; after the events, or when they could not be
        # followed, polling.
        pause = min(0.05, poll_interval)
        while True:
            if task is None:
                task = self.status(queue, task_id)
            if task.get("status") in TERMINAL_STATUSES:
                return task
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    "WAIT_TIMEOUT",
                    f"task {task_id} of queue {queue} is still {task.get('status')} "
                    f"after {timeout:g} s",
                    None,
                    {"task_id": task_id, "queue": queue, "status": task.get("status"), "task": task},
                )
            if stop.event.wait(min(pause, left)):
                raise _Stopped()
            pause = min(pause * 2, poll_interval)
            task = None

    def _follow(
        self, queue: str, task_id: str, deadline: float, stop: _Stop
    ) -> Optional[Dict[str, Any]]:
        """Follow task ``task_id``'s events until one of a final status or
        ``deadline``; the task's record if it had ended before the stream
        opened, else None. Returns early, saying nothing, whenever the
        events cannot be followed: the caller polls the record then, which
        decides in every case.

        The subscription starts a little before the task was created (its
        UUIDv7 holds the time), so events already written are read too;
        once it is in place the record is read once, for a task that ended
        before anything the stream still holds.
        """
        created = task_created_ms(task_id)
        since = None if created is None else f"{max(created - EVENTS_CLOCK_SLACK_MS, 0)}-0"
        path = f"/v1/queues/{segment(queue)}/events?" + urllib.parse.urlencode(
            {"task_id": task_id}
        )
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            stream = self._open_events(path, since, min(left, self.timeout))
        except DtqError:
            # EVENTS_OFF, TOO_MANY_EVENT_STREAMS, an old server, no answer.
            return None
        stop.watch(stream)
        try:
            task = self.status(queue, task_id)
            if task.get("status") in TERMINAL_STATUSES:
                return task
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or stop.event.is_set():
                    return None
                events = stream.read(min(left, STREAM_IDLE_S))
                if events is None:
                    return None
                for event in events:
                    # A gap (the stream was trimmed past `since`) loses
                    # only events older than the record read above.
                    if event.event in TERMINAL_STATUSES:
                        return None
        except (OSError, http.client.HTTPException, SseError, DtqError):
            # The deadline, a broken stream, or a record that could not be
            # read: the polling that follows decides (and raises what it
            # must).
            return None
        finally:
            stop.watch(None)
            stream.close()
            if stop.event.is_set():
                raise _Stopped()


class EventStream(Iterator[Dict[str, Any]]):
    """A queue's events, live: an iterator of dicts, one per event (see
    :func:`event_dict`), that does not end by itself.

    A stream that ends or breaks is opened again after the last event
    yielded (``Last-Event-ID``), with a pause that grows to 5 s, so nothing
    is lost or repeated; so is one silent for 45 s (the server sends a
    comment every 15 s). The first connection's failure is raised by
    :meth:`Client.events`; later ones are waited out, but for answers no retry can change (401, 403,
    400, 409), which are raised. ``close()`` (or leaving a ``with`` block)
    ends it, also from another thread. ``last_event_id`` is where it stands.
    """

    def __init__(self, client: Client, path: str, since: Optional[str]) -> None:
        self._client = client
        self._path = path
        #: The id of the last event read: resume from it with ``since=``.
        self.last_event_id = since
        self._stop = _Stop()
        self._stream: Optional[_Stream] = None
        self._pending: Deque[Dict[str, Any]] = collections.deque()
        self._connected = False
        self._failures = 0
        self._connect()

    def __iter__(self) -> "EventStream":
        return self

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """End the stream; a ``next()`` blocked in another thread returns
        (``StopIteration``) at once."""
        self._stop.set()

    def __next__(self) -> Dict[str, Any]:
        while True:
            if self._stop.event.is_set():
                self._drop()
                raise StopIteration
            if self._pending:
                return self._pending.popleft()
            if self._stream is None and not self._connect():
                continue
            assert self._stream is not None
            try:
                events = self._stream.read(STREAM_IDLE_S)
            except (OSError, http.client.HTTPException, SseError):
                events = None
            if events is None:
                self._drop()
                self._pause()
                continue
            for event in events:
                self._failures = 0
                if event.id is not None:
                    self.last_event_id = event.id
                self._pending.append(event_dict(event))

    def _connect(self) -> bool:
        """Open the stream; False (after a pause) when it could not be, to
        be tried again."""
        try:
            stream = self._client._open_events(
                self._path, self.last_event_id, self._client.timeout
            )
        except DtqError as e:
            final = e.status is not None and e.status < 500 and e.status != 429
            if not self._connected or final:
                raise
            self._pause()
            return False
        self._stream = stream
        self._connected = True
        self._stop.watch(stream)
        return True

    def _drop(self) -> None:
        stream, self._stream = self._stream, None
        self._stop.watch(None)
        if stream is not None:
            stream.close()

    def _pause(self) -> None:
        self._failures += 1
        pause = min(0.1 * (2 ** min(self._failures, 6)), MAX_RECONNECT_PAUSE_S)
        self._stop.event.wait(pause)

    def __del__(self) -> None:
        stream = getattr(self, "_stream", None)
        if stream is not None:
            try:
                stream.close()
            except Exception:
                pass
