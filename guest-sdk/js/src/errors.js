// The errors a handler throws, and how they map onto the WIT `handler-error`.
//
// A `RetryableError` makes the host retry the task with backoff until its
// attempts run out (then it is dead-lettered); a `FatalError` fails the task
// at once. Any other exception that escapes a handler counts as retryable,
// like `?` on any error in the Rust SDK.

/** Why a handler call failed, and whether the host should try again. */
export class HandlerError extends Error {
  /**
   * @param {string} message what the host records for the task
   * @param {{refusal?: string}} [options] the host refusal behind it, if any
   */
  constructor(message, options = {}) {
    super(String(message));
    this.name = new.target.name;
    /** The WIT `host-error` case behind this error (`"invalid-key"`, …), if any. */
    this.refusal = options.refusal ?? null;
  }

  /** Whether the host fails the task without retrying it. */
  get isFatal() {
    return false;
  }
}

/** A transient failure: the host retries the task with backoff. */
export class RetryableError extends HandlerError {}

/** A permanent failure: the host marks the task FAILED without retrying. */
export class FatalError extends HandlerError {
  get isFatal() {
    return true;
  }
}

// The kind and message of each host refusal, as the Rust SDK words them: a
// request that can never succeed is fatal, the rest retryable.
const HOST_ERRORS = {
  'invalid-key': [FatalError, (op, v) => `${op}: invalid key: ${v}`],
  'value-too-large': [FatalError, (op, v) => `${op}: ${v} bytes is larger than the host allows`],
  'wrong-type': [RetryableError, (op, v) => `${op}: value has the wrong type: ${v}`],
  unavailable: [RetryableError, (op, v) => `${op}: storage unavailable: ${v}`],
  'invalid-argument': [FatalError, (op, v) => `${op}: invalid argument: ${v}`],
  'outcome-unknown': [
    RetryableError,
    (op, v) => `${op}: outcome unknown, the write may or may not have applied: ${v}`,
  ],
  'claim-lost': [RetryableError, (op, v) => `${op}: claim lost: ${v}`],
  'quota-exceeded': [RetryableError, (op, v) => `${op}: namespace quota exceeded: ${v}`],
};

/** The `HandlerError` for `err`, a WIT `host-error` of import `op`. */
export function fromHost(op, err) {
  const [Kind, text] = HOST_ERRORS[err.tag] ?? [RetryableError, (o, v) => `${o}: ${v}`];
  return new Kind(text(op, err.val), { refusal: err.tag });
}

/** Call host import `fn`; its WIT error becomes a `HandlerError`. */
export function callHost(op, fn, ...args) {
  try {
    return fn(...args);
  } catch (e) {
    if (e && typeof e === 'object' && 'payload' in e && e.payload?.tag) {
      throw fromHost(op, e.payload);
    }
    throw e;
  }
}
