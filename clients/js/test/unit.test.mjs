// Unit tests of dtq-client that need no dtq: the event stream parser, the
// request each call sends (against a stand-in HTTP server that records it
// and answers as dtq would), error parsing, wait's fallback to polling, and
// an event stream's reconnection with Last-Event-ID.
//
//   node --test clients/js/test/unit.test.mjs

import assert from "node:assert/strict";
import http from "node:http";
import { test } from "node:test";

import {
  Client,
  DtqError,
  SseParser,
  WaitTimeout,
  errorFromAnswer,
  segment,
  submission,
  taskCreatedMs,
} from "../index.js";

const TASK_ID = "019af1c2-3b4d-7e5f-8a9b-0c1d2e3f4a5b";

function parse(...chunks) {
  const parser = new SseParser();
  const events = chunks.flatMap((chunk) => parser.feed(chunk));
  return { events, parser };
}

test("events as the API sends them", () => {
  const { events, parser } = parse(
    ": keep-alive\n\n",
    'id: 1-0\nevent: QUEUED\ndata: {"task_id":"t"}\n\n',
    "event: gap\ndata: {}\n\n",
  );
  assert.deepEqual(events, [
    { event: "QUEUED", data: '{"task_id":"t"}', id: "1-0" },
    { event: "gap", data: "{}", id: null },
  ]);
  assert.equal(parser.lastEventId, "1-0");
});

test("any line ending, split anywhere", () => {
  const text = "id: 7\r\nevent: A\rdata: x\r\ndata:y\n\r\n";
  const want = [{ event: "A", data: "x\ny", id: "7" }];
  for (let cut = 0; cut <= text.length; cut++) {
    assert.deepEqual(parse(text.slice(0, cut), text.slice(cut)).events, want, `cut at ${cut}`);
  }
  assert.deepEqual(parse(...text).events, want);
});

test("an event without data is not dispatched but keeps its id", () => {
  const { events, parser } = parse("id: 9\nevent: x\n\ndata\n\n");
  assert.deepEqual(events, [{ event: "message", data: "", id: null }]);
  assert.equal(parser.lastEventId, "9");
});

test("helpers", () => {
  assert.equal(segment("a/b?c#d %e"), "a%2Fb%3Fc%23d%20%25e");
  assert.equal(segment("é"), "%C3%A9");
  assert.equal(taskCreatedMs(TASK_ID), 0x019af1c23b4d);
  assert.equal(taskCreatedMs(`${TASK_ID}.3`), 0x019af1c23b4d);
  assert.equal(taskCreatedMs("not-a-uuid"), null);
  assert.deepEqual(
    submission("echo", { n: 1 }, {
      idempotencyKey: "k",
      maxAttempts: 3,
      runAt: new Date(Date.UTC(2026, 11, 3, 14)),
      timeoutMs: 500,
      expiresInMs: 9000,
      delayMs: undefined,
      group: "customer-7",
    }),
    {
      task: "echo",
      payload: { n: 1 },
      idempotency_key: "k",
      max_attempts: 3,
      run_at: 1796306400000,
      timeout_ms: 500,
      expires_in_ms: 9000,
      group: "customer-7",
    },
  );
  assert.deepEqual(submission("echo"), { task: "echo", payload: null });
  assert.throws(() => new Client({ url: "localhost:8080" }), TypeError);
});

test("the API error body becomes a DtqError", () => {
  const e = errorFromAnswer(400, JSON.stringify({ error: { code: "UNKNOWN_TASK", message: "no task", details: { t: 1 } } }));
  assert.ok(e instanceof DtqError && e instanceof Error);
  assert.deepEqual([e.code, e.status, e.details, e.message, e.name], ["UNKNOWN_TASK", 400, { t: 1 }, "no task", "DtqError"]);
  const other = errorFromAnswer(502, "<html>Bad Gateway</html>");
  assert.deepEqual([other.code, other.status], ["INVALID_RESPONSE", 502]);
  assert.match(other.message, /Bad Gateway/);
  assert.ok(new WaitTimeout("m", {}) instanceof DtqError);
});

/** A stand-in HTTP server: records each request and answers with what
 * `answer(request, res)` gives (`[status, body]`), or lets it write the
 * response itself (returns nothing). */
async function standIn(answer) {
  const requests = [];
  const server = http.createServer(async (req, res) => {
    let raw = "";
    for await (const chunk of req) raw += chunk;
    const request = { method: req.method, path: req.url, headers: req.headers, body: raw ? JSON.parse(raw) : null };
    requests.push(request);
    const answered = answer(request, res);
    if (!answered) return;
    const [status, body] = answered;
    res.writeHead(status, { "Content-Type": "application/json" });
    res.end(typeof body === "string" ? body : JSON.stringify(body));
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const url = `http://127.0.0.1:${server.address().port}`;
  return {
    url,
    requests,
    close: () => {
      server.closeAllConnections?.();
      return new Promise((resolve) => server.close(resolve));
    },
  };
}

const apiError = (status, code, details = {}) => [status, { error: { code, message: `${code} here`, details } }];

test("paths are encoded, the token and key sent", async (t) => {
  const server = await standIn(() => [202, { task_id: TASK_ID, duplicate: false }]);
  t.after(server.close);
  const client = new Client({ url: `${server.url}/prefix/`, token: "s3cret" });
  assert.deepEqual(await client.submit("q", "echo", { n: 1 }, { idempotencyKey: "order-1", delayMs: 5 }), {
    task_id: TASK_ID,
    duplicate: false,
  });
  await client.submit("q", "echo", [1], { idempotencyKey: "clé" });
  await client.status("q", "a/b?c");
  await client.cancel("q", "x y");
  await client.submitBatch("q", [{ task: "echo", payload: 1, idempotencyKey: "b" }, { task: "echo", run_at: "2026-12-03T14:00:00Z" }]);
  const [first, second, status, cancel, batch] = server.requests;
  assert.equal(first.path, "/prefix/v1/queues/q/tasks");
  assert.equal(first.headers.authorization, "Bearer s3cret");
  assert.equal(first.headers["idempotency-key"], "order-1");
  assert.match(first.headers["content-type"], /^application\/json/);
  assert.deepEqual(first.body, { task: "echo", payload: { n: 1 }, delay_ms: 5 });
  assert.equal(second.headers["idempotency-key"], undefined);
  assert.equal(second.body.idempotency_key, "clé");
  assert.deepEqual([status.method, status.path], ["GET", "/prefix/v1/queues/q/tasks/a%2Fb%3Fc"]);
  assert.deepEqual([cancel.method, cancel.path], ["POST", "/prefix/v1/queues/q/tasks/x%20y/cancel"]);
  assert.deepEqual(batch.body, {
    tasks: [
      { task: "echo", payload: 1, idempotency_key: "b" },
      { task: "echo", payload: null, run_at: "2026-12-03T14:00:00Z" },
    ],
  });
});

test("an error answer rejects with its code, status and details", async (t) => {
  const server = await standIn(() => apiError(409, "IDEMPOTENCY_IN_PROGRESS", { task_id: TASK_ID }));
  t.after(server.close);
  await assert.rejects(new Client({ url: server.url }).submit("q", "echo", 1, { idempotencyKey: "k" }), (e) => {
    assert.ok(e instanceof DtqError);
    assert.deepEqual([e.code, e.status, e.details, e.message], ["IDEMPOTENCY_IN_PROGRESS", 409, { task_id: TASK_ID }, "IDEMPOTENCY_IN_PROGRESS here"]);
    return true;
  });
});

test("no server is a connection failure, and so is no answer in time", async (t) => {
  const server = await standIn(() => undefined);
  const { url } = server;
  await assert.rejects(new Client({ url, timeoutMs: 200 }).status("q", "t"), (e) => {
    assert.deepEqual([e.code, e.status], ["CONNECTION_FAILED", null]);
    assert.match(e.message, /within 200 ms/);
    return true;
  });
  await server.close();
  await assert.rejects(new Client({ url }).status("q", "t"), (e) => {
    assert.deepEqual([e.code, e.status], ["CONNECTION_FAILED", null]);
    return true;
  });
});

test("wait polls when events are off, and gives up naming the task", async (t) => {
  let polls = 0;
  let done = true;
  const server = await standIn((r) => {
    if (r.path.includes("/events")) return apiError(409, "EVENTS_OFF");
    polls += 1;
    return [200, { task_id: TASK_ID, status: done && polls >= 3 ? "SUCCEEDED" : "RUNNING", result: 42 }];
  });
  t.after(server.close);
  const client = new Client({ url: server.url });
  const task = await client.wait("q", TASK_ID, { timeoutMs: 10_000, pollIntervalMs: 50 });
  assert.deepEqual([task.status, task.result, polls], ["SUCCEEDED", 42, 3]);
  const events = server.requests[0];
  assert.equal(events.path, `/v1/queues/q/events?task_id=${TASK_ID}`);
  assert.equal(events.headers["last-event-id"], `${0x019af1c23b4d - 2000}-0`);
  assert.equal(events.headers.accept, "text/event-stream");

  done = false;
  const start = performance.now();
  await assert.rejects(client.wait("q", TASK_ID, { timeoutMs: 300, pollIntervalMs: 50 }), (e) => {
    assert.ok(e instanceof WaitTimeout);
    assert.deepEqual([e.code, e.details.task_id, e.details.status], ["WAIT_TIMEOUT", TASK_ID, "RUNNING"]);
    assert.match(e.message, new RegExp(TASK_ID));
    return true;
  });
  assert.ok(performance.now() - start < 3000);

  const stream = client.events("q");
  await assert.rejects(stream.next(), (e) => [e.code, e.status].join() === "EVENTS_OFF,409");
});

test("wait follows the events to the end, then reads the record", async (t) => {
  let reads = 0;
  const server = await standIn((r, res) => {
    if (r.path.includes("/events")) {
      res.writeHead(200, { "Content-Type": "text/event-stream" });
      res.write(": hello\n\n");
      setTimeout(() => res.write(`id: 5-0\nevent: SUCCEEDED\ndata: {"task_id":"${TASK_ID}"}\n\n`), 100);
      return undefined;
    }
    reads += 1;
    return [200, { task_id: TASK_ID, status: reads > 1 ? "SUCCEEDED" : "RUNNING" }];
  });
  t.after(server.close);
  // A poll every 10 s: only the event can end this wait quickly.
  const start = performance.now();
  const task = await new Client({ url: server.url }).wait("q", TASK_ID, { timeoutMs: 20_000, pollIntervalMs: 10_000 });
  assert.equal(task.status, "SUCCEEDED");
  assert.equal(reads, 2);
  assert.ok(performance.now() - start < 5000);
});

test("an event stream reconnects after the last event with Last-Event-ID", async (t) => {
  let opened = 0;
  const server = await standIn((r, res) => {
    opened += 1;
    res.writeHead(200, { "Content-Type": "text/event-stream" });
    const n = opened;
    // Each connection sends one event, then ends.
    res.end(`id: ${n}-0\nevent: QUEUED\ndata: {"task_id":"t${n}","status":"QUEUED"}\n\n`);
    return undefined;
  });
  t.after(server.close);
  const stream = new Client({ url: server.url }).events("q", { since: "0-1", taskId: "t" });
  const seen = [];
  for await (const event of stream) {
    seen.push(event);
    if (seen.length === 3) break;
  }
  assert.deepEqual(
    seen.map((e) => [e.id, e.event, e.task_id, e.status]),
    [["1-0", "QUEUED", "t1", "QUEUED"], ["2-0", "QUEUED", "t2", "QUEUED"], ["3-0", "QUEUED", "t3", "QUEUED"]],
  );
  assert.deepEqual(
    server.requests.slice(0, 3).map((r) => [r.path, r.headers["last-event-id"]]),
    [["/v1/queues/q/events?task_id=t", "0-1"], ["/v1/queues/q/events?task_id=t", "1-0"], ["/v1/queues/q/events?task_id=t", "2-0"]],
  );
  assert.equal(stream.lastEventId, "3-0");
  assert.deepEqual(await stream.next(), { done: true, value: undefined });
});

test("an aborted wait rejects with the signal's reason", async (t) => {
  const server = await standIn((r) =>
    r.path.includes("/events") ? apiError(409, "EVENTS_OFF") : [200, { status: "QUEUED" }],
  );
  t.after(server.close);
  const controller = new AbortController();
  setTimeout(() => controller.abort(new Error("enough")), 100);
  await assert.rejects(
    new Client({ url: server.url }).wait("q", TASK_ID, { timeoutMs: 10_000, signal: controller.signal }),
    /enough/,
  );
});
