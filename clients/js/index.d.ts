// Types of dtq-client (index.js). Hand-written: the package needs no build.

/** Any JSON value: a payload or a result. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** A task's status. */
export type TaskStatus =
  | "QUEUED"
  | "SCHEDULED"
  | "RUNNING"
  | "RETRYING"
  | "SUCCEEDED"
  | "FAILED"
  | "DEAD_LETTERED"
  | "CANCELLED"
  | "EXPIRED"
  | "WAITING";

/** The statuses a task ends in. */
export const TERMINAL_STATUSES: readonly TaskStatus[];

/** A client-side error code: no answer (unreachable, broken, or past the timeout). */
export const CONNECTION_FAILED: "CONNECTION_FAILED";
/** A client-side error code: an answer that is not dtq's. */
export const INVALID_RESPONSE: "INVALID_RESPONSE";
/** A client-side error code: `wait` gave up before the task ended. */
export const WAIT_TIMEOUT: "WAIT_TIMEOUT";
/** This package's version. */
export const version: string;

/**
 * An error answer of the API (`{"error": {"code", "message", "details"}}`),
 * or a request that got no answer (`status` null).
 */
export class DtqError extends Error {
  constructor(
    code: string,
    message: string,
    status?: number | null,
    details?: Record<string, unknown>,
    options?: { cause?: unknown },
  );
  /** The API's error code (`UNKNOWN_TASK`, `QUEUE_FULL`, ...) or the client's own. */
  readonly code: string;
  /** The HTTP status; null when there was no answer. */
  readonly status: number | null;
  /** The error body's details (`task_id` of `IDEMPOTENCY_IN_PROGRESS`, ...). */
  readonly details: Record<string, unknown>;
}

/** `wait` reached its timeout before the task ended. */
export class WaitTimeout extends DtqError {
  constructor(message: string, details: Record<string, unknown>);
  readonly code: "WAIT_TIMEOUT";
  readonly details: { task_id: string; queue: string; status: TaskStatus; task: Task };
}

/** `submit`'s options. */
export interface SubmitOptions {
  /** The idempotency key: the same key and submission give the same task. */
  idempotencyKey?: string;
  /** Attempts before the task is dead-lettered, 1 to 100. */
  maxAttempts?: number;
  /** Run after this many ms (at most 30 days). Not with `runAt`. */
  delayMs?: number;
  /** Run at: ms since the epoch, an RFC 3339 string, or a Date. */
  runAt?: number | string | Date;
  /** Each attempt's time limit, ms. */
  timeoutMs?: number;
  /** Expire if not started within this many ms. */
  expiresInMs?: number;
  /** The task's group, for the queue's `group_concurrency` limit. */
  group?: string;
}

/** An item of `submitBatch`. */
export interface SubmitItem extends SubmitOptions {
  task: string;
  payload?: Json;
}

/** The API's answer to a submission. */
export interface Submitted {
  task_id: string;
  queue: string;
  task: string;
  status: TaskStatus;
  /** True: the key's task had ended, and the answer is its record. */
  duplicate: boolean;
  [field: string]: unknown;
}

/** One attempt of a task. */
export interface Attempt {
  attempt: number;
  outcome: string;
  error: string | null;
  log: string | null;
  started_at: number | null;
  finished_at: number | null;
  duration_ms: number | null;
  digest: string | null;
}

/** A task as `GET /v1/queues/{queue}/tasks/{id}` shows it. */
export interface Task {
  task_id: string;
  queue: string;
  task: string;
  status: TaskStatus;
  attempts: number;
  max_attempts: number;
  timeout_ms: number | null;
  idempotency_key: string | null;
  payload: Json;
  result: Json | null;
  error: string | null;
  log: string | null;
  created_at: number;
  updated_at: number;
  started_at: number | null;
  finished_at: number | null;
  run_at: number | null;
  expires_at: number | null;
  cancel_requested: boolean;
  attempt_history: Attempt[];
  /** The task that submitted it as a child (flows), or null. */
  parent: { queue: string; task_id: string } | null;
  /** The children it submitted (flows), in submission order. */
  children: ChildTask[];
  [field: string]: unknown;
}

/** A child of a task (flows), as it is now. */
export interface ChildTask {
  /** Its id; empty for a child whose submission was refused. */
  task_id: string;
  queue: string;
  task: string;
  /** A task status, `REFUSED` (its submission was refused) or `MISSING` (its record expired). */
  status: TaskStatus | "REFUSED" | "MISSING";
  error: string | null;
}

/** The API's error body. */
export interface ErrorBody {
  error: { code: string; message: string; details: Record<string, unknown> };
}

/** The answer to `submitBatch`: one result per item, in order. */
export interface BatchAnswer {
  results: Array<{ status: number; body: Submitted | ErrorBody }>;
}

/** The answer to `cancel`. */
export interface Cancelled {
  task_id: string;
  queue: string;
  status: "CANCELLED" | "RUNNING";
  cancel_requested?: boolean;
  /** Its children (flows) that had not ended, cancelled with it. */
  cancelled_children: string[];
}

/**
 * An event as `events()` yields it: its data's fields with `event` (its
 * name: the status, or `gap`) and `id` (null for a gap).
 */
export interface DtqEvent {
  event: string;
  id: string | null;
  task_id?: string;
  status?: TaskStatus;
  attempt?: number | null;
  at?: number | null;
  /** A gap's: the id asked to continue after, and the oldest one left. */
  last_event_id?: string;
  oldest_id?: string | null;
  [field: string]: unknown;
}

export interface ClientOptions {
  /** The API's base URL, `http://localhost:8080`. */
  url: string;
  /** The bearer token; none for an open API. */
  token?: string | null;
  /** How long a request may take for its whole answer (default 30000). */
  timeoutMs?: number;
}

export interface WaitOptions {
  /** Give up after this many ms (default 60000). */
  timeoutMs?: number;
  /** The longest pause between two polls, ms (default 1000). */
  pollIntervalMs?: number;
  /** Stop waiting (rejects with its reason). */
  signal?: AbortSignal;
}

export interface EventsOptions {
  /** Continue after this event id. */
  since?: string | null;
  /** Only this task's events. */
  taskId?: string | null;
  /** End the stream. */
  signal?: AbortSignal;
}

/** A queue's events, live; reconnects by itself after the last event read. */
export class EventStream implements AsyncIterableIterator<DtqEvent> {
  private constructor();
  /** The id of the last event read. */
  lastEventId: string | null;
  /** Resolves once the server has taken the stream (where it starts is
   * fixed then); rejects with its refusal (`EVENTS_OFF`, ...). */
  readonly ready: Promise<void>;
  next(): Promise<IteratorResult<DtqEvent, undefined>>;
  return(): Promise<IteratorResult<DtqEvent, undefined>>;
  [Symbol.asyncIterator](): EventStream;
  /** End the stream. */
  close(): void;
}

/** A client of one dtq API. */
export class Client {
  constructor(options: ClientOptions);
  readonly url: string;
  readonly token: string | null;
  readonly timeoutMs: number;
  submit(queue: string, task: string, payload?: Json, options?: SubmitOptions): Promise<Submitted>;
  submitBatch(queue: string, items: Iterable<SubmitItem>): Promise<BatchAnswer>;
  status(queue: string, taskId: string): Promise<Task>;
  cancel(queue: string, taskId: string): Promise<Cancelled>;
  wait(queue: string, taskId: string, options?: WaitOptions): Promise<Task>;
  events(queue: string, options?: EventsOptions): EventStream;
}

/** The body of a submission, by the API's field names. */
export function submission(task: string, payload?: Json, options?: SubmitOptions): Record<string, Json>;
/** `name` as one URL path segment. */
export function segment(name: string): string;
/** The error an answer with HTTP `status` and body `text` stands for. */
export function errorFromAnswer(status: number, text: string): DtqError;
/** When task `taskId` was created (ms since the epoch), from its UUIDv7. */
export function taskCreatedMs(taskId: string): number | null;

/** A Server-Sent Events parser: text in, events out. */
export class SseParser {
  lastEventId: string | null;
  feed(text: string): Array<{ event: string; data: string; id: string | null }>;
}
