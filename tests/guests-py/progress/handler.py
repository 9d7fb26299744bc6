"""``progress`` (Python): the twin of ``tests/guests/progress``, for its
``reports`` operation.

Payload → result: ``{"reports": [[F, M], [F, M, N], ...]}`` →
``{"reported": n}``, after reporting each pair in order: fraction ``F`` (a
number, or ``"nan"``, ``"inf"``, ``"-inf"``) and message ``M``, repeated
``N`` times when given.
"""

from dtq_guest import FatalError, progress, task

NAMED = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@task("progress")
def report(payload, ctx):
    reports = payload.get("reports", [])
    for entry in reports:
        if len(entry) < 2 or not isinstance(entry[1], str):
            raise FatalError("a report is [fraction, message] or [fraction, message, times]")
        fraction = NAMED.get(entry[0], entry[0]) if isinstance(entry[0], str) else entry[0]
        times = entry[2] if len(entry) > 2 else 1
        progress(fraction, entry[1] * times)
    return {"reported": len(reports)}
