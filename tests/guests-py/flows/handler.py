"""``flows`` (Python): submitting tasks from a handler and waiting for
children, for the polyglot flow tests; the Rust and JavaScript twins take
the same payloads and give the same results.

| payload | does | result |
|---|---|---|
| ``{"fan_out": N, "queue": Q, "task": T}`` | with no children yet: submits N children (task T on queue Q, payload ``{"n": i}`` for i in 0..N) and waits for them | once they are all terminal: ``{"sum": Σ n of the children that SUCCEEDED, "children": count, "failed": count not SUCCEEDED}`` |
| ``{"submit": {"queue": Q, "task": T, "payload": P, "key": K}}`` | submits one task (not a child); ``key`` is optional | ``{"id": <its id>}`` |
| ``{"submit_then_fail": {"queue": Q, "task": T}}`` | submits one task, then fails with a retryable error: nothing is submitted | none |
| ``{"denied": {"queue": Q, "task": T}}`` | tries to submit where the handler is not granted | ``{"refused": <the error's message>}`` when refused, else ``{"refused": null}`` |
"""

from dtq_guest import FatalError, HandlerError, Refusal, RetryableError, task, tasks


@task("flows")
def flows(payload, ctx):
    if "fan_out" in payload:
        done = tasks.children()
        if not done:
            for i in range(payload["fan_out"]):
                tasks.submit(payload["queue"], payload["task"], {"n": i}, child=True)
            raise tasks.WaitForChildren()
        succeeded = [c for c in done if c.status == "SUCCEEDED"]
        return {
            "sum": sum(c.result["n"] for c in succeeded),
            "children": len(done),
            "failed": len(done) - len(succeeded),
        }
    if "submit" in payload:
        s = payload["submit"]
        id = tasks.submit(s["queue"], s["task"], s.get("payload"), key=s.get("key"))
        return {"id": id}
    if "submit_then_fail" in payload:
        s = payload["submit_then_fail"]
        tasks.submit(s["queue"], s["task"], {})
        raise RetryableError("failed after submitting")
    if "denied" in payload:
        s = payload["denied"]
        try:
            tasks.submit(s["queue"], s["task"], {})
        except HandlerError as e:
            if e.refusal is not Refusal.INVALID_ARGUMENT:
                raise
            return {"refused": e.message}
        return {"refused": None}
    raise FatalError(f"unknown payload {payload!r}")
