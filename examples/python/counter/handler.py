"""``counter``: add to a named counter kept in the handler's Redis namespace.

The Python twin of ``examples/counter``: same payloads, same results, same
keys. Payload → result::

    {"name": "visits", "by": 5}   →   {"name": "visits", "value": 12}

``by`` is optional (default 1) and may be negative. The counter lives at the
kv key ``counter:<name>``; the result holds its value after the increment.
"""

from dtq_guest import FatalError, kv, task


@task("counter")
def count(payload, ctx):
    name = payload.get("name") if isinstance(payload, dict) else None
    by = payload.get("by", 1) if isinstance(payload, dict) else None
    if not isinstance(name, str):
        raise FatalError("payload does not match the handler's type: missing field `name`")
    if not isinstance(by, int) or isinstance(by, bool):
        raise FatalError("payload does not match the handler's type: `by` is not an integer")
    value = kv.incr_by(f"counter:{name}", by)
    return {"name": name, "value": value}
