"""``square``: square a number; the child task of ``fan_out``.

Payload → result::

    {"n": 3}   →   9
"""

from dtq_guest import FatalError, task


@task("square")
def square(payload, ctx):
    n = payload.get("n") if isinstance(payload, dict) else None
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        raise FatalError("payload does not match the handler's type: `n` is not a number")
    return n * n
