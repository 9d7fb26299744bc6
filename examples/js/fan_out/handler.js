// `fan_out`: square numbers in child tasks, then add the squares up.
//
// Payload → result:
//
//     {"numbers": [1, 2, 3], "queue": "default"}   →   {"sum_of_squares": 14}
//
// The first run submits one `square` task per number, as a child, to
// `queue` (optional, default "default") and waits: the task goes `WAITING`
// without holding a worker slot. Once every child has ended, it runs again,
// finds them in `tasks.children()` and adds up their results. The
// submissions are exactly once: a retry of the first run stages the same
// children. The operator must grant `fan_out` the `square` task on that
// queue (`dtq deploy --submit-to`, or the worker's `--submit-to`).

import { FatalError, task, tasks } from 'dtq';

task('fan_out', (payload) => {
  const numbers = payload?.numbers;
  if (!Array.isArray(numbers)) {
    throw new FatalError("payload does not match the handler's type: missing field `numbers`");
  }
  const done = tasks.children();
  if (done.length === 0 && numbers.length > 0) {
    // First run: one child per number, then wait for them all.
    const queue = payload.queue ?? 'default';
    for (const x of numbers) tasks.submit(queue, 'square', { n: x }, { child: true });
    throw new tasks.WaitForChildren();
  }
  // Run again once the children ended: each holds its status and result.
  const failed = done.filter((c) => c.status !== 'SUCCEEDED');
  if (failed.length > 0) {
    throw new FatalError(
      `${failed.length} of ${done.length} squares did not succeed: ${failed[0].error}`,
    );
  }
  return { sum_of_squares: done.reduce((sum, c) => sum + c.result, 0) };
});
