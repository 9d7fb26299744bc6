"""A client of dtq's HTTP API: submit tasks, follow them, wait for results.

    from dtq_client import Client

    dtq = Client("http://localhost:8080", token=None)
    sub = dtq.submit("default", "echo", {"n": 1}, idempotency_key="order-1")
    task = dtq.wait("default", sub["task_id"], timeout=30)
    print(task["status"], task["result"])

:class:`Client` blocks; :class:`AsyncClient` has the same methods as
coroutines. Every error is a :class:`DtqError` with the API's ``code``,
``status`` and ``details``. The standard library only.
"""

__version__ = "0.1.0"

from ._errors import DtqError, WaitTimeout  # noqa: E402
from ._client import (  # noqa: E402
    TERMINAL_STATUSES,
    Client,
    EventStream,
    segment,
    submission,
)
from ._async import AsyncClient  # noqa: E402

__all__ = [
    "AsyncClient",
    "Client",
    "DtqError",
    "EventStream",
    "TERMINAL_STATUSES",
    "WaitTimeout",
    "segment",
    "submission",
]
