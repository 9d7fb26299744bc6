"""``@task``: make a function the component's handler, and the export that
runs it.

A handler is a function ``(payload, ctx)`` (or just ``(payload)``) where
``payload`` is the task's JSON payload parsed (``dict``, ``list``, ``str``,
numbers, ``None``) and the return value is the result, written back as
compact JSON. A payload parameter annotated :class:`RawJson` gets the text as
submitted, unparsed; a :class:`RawJson` returned is sent as it is. The
handler may be an ``async def``.

How a call ends decides what the host does with the task:

* a return → SUCCEEDED with the result;
* :class:`~dtq_guest.RetryableError`, or any other exception (its traceback
  goes to the task log), or a trap → retried with backoff until the attempts
  run out, then dead-lettered;
* :class:`~dtq_guest.FatalError` (or a payload that is not JSON, a result
  that does not serialize) → FAILED at once;
* :class:`~dtq_guest.tasks.WaitForChildren` → WAITING for the task's
  children, then run again as the same attempt.
"""

import inspect
import json
import re
import sys
import traceback

from . import _bindings, _sync, tasks
from .context import Context
from .errors import FatalError, HandlerError, RetryableError

#: A namespace: 1 to 64 ASCII letters, digits, ``-``, ``_`` or ``.``, as the host accepts.
NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

_registered = None


class RawJson(str):
    """JSON text taken or returned as it is, without parsing or serializing.

    As a payload (annotate the parameter) it holds the text the task was
    submitted with; as a result its text goes to the host unchanged, so it
    must be valid JSON.
    """

    __slots__ = ()


def task(name, *, namespace=None):
    """Make the decorated function this component's handler for task ``name``.

    ``name`` names the component the build writes (``<name>.wasm``; deploy it
    under that task name). ``namespace`` asks for the handler's kv keys and
    idempotency claims to live in namespace ``namespace`` instead of its task
    name; the build embeds it in the component (custom section
    ``dtq-namespace``), and the host loads it only where the operator gave
    the task exactly that namespace (``--namespace TASK=NS``). Both must be
    string literals, which the build reads from the source.

    >>> @task("count")                   # doctest: +SKIP
    ... def count(payload, ctx):
    ...     return {"value": kv.incr(payload["name"])}
    """
    if not isinstance(name, str) or not name:
        raise ValueError("@task needs the task name, a non-empty string")
    if namespace is not None and not NAMESPACE.fullmatch(namespace):
        raise ValueError(
            "a dtq namespace may hold only 1 to 64 ASCII letters, digits, '-', '_' and '.'"
        )

    def register(fn):
        global _registered
        if _registered is not None and _registered[0] is not fn:
            raise ValueError("one component has one handler: @task is used twice")
        params = list(inspect.signature(fn).parameters.values())
        raw = bool(params) and params[0].annotation in (RawJson, "RawJson")
        _registered = (fn, len(params) >= 2, raw)
        return fn

    return register


def _call(ctx, payload):
    """Run one call: parse the payload, call the handler, write the result."""
    if _registered is None:
        raise FatalError("the component has no handler: decorate one function with @task")
    fn, wants_ctx, raw = _registered
    if raw:
        arg = RawJson(payload)
    else:
        try:
            arg = json.loads(payload)
        except ValueError as e:
            raise FatalError(f"payload does not match the handler's type: {e}") from None
    args = (arg, Context._from_wit(ctx)) if wants_ctx else (arg,)
    result = _sync.resolve(fn(*args))
    if isinstance(result, RawJson):
        return str(result)
    try:
        return json.dumps(result, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise FatalError(f"cannot serialize the handler's result: {e}") from None


def _handler_error(err):
    types = _bindings.module("dtq_handler_types")
    if err.fatal:
        return types.HandlerError_Fatal(err.message)
    return types.HandlerError_Retryable(err.message)


class WitWorld:
    """The component's export (``handle``), as componentize-py looks it up in
    the entry module the build generates."""

    def handle(self, ctx, payload):
        from componentize_py_types import Err

        try:
            return _call(ctx, payload)
        except HandlerError as err:
            if isinstance(err, tasks.WaitForChildren):
                tasks._ask_to_wait()
            raise Err(_handler_error(err)) from None
        except Exception as exc:  # noqa: BLE001 - any other error is retryable
            traceback.print_exc(file=sys.stderr)
            err = RetryableError(f"{type(exc).__name__}: {exc}")
            raise Err(_handler_error(err)) from None
