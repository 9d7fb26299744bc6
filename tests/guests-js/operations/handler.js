// `operations` (JavaScript): the `run` and `seed` commands of the Rust test
// guest `tests/guests/operations`, with the same payloads and results, so
// the idempotent-operation tests run in every language.
//
// | payload | does | result |
// |---|---|---|
// | `{"op": "run", "key": K, "incr": [S…], "set": [[S, V]…], "spin_ms": N, "then": T, "external": B, "ttl": N}` | `operation(K)` whose effect increments each `incr` key, sets each `set` pair, spins N ms, then ends as T: `"ok"` (default) or `"fail"` (a retryable error) | `{"outcome": "executed", "value": [n…]}`, `{"outcome": "done", "value": …}`, `{"outcome": "in_progress"}` or `{"outcome": "abandoned"}` |
// | `{"op": "seed", "key": K, "incr": S}` | `idempotentOperation(K)` around kv incr of S | `{"executed": bool}` |
//
// `spin_ms` busy-waits inside guest code, so a test can interrupt a call at
// a known point.

import { FatalError, RetryableError, idempotentOperation, kv, operation, task } from 'dtq';

/** TTL of operations that name none. */
const TTL_SECONDS = 3_600;

function spin(ms) {
  const end = Date.now() + ms;
  while (Date.now() < end);
}

task('operations', async (payload) => {
  switch (payload.op) {
    case 'run': {
      const found = await operation(
        payload.key,
        payload.ttl ?? TTL_SECONDS,
        () => {
          const values = (payload.incr ?? []).map((k) => kv.incr(k));
          for (const [k, v] of payload.set ?? []) kv.set(k, v);
          spin(payload.spin_ms ?? 0);
          if ((payload.then ?? 'ok') === 'fail') throw new RetryableError('the effect failed');
          return values;
        },
        { externalEffects: payload.external ?? false },
      );
      return 'value' in found ? found : { outcome: found.outcome };
    }
    case 'seed': {
      const [executed] = await idempotentOperation(payload.key, TTL_SECONDS, () =>
        kv.incr(payload.incr),
      );
      return { executed };
    }
    default:
      throw new FatalError(`unknown op ${JSON.stringify(payload.op)}`);
  }
});
