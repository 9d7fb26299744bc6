// `square`: square a number; the child task of `fan_out`.
//
// Payload → result:
//
//     {"n": 3}   →   9

import { FatalError, task } from 'dtq';

task('square', (payload) => {
  const n = payload?.n;
  if (typeof n !== 'number') {
    throw new FatalError("payload does not match the handler's type: `n` is not a number");
  }
  return n * n;
});
