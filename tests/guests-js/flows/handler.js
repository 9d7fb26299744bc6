// `flows` (JavaScript): submitting tasks from a handler and waiting for
// children, for the polyglot flow tests; the Rust and Python twins take the
// same payloads and give the same results.
//
// | payload | does | result |
// |---|---|---|
// | `{"fan_out": N, "queue": Q, "task": T}` | with no children yet: submits N children (task T on queue Q, payload `{"n": i}` for i in 0..N) and waits for them | once they are all terminal: `{"sum": Σ n of the children that SUCCEEDED, "children": count, "failed": count not SUCCEEDED}` |
// | `{"submit": {"queue": Q, "task": T, "payload": P, "key": K}}` | submits one task (not a child); `key` is optional | `{"id": <its id>}` |
// | `{"submit_then_fail": {"queue": Q, "task": T}}` | submits one task, then fails with a retryable error: nothing is submitted | none |
// | `{"denied": {"queue": Q, "task": T}}` | tries to submit where the handler is not granted | `{"refused": <the error's message>}` when refused, else `{"refused": null}` |

import { FatalError, HandlerError, RetryableError, task, tasks } from 'dtq';

task('flows', (payload) => {
  if ('fan_out' in payload) {
    const done = tasks.children();
    if (done.length === 0) {
      for (let i = 0; i < payload.fan_out; i++) {
        tasks.submit(payload.queue, payload.task, { n: i }, { child: true });
      }
      throw new tasks.WaitForChildren();
    }
    const succeeded = done.filter((c) => c.status === 'SUCCEEDED');
    return {
      sum: succeeded.reduce((sum, c) => sum + c.result.n, 0),
      children: done.length,
      failed: done.length - succeeded.length,
    };
  }
  if ('submit' in payload) {
    const s = payload.submit;
    const id = tasks.submit(s.queue, s.task, s.payload ?? null, { key: s.key });
    return { id };
  }
  if ('submit_then_fail' in payload) {
    const s = payload.submit_then_fail;
    tasks.submit(s.queue, s.task, {});
    throw new RetryableError('failed after submitting');
  }
  if ('denied' in payload) {
    const s = payload.denied;
    try {
      tasks.submit(s.queue, s.task, {});
    } catch (e) {
      if (!(e instanceof HandlerError) || e.refusal !== 'invalid-argument') throw e;
      return { refused: e.message };
    }
    return { refused: null };
  }
  throw new FatalError(`unknown payload ${JSON.stringify(payload)}`);
});
