"""``operations`` (Python): the ``run`` and ``seed`` commands of the Rust
test guest ``tests/guests/operations``, with the same payloads and results,
so the idempotent-operation tests run in both languages.

| payload | does | result |
|---|---|---|
| ``{"op": "run", "key": K, "incr": [S…], "set": [[S, V]…], "spin_ms": N, "then": T, "external": B, "ttl": N}`` | ``operation(K)`` whose effect increments each ``incr`` key, sets each ``set`` pair, spins N ms, then ends as T: ``"ok"`` (default) or ``"fail"`` (a retryable error) | ``{"outcome": "executed", "value": [n…]}``, ``{"outcome": "done", "value": …}``, ``{"outcome": "in_progress"}`` or ``{"outcome": "abandoned"}`` |
| ``{"op": "seed", "key": K, "incr": S}`` | ``idempotent_operation(K)`` around kv incr of S | ``{"executed": bool}`` |

``spin_ms`` busy-waits inside guest code, so a test can interrupt a call at
a known point.
"""

import time

from dtq_guest import (
    Abandoned,
    Done,
    Executed,
    FatalError,
    InProgress,
    RetryableError,
    idempotent_operation,
    kv,
    operation,
    task,
)

#: TTL of operations that name none.
TTL_SECONDS = 3_600


def spin(ms):
    end = time.monotonic() + ms / 1000
    while time.monotonic() < end:
        pass


@task("operations")
def operations(payload, ctx):
    op = payload.get("op")
    if op == "run":
        def effect():
            values = [kv.incr(k) for k in payload.get("incr", [])]
            for k, v in payload.get("set", []):
                kv.set(k, v)
            spin(payload.get("spin_ms", 0))
            if payload.get("then", "ok") == "fail":
                raise RetryableError("the effect failed")
            return values

        outcome = operation(
            payload["key"],
            payload.get("ttl") or TTL_SECONDS,
            effect,
            external_effects=payload.get("external", False),
        )
        match outcome:
            case Executed(values):
                return {"outcome": "executed", "value": values}
            case Done(value):
                return {"outcome": "done", "value": value}
            case InProgress():
                return {"outcome": "in_progress"}
            case Abandoned():
                return {"outcome": "abandoned"}
    if op == "seed":
        executed, _ = idempotent_operation(
            payload["key"], TTL_SECONDS, lambda: kv.incr(payload["incr"])
        )
        return {"executed": executed}
    raise FatalError(f"unknown op {op!r}")
