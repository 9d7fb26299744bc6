"""Submit tasks from a handler, exactly once, and wait for children.

A submission is *staged*: nothing reaches a queue while the call runs. It
is applied when the attempt ends well (the handler returns, or raises
:class:`WaitForChildren`), or, inside an idempotent operation, with that
operation's commit. An attempt that fails, traps or is lost submits
nothing; one that succeeds submits each of its tasks exactly once, however
many times it ran before: without a ``key``, a submission is keyed by the
running task and its position (among the call's submissions, after those
of the task's earlier runs), so a retry stages the same tasks.

A handler submits only to the queues and tasks the operator granted it
(``dtq deploy --submit-to``, or the worker's ``--submit-to TASK=QUEUE``);
any other submission is refused with a fatal
:class:`~dtq_guest.HandlerError` whose refusal is
:attr:`~dtq_guest.Refusal.INVALID_ARGUMENT`. Other refusals map as in
:mod:`~dtq_guest.kv`: a payload larger than the host allows is fatal,
Redis being unavailable retryable.

Fan out and gather: submit children, raise :class:`WaitForChildren`, and
read their results when the task runs again.

>>> @task("fan_out")                                                  # doctest: +SKIP
... def fan_out(payload, ctx):
...     done = tasks.children()
...     if not done:
...         for x in payload["numbers"]:
...             tasks.submit("default", "square", {"n": x}, child=True)
...         raise tasks.WaitForChildren()
...     return {"sum_of_squares": sum(c.result for c in done if c.status == "SUCCEEDED")}
"""

import json
from dataclasses import dataclass
from typing import Any, Optional

from . import _bindings
from .errors import FatalError, Refusal, RetryableError, call_host

#: The message of the error a handler ends with while it waits for its children.
WAITING = "waiting for children"

_U32 = 2**32 - 1
_U64 = 2**64 - 1


@dataclass(frozen=True)
class Child:
    """One child of the running task, as it is now (:func:`children`)."""

    #: The child's task id.
    task_id: str
    #: Its queue.
    queue: str
    #: Its task name.
    task: str
    #: Its status: ``QUEUED``, ``RUNNING``, ``SUCCEEDED``, ``FAILED``,
    #: ``DEAD_LETTERED``, ``CANCELLED``, ``EXPIRED``, ...
    status: str
    #: Its result, parsed, once it succeeded; else None.
    result: Optional[Any]
    #: Its error, once it failed (or its last, while it retries); else None.
    error: Optional[str]


class WaitForChildren(RetryableError):
    """Raise it from a handler to end the attempt *waiting for its
    children* instead of failing: the task's staged submissions are applied,
    it goes ``WAITING`` (holding no slot), and it runs again, as the same
    attempt, once all its children are terminal; :func:`children` then lists
    them with their results.

    The handler wrapper tells the host (the WIT ``wait-for-children``
    import) when this escapes the handler, and ends the call with the
    retryable error ``"waiting for children"``; raised where it is caught,
    it does nothing. Submit the children (``child=True``) before raising it.

    >>> raise tasks.WaitForChildren()  # doctest: +SKIP
    """

    def __init__(self, message=WAITING, *, refusal=None):
        super().__init__(message, refusal=refusal)


def submit(
    queue,
    task,
    payload,
    key=None,
    delay_ms=None,
    max_attempts=None,
    group=None,
    child=False,
):
    """Stage the submission of task ``task`` to ``queue`` with ``payload``
    (any JSON-serializable value, or a :class:`~dtq_guest.RawJson` sent as
    it is); returns the task's id.

    ``key`` is the submission's idempotency key in its queue (default: one
    derived from the running task and the submission's position);
    ``delay_ms`` delays the task's first run by that many milliseconds after
    the submission is applied; ``max_attempts`` is the task's attempts in
    all (default: its handler's, else the fleet's); ``group`` is its group,
    for a queue's group limit; ``child=True`` submits it as a child of the
    running task (:func:`children`, :class:`WaitForChildren`).

    >>> id = tasks.submit(                                  # doctest: +SKIP
    ...     "emails", "send_receipt", {"order_id": "A-1"}, key="receipt:A-1")
    """
    from .handler import RawJson

    if isinstance(payload, RawJson):
        text = str(payload)
    else:
        try:
            text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise FatalError(f"tasks submit: cannot serialize the payload: {e}") from None
    wit = _wit()
    options = wit.SubmitOptions(
        key=None if key is None else str(key),
        delay_ms=_whole("delay_ms", delay_ms, _U64),
        max_attempts=_whole("max_attempts", max_attempts, _U32),
        group=None if group is None else str(group),
        child=bool(child),
    )
    return call_host("tasks submit", wit.submit, str(queue), str(task), text, options)


def children():
    """The running task's children whose submissions were applied, in
    submission order, as :class:`Child` values; empty before any. A child
    that failed is listed with its status and error: the handler decides
    what that means.

    >>> failed = [c for c in tasks.children() if c.status != "SUCCEEDED"]  # doctest: +SKIP
    """
    return [_child(c) for c in call_host("tasks children", _wit().children)]


def _wit():
    return _bindings.module("tasks")


def _whole(name, value, most):
    """``value`` as an int in ``0..=most``, or None; else a fatal error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise FatalError(
            f"tasks submit: invalid argument: {name} must be a whole number from 0 to {most}, "
            f"not {value!r}",
            refusal=Refusal.INVALID_ARGUMENT,
        )
    return value


def _child(c):
    result = None
    if c.result is not None:
        try:
            result = json.loads(c.result)
        except ValueError as e:
            raise FatalError(
                f"tasks children: result of child {c.task_id} does not parse: {e}"
            ) from None
    return Child(
        task_id=c.task_id,
        queue=c.queue,
        task=c.task,
        status=c.status,
        result=result,
        error=c.error,
    )


def _ask_to_wait():
    """Tell the host that this call, ending with an error, waits for its
    children (the handler wrapper's part of :class:`WaitForChildren`)."""
    _wit().wait_for_children()
