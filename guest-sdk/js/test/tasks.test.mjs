// Unit tests of `tasks` and the handler wrapper's part of
// `tasks.WaitForChildren`, against stand-ins for the host imports (host/),
// in an ordinary Node.js:
//
//   node --test guest-sdk/js/test/*.test.mjs   (or `npm test` in guest-sdk/js)

import assert from 'node:assert/strict';
import { register } from 'node:module';
import { beforeEach, describe, it } from 'node:test';

register('./hooks.mjs', import.meta.url);
const { host } = await import('dtq:handler/tasks@0.2.0');
const { FatalError, HandlerError, RawJson, RetryableError, handle, task, tasks } = await import(
  '../src/index.js'
);

const ctx = {
  taskId: 't-1',
  queue: 'q',
  taskName: 'parent',
  attempt: 1,
  maxAttempts: 3,
  idempotencyKey: undefined,
  deadlineMs: 30000n,
};

// One component has one handler: the tests swap what it runs.
let body = () => null;
task('parent', (payload) => body(payload));

async function run(fn) {
  body = fn;
  try {
    return { ok: await handle(ctx, '{}') };
  } catch (e) {
    return { err: e.payload };
  }
}

beforeEach(() => host.reset());

describe('submit', () => {
  it('serializes the payload as results are, and returns the id', () => {
    assert.equal(tasks.submit('emails', 'send', { to: 'é', n: [1, 2] }), 'id-1');
    const [s] = host.submitted;
    assert.deepEqual([s.queue, s.task, s.payload], ['emails', 'send', '{"to":"é","n":[1,2]}']);
    assert.deepEqual(s.options, {
      key: undefined,
      delayMs: undefined,
      maxAttempts: undefined,
      group: undefined,
      child: false,
    });
  });

  it('passes the options, delayMs as a BigInt (a WIT u64)', () => {
    tasks.submit('q', 't', undefined, {
      key: 'k',
      delayMs: 1500,
      maxAttempts: 5,
      group: 'g',
      child: true,
    });
    const [s] = host.submitted;
    assert.equal(s.payload, 'null');
    assert.deepEqual(s.options, {
      key: 'k',
      delayMs: 1500n,
      maxAttempts: 5,
      group: 'g',
      child: true,
    });
    tasks.submit('q', 't', {}, { delayMs: 2n ** 64n - 1n, key: null });
    assert.deepEqual(host.submitted[1].options.delayMs, 2n ** 64n - 1n);
    assert.equal(host.submitted[1].options.key, undefined);
  });

  it('sends RawJson as it is', () => {
    tasks.submit('q', 't', new RawJson('{ "a" : 1 }'));
    assert.equal(host.submitted[0].payload, '{ "a" : 1 }');
  });

  it('refuses a payload that does not serialize', () => {
    assert.throws(() => tasks.submit('q', 't', { n: 1n }), FatalError);
    assert.throws(() => tasks.submit('q', 't', () => 1), FatalError);
    assert.equal(host.submitted.length, 0);
  });

  it('refuses numbers out of range before the host', () => {
    for (const options of [
      { delayMs: -1 },
      { delayMs: 1.5 },
      { delayMs: 2n ** 64n },
      { delayMs: '10' },
      { maxAttempts: 2 ** 32 },
      { maxAttempts: -1 },
    ]) {
      assert.throws(
        () => tasks.submit('q', 't', {}, options),
        (e) => e instanceof FatalError && e.refusal === 'invalid-argument',
        JSON.stringify(options, (_, v) => (typeof v === 'bigint' ? `${v}n` : v)),
      );
    }
    assert.equal(host.submitted.length, 0);
  });

  it('maps host refusals as kv does', () => {
    host.refusal = { tag: 'invalid-argument', val: 'task t on queue q is not granted' };
    assert.throws(
      () => tasks.submit('q', 't', {}),
      (e) =>
        e instanceof FatalError &&
        e.refusal === 'invalid-argument' &&
        e.message === 'tasks submit: invalid argument: task t on queue q is not granted',
    );
    host.refusal = { tag: 'unavailable', val: 'down' };
    assert.throws(
      () => tasks.children(),
      (e) =>
        e instanceof RetryableError && e.message === 'tasks children: storage unavailable: down',
    );
  });
});

describe('children', () => {
  it('parses results, null when absent', () => {
    const child = { queue: 'q', task: 't', result: undefined, error: undefined };
    host.children = [
      { ...child, taskId: 'c1', status: 'SUCCEEDED', result: '{"n":1}' },
      { ...child, taskId: 'c2', status: 'FAILED', error: 'boom' },
    ];
    assert.deepEqual(tasks.children(), [
      { taskId: 'c1', queue: 'q', task: 't', status: 'SUCCEEDED', result: { n: 1 }, error: null },
      { taskId: 'c2', queue: 'q', task: 't', status: 'FAILED', result: null, error: 'boom' },
    ]);
  });

  it('is empty before any', () => {
    assert.deepEqual(tasks.children(), []);
  });

  it('refuses a result that does not parse', () => {
    host.children = [{ taskId: 'c1', queue: 'q', task: 't', status: 'SUCCEEDED', result: '{' }];
    assert.throws(() => tasks.children(), FatalError);
  });
});

describe('WaitForChildren', () => {
  it('is a retryable HandlerError', () => {
    const err = new tasks.WaitForChildren();
    assert.ok(err instanceof HandlerError && err instanceof RetryableError);
    assert.equal(err.isFatal, false);
    assert.equal(err.message, 'waiting for children');
  });

  it('escaping the handler asks the host to wait', async () => {
    const result = await run(() => {
      tasks.submit('q', 'child', { n: 1 }, { child: true });
      throw new tasks.WaitForChildren();
    });
    assert.deepEqual(result, { err: { tag: 'retryable', val: 'waiting for children' } });
    assert.equal(host.waited, 1);
  });

  it('from an async handler too', async () => {
    const result = await run(async () => {
      throw new tasks.WaitForChildren();
    });
    assert.deepEqual(result, { err: { tag: 'retryable', val: 'waiting for children' } });
    assert.equal(host.waited, 1);
  });

  it('caught, does nothing', async () => {
    const result = await run(() => {
      try {
        throw new tasks.WaitForChildren();
      } catch {
        return { caught: true };
      }
    });
    assert.deepEqual(result, { ok: '{"caught":true}' });
    assert.equal(host.waited, 0);
  });

  it('other errors do not wait', async () => {
    const result = await run(() => {
      throw new RetryableError('busy');
    });
    assert.deepEqual(result, { err: { tag: 'retryable', val: 'busy' } });
    assert.equal(host.waited, 0);
  });
});
