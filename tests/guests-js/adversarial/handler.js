// `adversarial` (JavaScript): the subset of the Rust test guest
// `tests/guests/adversarial` that a JavaScript handler can do, with the same
// payloads and results, so the tests run the same limit cases in every
// language.
//
// | payload | does | result |
// |---|---|---|
// | `{"op": "ok"}` | nothing | `{"ok": true}` |
// | `{"op": "fatal", "message": S}` | throws `FatalError(S)` | fatal error `S` |
// | `{"op": "retry", "message": S}` | throws `RetryableError(S)` | retryable error `S` |
// | `{"op": "panic", "message": S}` | throws `Error(S)` | retryable error naming it |
// | `{"op": "loop"}` | spins forever | never returns |
// | `{"op": "sleep", "ms": N}` | spins N ms on the clock | `{"slept_ms": N}` |
// | `{"op": "alloc", "mb": N}` | allocates and touches N MiB | `{"allocated_mb": N}` |
// | `{"op": "static_counter"}` | increments a module-level counter | `{"count": n}` |

import { FatalError, RetryableError, task } from 'dtq';

let count = 0;

task('adversarial', (payload) => {
  switch (payload.op) {
    case 'ok':
      return { ok: true };
    case 'fatal':
      throw new FatalError(payload.message);
    case 'retry':
      throw new RetryableError(payload.message);
    case 'panic':
      throw new Error(payload.message);
    case 'loop': {
      let n = 0;
      for (;;) n++;
    }
    case 'sleep': {
      const end = Date.now() + payload.ms;
      while (Date.now() < end);
      return { slept_ms: payload.ms };
    }
    case 'alloc': {
      // One MiB at a time, each written, as the Rust guest touches its pages.
      const chunks = [];
      for (let i = 0; i < payload.mb; i++) chunks.push(new Uint8Array(1 << 20).fill(1));
      return { allocated_mb: chunks.length };
    }
    case 'static_counter':
      count += 1;
      return { count };
    default:
      throw new FatalError(`unknown op ${JSON.stringify(payload.op)}`);
  }
});
