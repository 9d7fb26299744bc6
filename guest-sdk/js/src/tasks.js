// Submit tasks from a handler, exactly once, and wait for children.
//
// A submission is staged: nothing reaches a queue while the call runs. It is
// applied when the attempt ends well (the handler returns, or throws
// `WaitForChildren`), or, inside an idempotent operation, with that
// operation's commit. An attempt that fails, traps or is lost submits
// nothing; one that succeeds submits each of its tasks exactly once, however
// many times it ran before: without a `key`, a submission is keyed by the
// running task and its position (among the call's submissions, after those
// of the task's earlier runs), so a retry stages the same tasks.
//
// A handler submits only to the queues and tasks the operator granted it
// (`dtq deploy --submit-to`, or the worker's `--submit-to TASK=QUEUE`); any
// other submission throws a `FatalError` whose `refusal` is
// `"invalid-argument"`. Other refusals map as in `kv`: a payload larger
// than the host allows is fatal, Redis being unavailable retryable.
//
//   task('fan_out', (payload) => {
//     const done = tasks.children();
//     if (done.length === 0) {
//       for (const n of payload.numbers) {
//         tasks.submit('default', 'square', { n }, { child: true });
//       }
//       throw new tasks.WaitForChildren();
//     }
//     return { sum_of_squares: done.reduce((sum, c) => sum + c.result, 0) };
//   });

import * as wit from 'dtq:handler/tasks@0.2.0';
import { FatalError, RetryableError, callHost } from './errors.js';
import { RawJson } from './index.js';

/** The message of the error a handler ends with while it waits for its children. */
export const WAITING = 'waiting for children';

const U32 = 2n ** 32n - 1n;
const U64 = 2n ** 64n - 1n;

/**
 * Throw it from a handler to end the attempt *waiting for its children*
 * instead of failing: the task's staged submissions are applied, it goes
 * `WAITING` (holding no slot), and it runs again, as the same attempt, once
 * all its children are terminal; `children()` then lists them with their
 * results.
 *
 * The handler wrapper tells the host (the WIT `wait-for-children` import)
 * when this escapes the handler, and ends the call with the retryable error
 * "waiting for children"; thrown where it is caught, it does nothing.
 * Submit the children (`{child: true}`) before throwing it.
 */
export class WaitForChildren extends RetryableError {
  constructor(message = WAITING, options = {}) {
    super(message, options);
  }
}

/**
 * Stage the submission of task `task` to `queue` with `payload` (any value
 * `JSON.stringify` takes, or a `RawJson` sent as it is); returns the task's
 * id.
 *
 * Options: `key`, the submission's idempotency key in its queue (default:
 * one derived from the running task and the submission's position);
 * `delayMs`, run the task no earlier than that many milliseconds after the
 * submission is applied (a number or a BigInt); `maxAttempts`, the task's
 * attempts in all (default: its handler's, else the fleet's); `group`, its
 * group, for a queue's group limit; `child: true`, submit it as a child of
 * the running task (`children()`, `WaitForChildren`).
 *
 *   const id = tasks.submit('emails', 'send_receipt', { order_id: 'A-1' }, {
 *     key: 'receipt:A-1',
 *   });
 */
export function submit(queue, task, payload, options = {}) {
  const { key, delayMs, maxAttempts, group, child = false } = options;
  let text;
  if (payload instanceof RawJson) {
    text = payload.text;
  } else {
    try {
      text = JSON.stringify(payload ?? null);
    } catch (e) {
      throw new FatalError(`tasks submit: cannot serialize the payload: ${e.message}`);
    }
    if (text === undefined) throw new FatalError('tasks submit: cannot serialize the payload');
  }
  const submitOptions = {
    key: key == null ? undefined : String(key),
    // A WIT u64 is a BigInt in the bindings.
    delayMs: delayMs == null ? undefined : whole('delayMs', delayMs, U64),
    maxAttempts: maxAttempts == null ? undefined : Number(whole('maxAttempts', maxAttempts, U32)),
    group: group == null ? undefined : String(group),
    child: Boolean(child),
  };
  return callHost('tasks submit', wit.submit, String(queue), String(task), text, submitOptions);
}

/**
 * The running task's children whose submissions were applied, in
 * submission order: `{taskId, queue, task, status, result, error}` each,
 * `result` parsed once the child succeeded and `error` its error once it
 * failed (or its last, while it retries), else `null`. Empty before any. A
 * child that failed is listed with its status and error: the handler
 * decides what that means. Statuses: `QUEUED`, `RUNNING`, `SUCCEEDED`,
 * `FAILED`, `DEAD_LETTERED`, `CANCELLED`, `EXPIRED`, ...
 */
export function children() {
  return callHost('tasks children', wit.children).map((c) => ({
    taskId: c.taskId,
    queue: c.queue,
    task: c.task,
    status: c.status,
    result: c.result == null ? null : parseResult(c),
    error: c.error ?? null,
  }));
}

/** `value` (a number or BigInt) as a BigInt in `0..=most`; else a fatal error. */
function whole(name, value, most) {
  const ok =
    (typeof value === 'bigint' || Number.isSafeInteger(value)) &&
    BigInt(value) >= 0n &&
    BigInt(value) <= most;
  if (!ok) {
    throw new FatalError(
      `tasks submit: invalid argument: ${name} must be a whole number from 0 to ${most}, ` +
        `not ${typeof value === 'bigint' ? `${value}n` : JSON.stringify(value) ?? String(value)}`,
      { refusal: 'invalid-argument' },
    );
  }
  return BigInt(value);
}

function parseResult(c) {
  try {
    return JSON.parse(c.result);
  } catch (e) {
    throw new FatalError(
      `tasks children: result of child ${c.taskId} does not parse: ${e.message}`,
    );
  }
}
