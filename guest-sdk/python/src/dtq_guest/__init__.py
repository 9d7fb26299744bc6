"""Write dtq task handlers in Python: one function from a JSON payload to a
JSON result, built into a WebAssembly component with componentize-py.

>>> from dtq_guest import task, idempotent_operation, kv
>>> @task("send_receipt")                                      # doctest: +SKIP
... def send_receipt(payload, ctx):
...     executed, charge = idempotent_operation(
...         f"charge:{payload['order_id']}", 86_400, lambda: charge_card(payload))
...     return {"order_id": payload["order_id"], "deduped": not executed}

``dtq-py build DIR`` (or ``scripts/build-python-handler DIR`` in the
repository) turns the directory's ``handler.py`` into ``<task>.wasm``. Inside
the sandbox a handler reaches only what this package offers:
:func:`idempotent_operation`, a namespaced slice of Redis in :mod:`kv`, the
task's :mod:`log`, :func:`progress` reports for whoever watches the task,
:mod:`tasks` to submit (exactly once) and wait for children, and outbound
:mod:`http` to the hosts the operator allows.
The host imports exist only inside a dtq worker; calling them elsewhere
raises :class:`RuntimeError`.
"""

from . import http, kv, log, tasks
from ._progress import progress
from .context import Context
from .errors import FatalError, HandlerError, Refusal, RetryableError
from .handler import RawJson, task
from .idempotency import (
    Abandoned,
    Done,
    Executed,
    InProgress,
    idempotent_operation,
    operation,
    stored_result,
)

__all__ = [
    "Abandoned",
    "Context",
    "Done",
    "Executed",
    "FatalError",
    "HandlerError",
    "InProgress",
    "RawJson",
    "Refusal",
    "RetryableError",
    "http",
    "idempotent_operation",
    "kv",
    "log",
    "operation",
    "progress",
    "stored_result",
    "task",
    "tasks",
]
