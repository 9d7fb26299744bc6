// Leveled log lines, captured into the task's log (capped by the host).
// `console.log` output lands in the same log, without a level or fields.

import { write as witWrite } from 'dtq:handler/log@0.2.0';

/**
 * Write one line at `level` (`"debug"`, `"info"`, `"warn"`, `"error"`) with
 * `fields`, an object of key/value pairs kept beside the message.
 */
export function write(level, message, fields = {}) {
  const pairs = Object.entries(fields).map(([k, v]) => [String(k), String(v)]);
  witWrite(level, String(message), pairs);
}

/** Write a debug line. */
export const debug = (message, fields) => write('debug', message, fields);
/** Write an info line. */
export const info = (message, fields) => write('info', message, fields);
/** Write a warning line. */
export const warn = (message, fields) => write('warn', message, fields);
/** Write an error line. */
export const error = (message, fields) => write('error', message, fields);
