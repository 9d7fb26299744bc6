"""The Python client against a real dtq with the example `echo` handler.

    python smoke.py API_URL [--events-off]

Submits a keyed task and waits for its result, resubmits the key and gets
the same task back as a duplicate, checks the errors of bad requests,
follows and resumes the queue's events, submits a batch, and cancels a
delayed task; then prints one JSON line of what it saw, for the caller to
check. With --events-off (a server run with `--events none`) it checks
that wait() polls instead and events() is refused. Any failed check exits
non-zero with the reason.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import uuid
from typing import Any, Dict

from dtq_client import AsyncClient, Client, DtqError, WaitTimeout, submission

QUEUE = "clients-py"
WAIT_S = 30


def check(ok: bool, what: str, seen: Any = None) -> None:
    if not ok:
        raise SystemExit(f"smoke: {what}" + ("" if seen is None else f": {seen!r}"))


def expect_error(call: Any, code: str, status: int) -> DtqError:
    try:
        answer = call()
    except DtqError as e:
        check((e.code, e.status) == (code, status), f"expected {code} ({status})", e)
        check(bool(str(e)) and str(e) == e.message, "the API's message", e)
        check(isinstance(e.details, dict), "details is a dict", e)
        return e
    raise SystemExit(f"smoke: expected {code} ({status}), got {answer!r}")


def submit_and_wait(client: Client, out: Dict[str, Any]) -> None:
    key = f"order-{uuid.uuid4()}"
    payload = {"n": 7, "text": "é/?#", "list": [1, 2.5, None, True]}
    first = client.submit(QUEUE, "echo", payload, idempotency_key=key)
    check(first["duplicate"] is False and first["status"] == "QUEUED", "a new task", first)
    task = client.wait(QUEUE, first["task_id"], timeout=WAIT_S)
    check(task["status"] == "SUCCEEDED", "the task succeeded", task)
    check(task["result"] == payload, "the result is the payload", task)
    again = client.submit(QUEUE, "echo", payload, idempotency_key=key)
    check(again["duplicate"] is True, "a replay is a duplicate", again)
    check(again["task_id"] == first["task_id"], "a replay names the first task", again)
    check(again["result"] == payload, "a replay carries the result", again)
    # A key no header can carry goes in the body, and keys the same way. The
    # task is delayed so that it is surely still in flight when resubmitted.
    odd_key = f"clé {uuid.uuid4()}"
    odd = client.submit(QUEUE, "echo", 1, idempotency_key=odd_key, delay_ms=600_000)
    busy = expect_error(
        lambda: client.submit(QUEUE, "echo", 1, idempotency_key=odd_key),
        "IDEMPOTENCY_IN_PROGRESS",
        409,
    )
    check(busy.details.get("task_id") == odd["task_id"], "a non-ASCII key keys", (odd, busy.details))
    client.cancel(QUEUE, odd["task_id"])
    out.update(
        task_id=first["task_id"],
        key=key,
        result=task["result"],
        duplicate=again["duplicate"],
        duplicate_task_id=again["task_id"],
        status=client.status(QUEUE, first["task_id"])["status"],
    )


def errors(client: Client, out: Dict[str, Any]) -> None:
    unknown = expect_error(lambda: client.submit(QUEUE, "no_such_task", {}), "UNKNOWN_TASK", 400)
    expect_error(lambda: client.submit(QUEUE, "echo", {}, max_attempts=0), "INVALID_MAX_ATTEMPTS", 400)
    expect_error(lambda: client.submit("bad queue!", "echo", {}), "INVALID_QUEUE_NAME", 400)
    # The id is one path segment: encoded, it arrives whole.
    missing = expect_error(lambda: client.status(QUEUE, "a/b?c#d"), "TASK_NOT_FOUND", 404)
    check(missing.details.get("task_id") == "a/b?c#d", "the id arrived whole", missing.details)
    out["errors"] = {"unknown_task": unknown.code, "missing_task_id": missing.details["task_id"]}


def events(client: Client, out: Dict[str, Any]) -> None:
    with client.events(QUEUE) as stream:
        sub = client.submit(QUEUE, "echo", {"n": 8})
        seen = []
        for event in stream:
            if event["task_id"] == sub["task_id"]:
                seen.append(event)
                if event["status"] == "SUCCEEDED":
                    break
    check(seen[0]["status"] == "QUEUED" and seen[0]["event"] == "QUEUED", "QUEUED first", seen)
    check(all(e["id"] for e in seen), "every event has an id", seen)
    check(len(seen) >= 2, "more than one event", seen)
    # Resuming after the first event gives the second, and no other.
    with client.events(QUEUE, since=seen[0]["id"], task_id=sub["task_id"]) as resumed:
        again = next(resumed)
    check(again == seen[1], "resumed after the first event", (again, seen))
    out["events"] = [e["status"] for e in seen]


def batch(client: Client, out: Dict[str, Any]) -> None:
    answer = client.submit_batch(
        QUEUE,
        [submission("echo", {"b": 1}), {"task": "echo", "max_attempts": 0}],
    )
    statuses = [r["status"] for r in answer["results"]]
    check(statuses == [202, 400], "one accepted, one refused", answer)
    check(answer["results"][1]["body"]["error"]["code"] == "INVALID_MAX_ATTEMPTS", "its code", answer)
    task = client.wait(QUEUE, answer["results"][0]["body"]["task_id"], timeout=WAIT_S)
    check(task["result"] == {"b": 1}, "the batch's task ran", task)
    out["batch"] = statuses


def cancel(client: Client, out: Dict[str, Any]) -> None:
    delayed = client.submit(QUEUE, "echo", {"later": True}, delay_ms=600_000)
    check(delayed["status"] == "SCHEDULED", "a delayed task is scheduled", delayed)
    try:
        client.wait(QUEUE, delayed["task_id"], timeout=0.5)
        raise SystemExit("smoke: wait did not time out")
    except WaitTimeout as e:
        check(e.code == "WAIT_TIMEOUT" and delayed["task_id"] in str(e), "the timeout names the task", e)
    cancelled = client.cancel(QUEUE, delayed["task_id"])
    check(cancelled["status"] == "CANCELLED", "cancelled", cancelled)
    ended = client.wait(QUEUE, delayed["task_id"], timeout=WAIT_S)
    check(ended["status"] == "CANCELLED", "wait returns the cancelled task", ended)
    expect_error(lambda: client.cancel(QUEUE, delayed["task_id"]), "TASK_TERMINAL", 409)
    hour = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    at = client.submit(QUEUE, "echo", 1, run_at=hour)
    check(at["status"] == "SCHEDULED", "run_at schedules", at)
    client.cancel(QUEUE, at["task_id"])
    out["cancelled"] = ended["status"]


async def async_client(url: str, out: Dict[str, Any]) -> None:
    client = AsyncClient(url)
    sub = await client.submit(QUEUE, "echo", {"async": True}, idempotency_key=f"a-{uuid.uuid4()}")
    task = await client.wait(QUEUE, sub["task_id"], timeout=WAIT_S)
    check(task["result"] == {"async": True}, "the async client waits", task)
    stream = client.events(QUEUE, since="0", task_id=sub["task_id"])
    first = await stream.__anext__()
    await stream.aclose()
    check(first["task_id"] == sub["task_id"], "the async client's events", first)
    try:
        await client.status(QUEUE, "nope")
        raise SystemExit("smoke: the async status did not fail")
    except DtqError as e:
        check(e.code == "TASK_NOT_FOUND", "the async error", e)
    out["async_result"] = task["result"]


def events_off(client: Client, out: Dict[str, Any]) -> None:
    sub = client.submit(QUEUE, "echo", {"polled": True})
    task = client.wait(QUEUE, sub["task_id"], timeout=WAIT_S)
    check(task["result"] == {"polled": True}, "wait polls without events", task)
    expect_error(lambda: client.events(QUEUE), "EVENTS_OFF", 409)
    out.update(task_id=sub["task_id"], result=task["result"])


def main() -> None:
    url = sys.argv[1]
    client = Client(url, timeout=10)
    out: Dict[str, Any] = {}
    if "--events-off" in sys.argv[2:]:
        events_off(client, out)
    else:
        submit_and_wait(client, out)
        errors(client, out)
        events(client, out)
        batch(client, out)
        cancel(client, out)
        asyncio.run(async_client(url, out))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
