// A namespaced slice of Redis: every key is a suffix the host stores under
// `dtq:guest:{<namespace>}:<key>`. Refusals throw a `HandlerError`, fatal
// when trying again cannot help (an invalid key, a value too large).

import * as wit from 'dtq:handler/kv@0.2.0';
import { callHost } from './errors.js';

/** The value of `key` (a string), or `null` when it does not exist. */
export function get(key) {
  return callHost('kv get', wit.get, key) ?? null;
}

/** Set `key` to `value`, replacing any value and removing any TTL. */
export function set(key, value) {
  setWith(key, value);
}

/** Set `key` only if it does not exist; whether it was written. */
export function setNx(key, value) {
  return setWith(key, value, { onlyIfAbsent: true });
}

/**
 * Set `key` with options (Redis `NX` and `EX`); `false` when `onlyIfAbsent`
 * was asked and the key existed, `true` when written.
 */
export function setWith(key, value, { onlyIfAbsent = false, expireSeconds } = {}) {
  return callHost('kv set', wit.set, key, String(value), { onlyIfAbsent, expireSeconds });
}

/** Add 1 to the integer at `key` (missing counts as 0); the new value. */
export function incr(key) {
  return incrBy(key, 1);
}

/** Add `delta` to the integer at `key` (missing counts as 0); the new value. */
export function incrBy(key, delta) {
  return Number(callHost('kv incr-by', wit.incrBy, key, BigInt(delta)));
}

/** Delete `key`; whether it existed. */
export function del(key) {
  return callHost('kv del', wit.del, key);
}

/** Expire `key` after `seconds`; whether the key exists. */
export function expire(key, seconds) {
  return callHost('kv expire', wit.expire, key, seconds);
}

/** Whether `key` exists. */
export function exists(key) {
  return callHost('kv exists', wit.exists, key);
}
