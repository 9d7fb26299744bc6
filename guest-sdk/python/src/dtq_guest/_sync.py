"""Run ``async def`` handlers and effects without an event loop.

Every host import is synchronous (it returns once the host has answered),
so a coroutine in a handler never has anything to wait for: it runs to
completion in one step. Awaiting something that does wait (``asyncio.sleep``,
a task) has no loop to wait on, and fails the call with a clear error.
"""

import inspect


def resolve(value):
    """``value``, or the result of running it to completion if it is a coroutine."""
    if not inspect.iscoroutine(value):
        return value
    try:
        value.send(None)
    except StopIteration as done:
        return done.value
    value.close()
    raise RuntimeError(
        "a dtq handler has no event loop: it may await other coroutines and "
        "idempotent_operation, but not asyncio primitives such as sleep or tasks"
    )


class Awaitable(tuple):
    """A tuple that may also be awaited (to the same tuple), so that both
    ``executed, result = idempotent_operation(...)`` and the asyncio-style
    ``executed, result = await idempotent_operation(...)`` read naturally."""

    __slots__ = ()

    def __await__(self):
        return self
        yield  # pragma: no cover - makes this a generator
