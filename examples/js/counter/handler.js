// `counter`: add to a named counter kept in the handler's Redis namespace.
//
// The JavaScript twin of `examples/counter`: same payloads, same results,
// same keys. Payload → result:
//
//     {"name": "visits", "by": 5}   →   {"name": "visits", "value": 12}
//
// `by` is optional (default 1) and may be negative. The counter lives at the
// kv key `counter:<name>`; the result holds its value after the increment.

import { FatalError, kv, task } from 'dtq';

task('counter', (payload) => {
  const name = payload?.name;
  const by = payload?.by ?? 1;
  if (typeof name !== 'string') {
    throw new FatalError("payload does not match the handler's type: missing field `name`");
  }
  if (!Number.isSafeInteger(by)) {
    throw new FatalError("payload does not match the handler's type: `by` is not an integer");
  }
  const value = kv.incrBy(`counter:${name}`, by);
  return { name, value };
});
