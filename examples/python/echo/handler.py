"""``echo``: return the payload unchanged.

The Python twin of ``examples/echo``. Payload → result: any JSON value ``X``
→ the same ``X``, byte for byte. The payload is taken as ``RawJson``, so it
is neither parsed nor re-serialized: the handler to measure the trip into
and out of the sandbox with.
"""

from dtq_guest import RawJson, task


@task("echo")
def echo(payload: RawJson) -> RawJson:
    return payload
