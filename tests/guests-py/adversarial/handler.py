"""``adversarial`` (Python): the subset of the Rust test guest
``tests/guests/adversarial`` that a Python handler can do, with the same
payloads and results, so the tests run the same limit cases in both
languages.

| payload | does | result |
|---|---|---|
| ``{"op": "ok"}`` | nothing | ``{"ok": true}`` |
| ``{"op": "fatal", "message": S}`` | raises ``FatalError(S)`` | fatal error ``S`` |
| ``{"op": "retry", "message": S}`` | raises ``RetryableError(S)`` | retryable error ``S`` |
| ``{"op": "panic", "message": S}`` | raises ``RuntimeError(S)`` | retryable error naming it |
| ``{"op": "loop"}`` | spins forever in the interpreter | never returns |
| ``{"op": "sleep", "ms": N}`` | spins N ms on the monotonic clock | ``{"slept_ms": N}`` |
| ``{"op": "alloc", "mb": N}`` | allocates and touches N MiB | ``{"allocated_mb": N}`` |
| ``{"op": "static_counter"}`` | increments a module-level counter | ``{"count": n}`` |
"""

import time

from dtq_guest import FatalError, RetryableError, task

_count = 0


@task("adversarial")
def adversarial(payload, ctx):
    global _count
    op = payload.get("op")
    if op == "ok":
        return {"ok": True}
    if op == "fatal":
        raise FatalError(payload["message"])
    if op == "retry":
        raise RetryableError(payload["message"])
    if op == "panic":
        raise RuntimeError(payload["message"])
    if op == "loop":
        n = 0
        while True:
            n += 1
    if op == "sleep":
        end = time.monotonic() + payload["ms"] / 1000
        while time.monotonic() < end:
            pass
        return {"slept_ms": payload["ms"]}
    if op == "alloc":
        # One MiB at a time, each written, as the Rust guest touches its pages.
        chunks = [bytearray(b"\x01" * (1 << 20)) for _ in range(payload["mb"])]
        return {"allocated_mb": len(chunks)}
    if op == "static_counter":
        _count += 1
        return {"count": _count}
    raise FatalError(f"unknown op {op!r}")
