// Run a side effect once per key, across retries, redeliveries and crashes.
//
// `idempotentOperation` has the seed contract's shape, `[executed, result]`;
// `operation` is the richer form: `{outcome: "executed" | "done" |
// "in_progress" | "abandoned", value}`. The guarantees are the host's and
// the same as the Rust SDK's: the effect's kv writes are staged and applied
// with the claim's "done" mark in one atomic step (exactly once within the
// TTL); an effect declared with `externalEffects` (an HTTP call) happens at
// most once. If the effect throws, none of its kv writes apply and the
// claim is released for a retry. While another live attempt runs it,
// `idempotentOperation` throws a `RetryableError`: a handler never reports
// success for an effect that has not happened yet.

import * as wit from 'dtq:handler/idempotency@0.2.0';
import { FatalError, RetryableError, callHost } from './errors.js';
import * as log from './log.js';

/**
 * Run `fn` (sync or async) once per `key` within `ttlSeconds`:
 * `[true, result]` to the call that runs it, `[false, null]` to every later
 * call. Throws a `RetryableError` while another live attempt runs it.
 */
export async function idempotentOperation(key, ttlSeconds, fn) {
  const found = await beginAndRun(key, ttlSeconds, false, fn);
  switch (found.outcome) {
    case 'executed':
      return [true, found.value];
    case 'in_progress':
      throw new RetryableError(
        `idempotent operation ${JSON.stringify(key)} is in progress in another attempt`,
      );
    default:
      return [false, null];
  }
}

/**
 * Run `fn` once per `key`, and say what happened: `{outcome: "executed",
 * value}`, `{outcome: "done", value}` (the stored result, parsed, or
 * `null`), `{outcome: "in_progress"}` or `{outcome: "abandoned"}`.
 */
export async function operation(key, ttlSeconds, fn, { externalEffects = false } = {}) {
  const found = await beginAndRun(key, ttlSeconds, externalEffects, fn);
  if (found.outcome === 'done') {
    return { outcome: 'done', value: found.value == null ? null : parseStored(key, found.value) };
  }
  return found;
}

/** The parsed result stored by the operation that ran `key`, or `null`. */
export function storedResult(key) {
  const text = callHost('idempotency get-result', wit.getResult, key);
  return text == null ? null : parseStored(key, text);
}

async function beginAndRun(key, ttlSeconds, externalEffects, fn) {
  const state = callHost('idempotency begin', wit.begin, key, { ttlSeconds, externalEffects });
  switch (state.tag) {
    case 'run':
      if (state.val) {
        log.info('idempotent operation taken over from an attempt that died', { key });
      }
      return { outcome: 'executed', value: await runClaimed(key, fn) };
    case 'done':
      return { outcome: 'done', value: state.val ?? null };
    case 'in-progress':
      return { outcome: 'in_progress' };
    default:
      return { outcome: 'abandoned' };
  }
}

/** Run the effect of a claim this call holds, then commit or abort it. */
async function runClaimed(key, fn) {
  let value;
  try {
    value = await fn();
  } catch (err) {
    // The staged writes are dropped either way; a claim left behind (the
    // abort not answered) is taken over by the next attempt.
    try {
      callHost('idempotency abort', wit.abort, key);
    } catch (abort) {
      log.warn('the claim was not released; the next attempt takes it over', {
        key,
        reason: abort.message,
      });
    }
    throw err;
  }
  const text = JSON.stringify(value ?? null);
  // Refused or lost, nothing applied; unknown, the next attempt finds the
  // commit applied or takes the claim over.
  callHost('idempotency commit', wit.commit, key, text);
  return value ?? null;
}

function parseStored(key, text) {
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new FatalError(`stored result of ${JSON.stringify(key)} does not parse: ${e.message}`);
  }
}
