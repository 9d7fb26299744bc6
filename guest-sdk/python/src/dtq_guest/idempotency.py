"""Run a side effect once per key, across retries, redeliveries and crashes.

:func:`idempotent_operation` has the seed contract's shape, ``(executed,
result)``; :func:`operation` is the richer form, for handlers that react to
each case (:class:`Executed`, :class:`Done`, :class:`InProgress`,
:class:`Abandoned`).

What is guaranteed (the same as the Rust SDK; the host keeps the claim): the
effect's :mod:`~dtq_guest.kv` writes are *staged* by the host and applied with
the claim's "done" mark in one atomic step when ``fn`` returns, so they
happen exactly once within the TTL; an effect declared with
``external_effects=True`` (an HTTP call) happens at most once, and later
callers get :class:`Abandoned` if its attempt died mid-effect. If ``fn``
raises, none of its kv writes apply and the claim is released, so a retry of
the task runs it again. While another live attempt runs the effect,
:func:`idempotent_operation` raises a :class:`~dtq_guest.RetryableError`:
a handler never reports success for an effect that has not happened yet.

Results are stored as JSON text; a stored result that does not parse is a
:class:`~dtq_guest.FatalError`. One operation may be open at a time.
"""

import json
from dataclasses import dataclass
from typing import Any, Optional

from . import _bindings, _sync, log
from .errors import FatalError, RetryableError, call_host


@dataclass(frozen=True)
class Executed:
    """This call ran the effect and committed it: its result."""

    value: Any


@dataclass(frozen=True)
class Done:
    """The effect was done before (by this task or another): the result the
    executing call stored (None when it stored none)."""

    value: Optional[Any]


@dataclass(frozen=True)
class InProgress:
    """Another attempt that is still alive holds the key and has not
    finished: the outcome is not known yet. Retrying later finds it done, or
    takes it over if that attempt dies."""


@dataclass(frozen=True)
class Abandoned:
    """The attempt that held the key died while running an effect declared
    with ``external_effects=True``: it may or may not have happened, and the
    host will not run it again."""


def _dumps(value):
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _quoted(key):
    return json.dumps(key, ensure_ascii=False)


def idempotent_operation(key, ttl_seconds, fn):
    """Run ``fn()`` once per ``key`` within ``ttl_seconds``, as the seed
    contract has it: ``(True, result)`` to the call that runs it, ``(False,
    None)`` to every later call. ``fn`` may be a plain function or an
    ``async def``; the returned pair may be awaited.

    Raises :class:`~dtq_guest.RetryableError` while another live attempt is
    running the effect.

    >>> executed, total = idempotent_operation(
    ...     "charge:A-1", 86_400, lambda: kv.incr_by("charges:A-1", 1999))  # doctest: +SKIP
    """
    outcome = _begin_and_run(key, ttl_seconds, False, fn)
    if isinstance(outcome, Executed):
        return _sync.Awaitable((True, outcome.value))
    if isinstance(outcome, InProgress):
        raise RetryableError(
            f"idempotent operation {_quoted(key)} is in progress in another attempt"
        )
    return _sync.Awaitable((False, None))


def operation(key, ttl_seconds, fn, *, external_effects=False):
    """Run ``fn()`` once per ``key``, and say what happened: the richer form
    of :func:`idempotent_operation`. Returns :class:`Executed`,
    :class:`Done` (with the stored result, parsed), :class:`InProgress` or
    :class:`Abandoned`.

    >>> match operation("charge:A-1", 86_400, charge):  # doctest: +SKIP
    ...     case Executed(total) | Done(total): ...
    ...     case InProgress(): raise RetryableError("charge in progress")
    ...     case Abandoned(): raise FatalError("charge abandoned: check by hand")
    """
    outcome = _begin_and_run(key, ttl_seconds, external_effects, fn)
    if isinstance(outcome, Done) and outcome.value is not None:
        return Done(_parse_stored(key, outcome.value))
    return outcome


def stored_result(key):
    """The result stored by the operation that ran ``key``, parsed, if it is
    done and stored one and the claim has not expired; else None."""
    text = call_host("idempotency get-result", _wit().get_result, key)
    return None if text is None else _parse_stored(key, text)


def _wit():
    return _bindings.module("idempotency")


def _begin_and_run(key, ttl_seconds, external_effects, fn):
    """Open the operation and run ``fn`` if the claim is this call's; a done
    operation's stored result is left as JSON text."""
    wit = _wit()
    options = wit.BeginOptions(ttl_seconds=ttl_seconds, external_effects=external_effects)
    state = call_host("idempotency begin", wit.begin, key, options)
    case = type(state).__name__
    if case.endswith("_Run"):
        if state.value:
            log.info(
                "idempotent operation taken over from an attempt that died", key=key
            )
        return Executed(_run_claimed(wit, key, fn))
    if case.endswith("_Done"):
        return Done(state.value)
    if case.endswith("_InProgress"):
        return InProgress()
    return Abandoned()


def _run_claimed(wit, key, fn):
    """Run the effect of a claim this call holds, then commit or abort it."""
    try:
        value = _sync.resolve(fn())
    except BaseException as err:
        # The staged writes are dropped either way; a claim left behind (the
        # abort not answered) is taken over by the next attempt.
        try:
            call_host("idempotency abort", wit.abort, key)
        except Exception as abort:  # noqa: BLE001 - reported, the effect's error wins
            log.warn(
                "the claim was not released; the next attempt takes it over",
                key=key,
                reason=abort,
            )
        raise err
    try:
        text = _dumps(value)
    except (TypeError, ValueError) as e:
        call_host("idempotency abort", wit.abort, key)
        raise FatalError(f"result of {_quoted(key)} does not serialize: {e}") from None
    # Refused or lost, nothing applied; unknown, the next attempt finds the
    # commit applied or takes the claim over.
    call_host("idempotency commit", wit.commit, key, text)
    return value


def _parse_stored(key, text):
    try:
        return json.loads(text)
    except ValueError as e:
        raise FatalError(f"stored result of {_quoted(key)} does not parse: {e}") from None
