// A client of dtq's HTTP API: submit tasks, follow them, wait for results.
// No dependency: the global fetch (Node 18 or later, Deno, Bun, browsers).
// The types are in index.d.ts beside this file.

/** The statuses a task ends in. */
export const TERMINAL_STATUSES = Object.freeze([
  "SUCCEEDED",
  "FAILED",
  "DEAD_LETTERED",
  "CANCELLED",
  "EXPIRED",
]);

/** A client-side code: no answer (unreachable, broken, or past the timeout). */
export const CONNECTION_FAILED = "CONNECTION_FAILED";
/** A client-side code: an answer that is not dtq's (not JSON, no error body). */
export const INVALID_RESPONSE = "INVALID_RESPONSE";
/** A client-side code: `wait` gave up before the task ended. */
export const WAIT_TIMEOUT = "WAIT_TIMEOUT";

/**
 * How far before a task's creation `wait` starts reading its events (ms):
 * the task id's time is the API's clock, the events' ids Redis's.
 */
const EVENTS_CLOCK_SLACK_MS = 2_000;
/** How long an event stream may stay silent before it is opened again
 * (ms): the server sends a comment every 15 s. */
const STREAM_IDLE_MS = 45_000;
/** The longest pause between two reconnections of an event stream (ms). */
const MAX_RECONNECT_PAUSE_MS = 5_000;
/** The longest line an event stream may send, characters. */
const MAX_LINE_CHARS = 1 << 20;

const VERSION = "0.1.0";

/**
 * An error answer of the API, or a request that got no answer: `code` is
 * the API's error code or one of the client's own (`CONNECTION_FAILED`,
 * `INVALID_RESPONSE`, `WAIT_TIMEOUT`), `status` the HTTP status (null
 * without an answer), `details` the error body's details, and `message`
 * the API's message.
 */
export class DtqError extends Error {
  constructor(code, message, status = null, details = {}, options = undefined) {
    super(message, options);
    this.name = "DtqError";
    this.code = code;
    this.status = status;
    this.details = details ?? {};
  }
}

/** `wait` reached its timeout: code `WAIT_TIMEOUT`, `details` the task's
 * `task_id`, `queue`, last `status` and last record (`task`). */
export class WaitTimeout extends DtqError {
  constructor(message, details) {
    super(WAIT_TIMEOUT, message, null, details);
    this.name = "WaitTimeout";
  }
}

/** `name` as one URL path segment, every reserved character escaped. */
export function segment(name) {
  return encodeURIComponent(String(name));
}

/** The error an answer with HTTP `status` and body `text` stands for. */
export function errorFromAnswer(status, text) {
  let parsed = null;
  try {
    parsed = JSON.parse(text);
  } catch {
    // Not JSON: something between the client and dtq answered.
  }
  const error = parsed && typeof parsed === "object" ? parsed.error : null;
  if (error && typeof error === "object" && typeof error.code === "string") {
    const details = error.details && typeof error.details === "object" ? error.details : {};
    return new DtqError(error.code, String(error.message || error.code), status, details);
  }
  const head = String(text ?? "").slice(0, 200).trim();
  return new DtqError(
    INVALID_RESPONSE,
    `HTTP ${status} without an error body${head ? `: ${head}` : ""}`,
    status,
    {},
  );
}

/** When task `taskId` was created (ms since the epoch), read from its
 * UUIDv7 (a partitioned queue's ids carry `.<partition>` after it); null
 * for an id that is not one. */
export function taskCreatedMs(taskId) {
  const head = String(taskId).split(".", 1)[0].replaceAll("-", "");
  if (!/^[0-9a-fA-F]{32}$/.test(head) || head[12] !== "7") return null;
  return parseInt(head.slice(0, 12), 16);
}

/** `runAt` as the API takes it: ms since the epoch or an RFC 3339 string. */
function runAtValue(runAt) {
  if (runAt instanceof Date) {
    const ms = runAt.getTime();
    if (Number.isNaN(ms)) throw new TypeError("runAt: an invalid Date");
    return ms;
  }
  return runAt;
}

const FIELDS = {
  idempotencyKey: "idempotency_key",
  maxAttempts: "max_attempts",
  delayMs: "delay_ms",
  runAt: "run_at",
  timeoutMs: "timeout_ms",
  expiresInMs: "expires_in_ms",
  group: "group",
};

/**
 * The body of a submission (an item of a batch): `task`, `payload` and the
 * options given, by the API's field names. Options are taken in camelCase
 * (`idempotencyKey`, `maxAttempts`, `delayMs`, `runAt`, `timeoutMs`,
 * `expiresInMs`, `group`); any other field goes as it is.
 */
export function submission(task, payload, options = {}) {
  const body = { task, payload: payload === undefined ? null : payload };
  for (const [name, value] of Object.entries(options ?? {})) {
    if (value === undefined || value === null) continue;
    const field = FIELDS[name] ?? name;
    body[field] = field === "run_at" ? runAtValue(value) : value;
  }
  return body;
}

/** Whether `value` can go in a header as it is: visible ASCII. */
function headerSafe(value) {
  return /^[\x21-\x7e]+$/.test(value);
}

/** A signal aborted after `ms`, or with `parent`; `done()` releases its
 * timer. */
function timed(ms, parent) {
  const controller = new AbortController();
  const timer = setTimeout(
    () => controller.abort(new DtqError(CONNECTION_FAILED, `no answer within ${ms} ms`)),
    Math.max(ms, 1),
  );
  const onAbort = () => controller.abort(parent.reason);
  if (parent) {
    if (parent.aborted) controller.abort(parent.reason);
    else parent.addEventListener("abort", onAbort, { once: true });
  }
  return {
    signal: controller.signal,
    controller,
    done() {
      clearTimeout(timer);
      parent?.removeEventListener("abort", onAbort);
    },
  };
}

/** Resolve after `ms`, or reject with `signal`'s reason when it aborts. */
function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/**
 * A Server-Sent Events parser: text in, events (`{event, data, id}`) out,
 * as the HTML standard's "event stream interpretation" says. `retry:` is
 * ignored: reconnecting is the caller's.
 */
export class SseParser {
  #buf = "";
  #afterCr = false;
  #event = null;
  #data = [];
  #hasData = false;
  #id = null;
  /** The id of the last event that carried one. */
  lastEventId = null;

  /** Read `text` (decoded with a streaming TextDecoder, which drops the
   * byte-order mark); the events it completes. */
  feed(text) {
    if (this.#afterCr) {
      this.#afterCr = false;
      if (text.startsWith("\n")) text = text.slice(1);
    }
    this.#buf += text;
    const events = [];
    const eol = /\r\n|\r|\n/g;
    let pos = 0;
    let m;
    while ((m = eol.exec(this.#buf)) !== null) {
      const line = this.#buf.slice(pos, m.index);
      pos = m.index + m[0].length;
      if (m[0] === "\r" && pos === this.#buf.length) this.#afterCr = true;
      this.#line(line, events);
    }
    this.#buf = this.#buf.slice(pos);
    if (this.#buf.length > MAX_LINE_CHARS) {
      throw new DtqError(INVALID_RESPONSE, `the event stream has a line longer than ${MAX_LINE_CHARS} characters`);
    }
    return events;
  }

  #line(line, events) {
    if (line === "") return this.#dispatch(events);
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.#event = value;
    else if (field === "data") {
      this.#data.push(value);
      this.#hasData = true;
    } else if (field === "id" && !value.includes("\0")) this.#id = value;
  }

  #dispatch(events) {
    const event = this.#event;
    const id = this.#id;
    this.#event = null;
    this.#id = null;
    if (id !== null) this.lastEventId = id;
    if (!this.#hasData) return;
    this.#hasData = false;
    const data = this.#data.join("\n");
    this.#data = [];
    events.push({ event: event || "message", data, id });
  }
}

/** An event as `events()` yields it: its data's fields (`task_id`,
 * `status`, `attempt`, `at`; a gap's `last_event_id`, `oldest_id`) with
 * `event` (its name) and `id` (null for a gap). */
function eventObject(raw) {
  let data;
  try {
    data = JSON.parse(raw.data);
  } catch {
    data = raw.data;
  }
  const fields = data && typeof data === "object" && !Array.isArray(data) ? { ...data } : { data };
  fields.event = raw.event;
  fields.id = raw.id;
  return fields;
}

/** One open event stream: its body's reader and its parser. */
class Connection {
  constructor(response, controller, unlink) {
    this.reader = response.body.getReader();
    this.controller = controller;
    this.unlink = unlink;
    this.decoder = new TextDecoder();
    this.parser = new SseParser();
  }

  /** The events of the next chunk; null at the end of the stream. Rejects
   * when the connection breaks or is aborted. */
  async read() {
    const { value, done } = await this.reader.read();
    if (done) return null;
    return this.parser.feed(this.decoder.decode(value, { stream: true }));
  }

  close() {
    this.unlink();
    this.controller.abort();
    this.reader.cancel().catch(() => {});
  }
}

/**
 * A client of one dtq API. `url` is the API's base URL
 * (`http://localhost:8080`; a path after the host is kept), `token` the
 * bearer token (none for an open API), `timeoutMs` how long a request may
 * take for its whole answer.
 */
export class Client {
  constructor({ url, token = null, timeoutMs = 30_000 } = {}) {
    const parsed = new URL(url);
    if (parsed.protocol !== "http:" && parsed.protocol !== "https:") {
      throw new TypeError(`${url} is not an http:// or https:// URL`);
    }
    this.url = String(url).replace(/\/+$/, "");
    this.token = token;
    this.timeoutMs = timeoutMs;
  }

  #headers(extra) {
    const headers = { Accept: "application/json", ...extra };
    if (this.token != null) headers.Authorization = `Bearer ${this.token}`;
    return headers;
  }

  /** Send a request; its response (headers read), or the DtqError of no
   * answer. The caller reads the body under the same `signal`. */
  async #send(method, path, body, headers, signal) {
    const url = this.url + path;
    const init = { method, headers: this.#headers(headers), signal };
    if (body !== undefined) {
      init.body = JSON.stringify(body);
      init.headers["Content-Type"] = "application/json";
    }
    try {
      return await fetch(url, init);
    } catch (e) {
      throw this.#unreachable(method, path, e, signal);
    }
  }

  #unreachable(method, path, e, signal) {
    // The caller's own abort is the caller's, not the connection's.
    if (signal?.aborted && !(signal.reason instanceof DtqError)) return signal.reason;
    const cause = signal?.aborted ? signal.reason : e;
    const reason = cause?.cause?.message || cause?.message || String(cause);
    const url = this.url + path;
    return new DtqError(CONNECTION_FAILED, `${method} ${url}: ${reason}`, null, { url, reason }, { cause });
  }

  /** A request whose answer is JSON: the parsed answer, or the DtqError it
   * stands for. */
  async #request(method, path, body = undefined, headers = {}) {
    const clock = timed(this.timeoutMs);
    let response;
    let text;
    try {
      response = await this.#send(method, path, body, headers, clock.signal);
      try {
        text = await response.text();
      } catch (e) {
        throw this.#unreachable(method, path, e, clock.signal);
      }
    } finally {
      clock.done();
    }
    if (!response.ok) throw errorFromAnswer(response.status, text);
    try {
      return JSON.parse(text);
    } catch {
      throw new DtqError(
        INVALID_RESPONSE,
        `${method} ${this.url + path}: HTTP ${response.status}, and the answer is not JSON`,
        response.status,
        {},
      );
    }
  }

  /** Open an event stream on `path`; its connection, aborted with
   * `signal` (or by its own `close()`). Rejects with the DtqError of a
   * refusal, or of no answer within the client's timeout. */
  async _openEvents(path, lastEventId, signal) {
    const controller = new AbortController();
    const onAbort = () => controller.abort(signal.reason);
    if (signal?.aborted) controller.abort(signal.reason);
    else signal?.addEventListener("abort", onAbort, { once: true });
    const unlink = () => signal?.removeEventListener("abort", onAbort);
    const timer = setTimeout(
      () => controller.abort(new DtqError(CONNECTION_FAILED, `no answer within ${this.timeoutMs} ms`)),
      this.timeoutMs,
    );
    const headers = { Accept: "text/event-stream" };
    if (lastEventId != null) headers["Last-Event-ID"] = lastEventId;
    let response;
    try {
      response = await this.#send("GET", path, undefined, headers, controller.signal);
    } catch (e) {
      unlink();
      throw e;
    } finally {
      clearTimeout(timer);
    }
    if (response.status !== 200) {
      const text = await response.text().catch(() => "");
      unlink();
      throw errorFromAnswer(response.status, text);
    }
    // The body is read under the same signal: closing the connection, or
    // the caller's signal, aborts it.
    return new Connection(response, controller, unlink);
  }

  /**
   * Submit `task` with `payload` (any JSON value) to `queue`. Options:
   * `idempotencyKey`, `maxAttempts`, `delayMs`, `runAt` (ms since the
   * epoch, an RFC 3339 string or a Date), `timeoutMs`, `expiresInMs`.
   * Resolves to the API's answer: `task_id`, `queue`, `task`, `status`,
   * `duplicate` (true: the key's task had ended, and this is its record).
   */
  async submit(queue, task, payload, options = {}) {
    const { idempotencyKey, ...rest } = options ?? {};
    const body = submission(task, payload, rest);
    const headers = {};
    if (idempotencyKey != null) {
      // The header, as the API documents it; a key a header cannot carry
      // (not visible ASCII) goes in the body's field instead.
      if (headerSafe(idempotencyKey)) headers["Idempotency-Key"] = idempotencyKey;
      else body.idempotency_key = idempotencyKey;
    }
    return this.#request("POST", `/v1/queues/${segment(queue)}/tasks`, body, headers);
  }

  /**
   * Submit 1 to 1000 tasks to `queue` in one request. Each item is
   * `{task, payload, ...options}` with `submit`'s options (the API's
   * snake_case names work too). Resolves to the API's answer, `{results:
   * [{status, body}, ...]}`, one per item in order: check each `status`
   * (202 new, 200 a replay, else `body` is an error body).
   */
  async submitBatch(queue, items) {
    const tasks = Array.from(items, ({ task, payload, ...options }) => submission(task, payload, options));
    return this.#request("POST", `/v1/queues/${segment(queue)}/tasks/batch`, { tasks });
  }

  /** Task `taskId` of `queue` as the API shows it. Rejects with
   * `TASK_NOT_FOUND`. */
  async status(queue, taskId) {
    return this.#request("GET", `/v1/queues/${segment(queue)}/tasks/${segment(taskId)}`);
  }

  /** Cancel task `taskId`: `status` `CANCELLED`, or `RUNNING` with
   * `cancel_requested` when its worker was asked to interrupt it. Rejects
   * with `TASK_TERMINAL` when it had already ended. */
  async cancel(queue, taskId) {
    return this.#request("POST", `/v1/queues/${segment(queue)}/tasks/${segment(taskId)}/cancel`);
  }

  /**
   * Follow `queue`'s lifecycle events, live: an async iterator of event
   * objects that does not end by itself (see `EventStream`). It connects
   * at once; without `since` it holds the events that happen once the
   * server has taken it (`await stream.ready`), with an event id it
   * continues after that event. `taskId` keeps one task's events;
   * `signal` ends it.
   */
  events(queue, { since = null, taskId = null, signal = undefined } = {}) {
    let path = `/v1/queues/${segment(queue)}/events`;
    if (taskId != null) path += `?${new URLSearchParams({ task_id: taskId })}`;
    return new EventStream(this, path, since, signal);
  }

  /**
   * Wait until task `taskId` has ended; its record, whichever status it
   * ended in. Follows the task's live events; when they are off
   * (`EVENTS_OFF`) or the stream breaks, polls the record, every
   * `pollIntervalMs` at most. Rejects with `WaitTimeout` naming the task
   * when it has not ended after `timeoutMs`, and with `signal`'s reason
   * when it aborts.
   */
  async wait(queue, taskId, { timeoutMs = 60_000, pollIntervalMs = 1_000, signal = undefined } = {}) {
    const deadline = performance.now() + timeoutMs;
    let task = await this.#follow(queue, taskId, deadline, signal);
    // The record decides; after the events, or when they could not be
    // followed, polling.
    let pause = Math.min(50, pollIntervalMs);
    for (;;) {
      if (signal?.aborted) throw signal.reason;
      task ??= await this.status(queue, taskId);
      if (TERMINAL_STATUSES.includes(task.status)) return task;
      const left = deadline - performance.now();
      if (left <= 0) {
        throw new WaitTimeout(
          `task ${taskId} of queue ${queue} is still ${task.status} after ${timeoutMs} ms`,
          { task_id: taskId, queue, status: task.status, task },
        );
      }
      await sleep(Math.min(pause, left), signal);
      pause = Math.min(pause * 2, pollIntervalMs);
      task = null;
    }
  }

  /**
   * Follow task `taskId`'s events until one of a final status or
   * `deadline`; the task's record if it had ended before the stream
   * opened, else null. Returns early, saying nothing, whenever the events
   * cannot be followed: the caller polls the record then, which decides.
   *
   * The subscription starts a little before the task was created (its
   * UUIDv7 holds the time), so events already written are read too; once
   * it is in place the record is read once, for a task that ended before
   * anything the stream still holds.
   */
  async #follow(queue, taskId, deadline, signal) {
    const created = taskCreatedMs(taskId);
    const since = created === null ? null : `${Math.max(created - EVENTS_CLOCK_SLACK_MS, 0)}-0`;
    const path = `/v1/queues/${segment(queue)}/events?${new URLSearchParams({ task_id: taskId })}`;
    const left = deadline - performance.now();
    if (left <= 0) return null;
    const clock = timed(left, signal);
    let connection = null;
    try {
      connection = await this._openEvents(path, since, clock.signal);
      const task = await this.status(queue, taskId);
      if (TERMINAL_STATUSES.includes(task.status)) return task;
      for (;;) {
        const events = await connection.read();
        if (events === null) return null;
        // A gap (the stream was trimmed past `since`) loses only events
        // older than the record read above.
        if (events.some((e) => TERMINAL_STATUSES.includes(e.event))) return null;
      }
    } catch (e) {
      // The caller's abort is the caller's; anything else (EVENTS_OFF, the
      // deadline, a broken stream) leaves it to the polling.
      if (signal?.aborted) throw signal.reason;
      return null;
    } finally {
      clock.done();
      connection?.close();
    }
  }
}

/**
 * A queue's events, live: `for await (const event of stream)`. A stream
 * that ends or breaks is opened again after the last event yielded
 * (`Last-Event-ID`), with a pause that grows to 5 s, so nothing is lost or
 * repeated; so is one silent for 45 s (the server sends a comment every
 * 15 s). The first connection's failure rejects the first `next()`
 * (`EVENTS_OFF` when the server runs with `--events none`); later ones are
 * waited out, but for answers no retry can change (401, 403, 400, 409).
 * `close()`, leaving the loop, or the `signal` ends it; `lastEventId` is
 * where it stands.
 */
export class EventStream {
  #client;
  #path;
  #stop = new AbortController();
  #connection = null;
  #opening;
  #pending = [];
  #connected = false;
  #failures = 0;

  constructor(client, path, since, signal) {
    this.#client = client;
    this.#path = path;
    /** The id of the last event read: resume from it with `since`. */
    this.lastEventId = since ?? null;
    if (signal) {
      if (signal.aborted) this.close();
      else signal.addEventListener("abort", () => this.close(), { once: true });
    }
    // Connect now, so that the events from this call on are held; the
    // first next() takes the outcome.
    this.#opening = this.#client._openEvents(this.#path, this.lastEventId, this.#stop.signal);
    /** Resolves once the server has taken the stream (where it starts is
     * fixed then), rejects with its refusal; the first next() waits for
     * it too. */
    this.ready = this.#opening.then(() => undefined);
    this.ready.catch(() => {});
  }

  [Symbol.asyncIterator]() {
    return this;
  }

  /** End the stream. */
  close() {
    this.#stop.abort();
    this.#connection?.close();
    this.#connection = null;
  }

  async return() {
    this.close();
    return { done: true, value: undefined };
  }

  async next() {
    for (;;) {
      if (this.#stop.signal.aborted) return { done: true, value: undefined };
      if (this.#pending.length > 0) return { done: false, value: this.#pending.shift() };
      if (this.#connection === null && !(await this.#connect())) continue;
      let events;
      const idle = setTimeout(() => this.#connection?.close(), STREAM_IDLE_MS);
      try {
        events = await this.#connection.read();
      } catch {
        events = null;
      } finally {
        clearTimeout(idle);
      }
      if (events === null) {
        this.#connection?.close();
        this.#connection = null;
        await this.#pause();
        continue;
      }
      for (const raw of events) {
        this.#failures = 0;
        if (raw.id !== null) this.lastEventId = raw.id;
        this.#pending.push(eventObject(raw));
      }
    }
  }

  /** Open the stream (the first time, take the opening begun in the
   * constructor); false, after a pause, when it could not be. */
  async #connect() {
    const opening =
      this.#opening ?? this.#client._openEvents(this.#path, this.lastEventId, this.#stop.signal);
    this.#opening = null;
    try {
      this.#connection = await opening;
    } catch (e) {
      if (this.#stop.signal.aborted) return false;
      const final = e instanceof DtqError && e.status !== null && e.status < 500 && e.status !== 429;
      if (!this.#connected || final || !(e instanceof DtqError)) {
        this.close();
        throw e;
      }
      await this.#pause();
      return false;
    }
    if (this.#stop.signal.aborted) {
      this.#connection.close();
      this.#connection = null;
      return false;
    }
    this.#connected = true;
    return true;
  }

  async #pause() {
    this.#failures += 1;
    const ms = Math.min(100 * 2 ** Math.min(this.#failures, 6), MAX_RECONNECT_PAUSE_MS);
    await sleep(ms, this.#stop.signal).catch(() => {});
  }
}

export { VERSION as version };
