"""``fan_out``: square numbers in child tasks, then add the squares up.

Payload → result::

    {"numbers": [1, 2, 3], "queue": "default"}   →   {"sum_of_squares": 14}

The first run submits one ``square`` task per number, as a child, to
``queue`` (optional, default ``"default"``) and waits: the task goes
``WAITING`` without holding a worker slot. Once every child has ended, it
runs again, finds them in ``tasks.children()`` and adds up their results.
The submissions are exactly once: a retry of the first run stages the same
children. The operator must grant ``fan_out`` the ``square`` task on that
queue (``dtq deploy --submit-to``, or the worker's ``--submit-to``).
"""

from dtq_guest import FatalError, task, tasks


@task("fan_out")
def fan_out(payload, ctx):
    numbers = payload.get("numbers") if isinstance(payload, dict) else None
    if not isinstance(numbers, list):
        raise FatalError("payload does not match the handler's type: missing field `numbers`")
    done = tasks.children()
    if not done and numbers:
        # First run: one child per number, then wait for them all.
        queue = payload.get("queue", "default")
        for x in numbers:
            tasks.submit(queue, "square", {"n": x}, child=True)
        raise tasks.WaitForChildren()
    # Run again once the children ended: each holds its status and result.
    failed = [c for c in done if c.status != "SUCCEEDED"]
    if failed:
        raise FatalError(f"{len(failed)} of {len(done)} squares did not succeed: {failed[0].error}")
    return {"sum_of_squares": sum(c.result for c in done)}
