// Write dtq task handlers in JavaScript: one function from a JSON payload
// to a JSON result, built into a WebAssembly component with componentize-js.
//
//   import { task, idempotentOperation, kv } from 'dtq';
//
//   task('counter', (payload, ctx) => {
//     const value = kv.incrBy(`counter:${payload.name}`, payload.by ?? 1);
//     return { name: payload.name, value };
//   });
//
// `node guest-sdk/js/build.mjs DIR` (or `scripts/build-js-handler DIR`)
// turns the directory's handler.js into `<task>.wasm`. How a call ends
// decides what the host does with the task: a return → SUCCEEDED; a
// `RetryableError`, any other exception, or a trap → retried until the
// attempts run out, then dead-lettered; a `FatalError` → FAILED at once; a
// `tasks.WaitForChildren` → WAITING for the task's children, then run again
// as the same attempt.

import { FatalError, HandlerError, RetryableError } from './errors.js';
import * as http from './http.js';
import * as kv from './kv.js';
import * as log from './log.js';
import * as tasks from './tasks.js';
import { waitForChildren } from 'dtq:handler/tasks@0.2.0';

export { FatalError, HandlerError, RetryableError, http, kv, log, tasks };
export { idempotentOperation, operation, storedResult } from './idempotency.js';
export { progress } from './progress.js';

/** A namespace: 1 to 64 ASCII letters, digits, `-`, `_` or `.`, as the host accepts. */
export const NAMESPACE = /^[A-Za-z0-9_.-]{1,64}$/;

/** JSON text taken or returned as it is, without parsing or serializing. */
export class RawJson {
  constructor(text) {
    this.text = String(text);
  }
  toString() {
    return this.text;
  }
}

let registered = null;

/**
 * Make `fn(payload, ctx)` (sync or async) this component's handler for
 * task `name` (the build writes `<name>.wasm`). `options.namespace` asks
 * for the handler's kv keys and claims to live in that namespace; the build
 * embeds it, and the host loads the component only where the operator
 * granted it. Name and namespace must be string literals, which the build
 * reads from the source. `options.raw` passes the payload as `RawJson`.
 */
export function task(name, optionsOrFn, maybeFn) {
  const [options, fn] =
    typeof optionsOrFn === 'function' ? [{}, optionsOrFn] : [optionsOrFn ?? {}, maybeFn];
  if (typeof name !== 'string' || !name) throw new Error('task() needs the task name');
  if (options.namespace != null && !NAMESPACE.test(options.namespace)) {
    throw new Error("a dtq namespace may hold only 1 to 64 ASCII letters, digits, '-', '_' and '.'");
  }
  if (registered) throw new Error('one component has one handler: task() is called twice');
  registered = { fn, raw: Boolean(options.raw) };
  return fn;
}

/** The context of a call, as the host describes it. */
function context(ctx) {
  return {
    taskId: ctx.taskId,
    queue: ctx.queue,
    taskName: ctx.taskName,
    attempt: ctx.attempt,
    maxAttempts: ctx.maxAttempts,
    idempotencyKey: ctx.idempotencyKey ?? null,
    deadlineMs: Number(ctx.deadlineMs),
    get isLastAttempt() {
      return this.attempt >= this.maxAttempts;
    },
  };
}

async function call(ctx, payload) {
  if (!registered) throw new FatalError('the component has no handler: register one with task()');
  let arg;
  if (registered.raw) {
    arg = new RawJson(payload);
  } else {
    try {
      arg = JSON.parse(payload);
    } catch (e) {
      throw new FatalError(`payload does not match the handler's type: ${e.message}`);
    }
  }
  const result = await registered.fn(arg, context(ctx));
  if (result instanceof RawJson) return result.text;
  const text = JSON.stringify(result ?? null);
  if (text === undefined) throw new FatalError("cannot serialize the handler's result");
  return text;
}

/** The WIT error a thrown value becomes: its own property `payload`. */
function handlerError(err) {
  const fatal = err instanceof HandlerError && err.isFatal;
  let message;
  if (err instanceof HandlerError) {
    message = err.message;
  } else {
    message = `${err?.name ?? 'Error'}: ${err?.message ?? String(err)}`;
    console.error(err?.stack ?? String(err));
  }
  const thrown = new Error(message);
  Object.defineProperty(thrown, 'payload', {
    value: { tag: fatal ? 'fatal' : 'retryable', val: message },
    enumerable: false,
  });
  return thrown;
}

/** The component's export: what the build's entry module re-exports. */
export async function handle(ctx, payload) {
  try {
    return await call(ctx, payload);
  } catch (err) {
    // Asked here, not where it is thrown: only an error that ends the call waits.
    if (err instanceof tasks.WaitForChildren) waitForChildren();
    throw handlerError(err);
  }
}
