// The JavaScript client against a real dtq with the example `echo` handler.
//
//   node smoke.mjs API_URL [--events-off]
//
// Submits a keyed task and waits for its result, resubmits the key and gets
// the same task back as a duplicate, checks the errors of bad requests,
// follows and resumes the queue's events, submits a batch, and cancels a
// delayed task; then prints one JSON line of what it saw, for the caller to
// check. With --events-off (a server run with `--events none`) it checks
// that wait() polls instead and events() is refused. Any failed check exits
// non-zero with the reason. Run where `dtq-client` is installed.

import { randomUUID } from "node:crypto";
import { isDeepStrictEqual } from "node:util";

import { Client, DtqError, WaitTimeout } from "dtq-client";

const QUEUE = "clients-js";
const WAIT_MS = 30_000;

function check(ok, what, seen) {
  if (!ok) throw new Error(`smoke: ${what}${seen === undefined ? "" : `: ${JSON.stringify(seen)}`}`);
}

async function expectError(call, code, status) {
  let answer;
  try {
    answer = await call();
  } catch (e) {
    check(e instanceof DtqError, "a DtqError", String(e));
    check(e.code === code && e.status === status, `expected ${code} (${status})`, [e.code, e.status, e.message]);
    check(typeof e.message === "string" && e.message.length > 0, "the API's message", e.message);
    check(typeof e.details === "object" && e.details !== null, "details is an object", e.details);
    return e;
  }
  throw new Error(`smoke: expected ${code} (${status}), got ${JSON.stringify(answer)}`);
}

async function submitAndWait(client, out) {
  const key = `order-${randomUUID()}`;
  const payload = { n: 7, text: "é/?#", list: [1, 2.5, null, true] };
  const first = await client.submit(QUEUE, "echo", payload, { idempotencyKey: key });
  check(first.duplicate === false && first.status === "QUEUED", "a new task", first);
  const task = await client.wait(QUEUE, first.task_id, { timeoutMs: WAIT_MS });
  check(task.status === "SUCCEEDED", "the task succeeded", task);
  check(isDeepStrictEqual(task.result, payload), "the result is the payload", task);
  const again = await client.submit(QUEUE, "echo", payload, { idempotencyKey: key });
  check(again.duplicate === true, "a replay is a duplicate", again);
  check(again.task_id === first.task_id, "a replay names the first task", again);
  check(isDeepStrictEqual(again.result, payload), "a replay carries the result", again);
  // A key no header can carry goes in the body, and keys the same way. The
  // task is delayed so that it is surely still in flight when resubmitted.
  const oddKey = `clé ${randomUUID()}`;
  const odd = await client.submit(QUEUE, "echo", 1, { idempotencyKey: oddKey, delayMs: 600_000 });
  const busy = await expectError(
    () => client.submit(QUEUE, "echo", 1, { idempotencyKey: oddKey }),
    "IDEMPOTENCY_IN_PROGRESS",
    409,
  );
  check(busy.details.task_id === odd.task_id, "a non-ASCII key keys", [odd, busy.details]);
  await client.cancel(QUEUE, odd.task_id);
  Object.assign(out, {
    task_id: first.task_id,
    key,
    result: task.result,
    duplicate: again.duplicate,
    duplicate_task_id: again.task_id,
    status: (await client.status(QUEUE, first.task_id)).status,
  });
}

async function errors(client, out) {
  const unknown = await expectError(() => client.submit(QUEUE, "no_such_task", {}), "UNKNOWN_TASK", 400);
  await expectError(() => client.submit(QUEUE, "echo", {}, { maxAttempts: 0 }), "INVALID_MAX_ATTEMPTS", 400);
  await expectError(() => client.submit("bad queue!", "echo", {}), "INVALID_QUEUE_NAME", 400);
  // The id is one path segment: encoded, it arrives whole.
  const missing = await expectError(() => client.status(QUEUE, "a/b?c#d"), "TASK_NOT_FOUND", 404);
  check(missing.details.task_id === "a/b?c#d", "the id arrived whole", missing.details);
  out.errors = { unknown_task: unknown.code, missing_task_id: missing.details.task_id };
}

async function events(client, out) {
  const stream = client.events(QUEUE);
  // Where a stream without `since` starts is fixed once the server took it.
  await stream.ready;
  const sub = await client.submit(QUEUE, "echo", { n: 8 });
  const seen = [];
  for await (const event of stream) {
    if (event.task_id === sub.task_id) {
      seen.push(event);
      if (event.status === "SUCCEEDED") break;
    }
  }
  check(seen[0].status === "QUEUED" && seen[0].event === "QUEUED", "QUEUED first", seen);
  check(seen.every((e) => e.id), "every event has an id", seen);
  check(seen.length >= 2, "more than one event", seen);
  // Resuming after the first event gives the second, and no other.
  const resumed = client.events(QUEUE, { since: seen[0].id, taskId: sub.task_id });
  const again = await resumed.next();
  resumed.close();
  check(isDeepStrictEqual(again.value, seen[1]), "resumed after the first event", [again, seen]);
  out.events = seen.map((e) => e.status);
}

async function batch(client, out) {
  const answer = await client.submitBatch(QUEUE, [
    { task: "echo", payload: { b: 1 } },
    { task: "echo", maxAttempts: 0 },
  ]);
  const statuses = answer.results.map((r) => r.status);
  check(isDeepStrictEqual(statuses, [202, 400]), "one accepted, one refused", answer);
  check(answer.results[1].body.error.code === "INVALID_MAX_ATTEMPTS", "its code", answer);
  const task = await client.wait(QUEUE, answer.results[0].body.task_id, { timeoutMs: WAIT_MS });
  check(isDeepStrictEqual(task.result, { b: 1 }), "the batch's task ran", task);
  out.batch = statuses;
}

async function cancel(client, out) {
  const delayed = await client.submit(QUEUE, "echo", { later: true }, { delayMs: 600_000 });
  check(delayed.status === "SCHEDULED", "a delayed task is scheduled", delayed);
  try {
    await client.wait(QUEUE, delayed.task_id, { timeoutMs: 500 });
    throw new Error("smoke: wait did not time out");
  } catch (e) {
    check(e instanceof WaitTimeout && e.code === "WAIT_TIMEOUT", "a WaitTimeout", String(e));
    check(e.message.includes(delayed.task_id), "the timeout names the task", e.message);
  }
  const cancelled = await client.cancel(QUEUE, delayed.task_id);
  check(cancelled.status === "CANCELLED", "cancelled", cancelled);
  const ended = await client.wait(QUEUE, delayed.task_id, { timeoutMs: WAIT_MS });
  check(ended.status === "CANCELLED", "wait returns the cancelled task", ended);
  await expectError(() => client.cancel(QUEUE, delayed.task_id), "TASK_TERMINAL", 409);
  const at = await client.submit(QUEUE, "echo", 1, { runAt: new Date(Date.now() + 3_600_000) });
  check(at.status === "SCHEDULED", "runAt schedules", at);
  await client.cancel(QUEUE, at.task_id);
  out.cancelled = ended.status;
}

async function eventsOff(client, out) {
  const sub = await client.submit(QUEUE, "echo", { polled: true });
  const task = await client.wait(QUEUE, sub.task_id, { timeoutMs: WAIT_MS });
  check(isDeepStrictEqual(task.result, { polled: true }), "wait polls without events", task);
  await expectError(() => client.events(QUEUE).next(), "EVENTS_OFF", 409);
  Object.assign(out, { task_id: sub.task_id, result: task.result });
}

const url = process.argv[2];
const client = new Client({ url, timeoutMs: 10_000 });
const out = {};
if (process.argv.slice(3).includes("--events-off")) {
  await eventsOff(client, out);
} else {
  await submitAndWait(client, out);
  await errors(client, out);
  await events(client, out);
  await batch(client, out);
  await cancel(client, out);
}
console.log(JSON.stringify(out));
