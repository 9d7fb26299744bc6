"""The one error the client raises, and how an answer becomes one."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

#: A client-side code: the server could not be reached, the connection
#: broke, or no answer came within the client's timeout (``status`` is None).
CONNECTION_FAILED = "CONNECTION_FAILED"
#: A client-side code: an answer that is not dtq's (not JSON, or an error
#: without dtq's error body, as a proxy in between may send).
INVALID_RESPONSE = "INVALID_RESPONSE"
#: A client-side code: :meth:`Client.wait` gave up before the task ended.
WAIT_TIMEOUT = "WAIT_TIMEOUT"


class DtqError(Exception):
    """An error answer of the API, or a request that got no answer.

    ``code`` is the API's error code (``UNKNOWN_TASK``, ``QUEUE_FULL``, ...,
    see the README's HTTP API section) or one of the client's own:
    ``CONNECTION_FAILED``, ``INVALID_RESPONSE``, ``WAIT_TIMEOUT``.
    ``status`` is the HTTP status (None when there was no answer),
    ``details`` the error body's details (a dict, empty when it has none),
    and the message, ``str(error)``, is the API's.
    """

    def __init__(
        self,
        code: str,
        message: str,
        status: Optional[int] = None,
        details: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.details: Dict[str, Any] = details if details is not None else {}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, "
            f"status={self.status!r}, details={self.details!r})"
        )


class WaitTimeout(DtqError, TimeoutError):
    """:meth:`Client.wait` reached its timeout before the task ended.

    ``code`` is ``WAIT_TIMEOUT``; ``details`` holds ``task_id``, ``queue``,
    ``status`` (the last one seen) and ``task``, the last record read.
    """


def error_from_answer(status: int, body: bytes) -> DtqError:
    """The error an answer with HTTP ``status`` and ``body`` stands for.

    dtq answers every error with ``{"error": {"code", "message",
    "details"}}``; anything else came from something in between.
    """
    try:
        parsed = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        details = error.get("details")
        return DtqError(
            error["code"],
            str(error.get("message") or error["code"]),
            status,
            details if isinstance(details, dict) else {},
        )
    text = body[:200].decode("utf-8", "replace").strip()
    return DtqError(
        INVALID_RESPONSE,
        f"HTTP {status} without an error body" + (f": {text}" if text else ""),
        status,
        {},
    )
