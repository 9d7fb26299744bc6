'use strict';
// The two peer queues, behind one shape each:
//
//   fill(port, tasks)          put `tasks` no-op jobs on the queue (producer
//                              side, before the clock starts)
//   consumer(port, concurrency, onCompleted)
//                              a consumer that is connected and ready but
//                              not yet taking jobs; `start()` makes it take
//                              them, `close()` stops it. `onCompleted(id)` is
//                              called in process after the queue library has
//                              written a job's completion to Redis: the
//                              library's own completion event, no Redis
//                              command of ours per job.
//   verify(port, tasks)        what Redis says after the drain: every job
//                              completed, none waiting, active or failed
//
// Both run with their libraries' defaults except the concurrency (and, for
// Bee-Queue, `getEvents: false` on the consumer: it does not listen to other
// workers' events; it still publishes its own, the default `sendEvents`).
// Completed jobs are kept (BullMQ's `removeOnComplete` and Bee-Queue's
// `removeOnSuccess` are off by default), as dtq keeps its task records.

const QUEUE = 'bench';
const FILL_BATCH = 1000;

function redisOptions(port) {
  return { host: '127.0.0.1', port };
}

const bullmq = {
  name: 'BullMQ',
  version: require('bullmq/package.json').version,

  async fill(port, tasks) {
    const { Queue } = require('bullmq');
    const queue = new Queue(QUEUE, { connection: redisOptions(port) });
    try {
      await queue.waitUntilReady();
      for (let start = 0; start < tasks; start += FILL_BATCH) {
        const jobs = [];
        for (let n = start; n < Math.min(tasks, start + FILL_BATCH); n++) {
          jobs.push({ name: 'noop', data: { n } });
        }
        await queue.addBulk(jobs);
      }
    } finally {
      await queue.close();
    }
  },

  async consumer(port, concurrency, onCompleted) {
    const { Worker } = require('bullmq');
    const worker = new Worker(QUEUE, async () => null, {
      connection: redisOptions(port),
      concurrency,
      autorun: false,
    });
    worker.on('completed', (job) => onCompleted(job.id));
    worker.on('failed', (job, err) => {
      throw new Error(`BullMQ job ${job && job.id} failed: ${err && err.message}`);
    });
    worker.on('error', (err) => {
      throw new Error(`BullMQ worker error: ${err && err.message}`);
    });
    await worker.waitUntilReady();
    let running = null;
    return {
      start() {
        running = worker.run();
        running.catch((err) => {
          throw err;
        });
      },
      async close() {
        await worker.close();
        if (running) await running;
      },
    };
  },

  async verify(port, tasks) {
    const { Queue } = require('bullmq');
    const queue = new Queue(QUEUE, { connection: redisOptions(port) });
    try {
      const counts = await queue.getJobCounts(
        'completed',
        'failed',
        'waiting',
        'active',
        'delayed',
        'paused',
        'prioritized',
        'waiting-children'
      );
      const pending = Object.entries(counts).filter(([k, v]) => k !== 'completed' && v !== 0);
      if (counts.completed !== tasks || pending.length) {
        throw new Error(`BullMQ: Redis shows ${JSON.stringify(counts)}, expected ${tasks} completed and nothing else`);
      }
      return counts;
    } finally {
      await queue.close();
    }
  },
};

const beeQueue = {
  name: 'Bee-Queue',
  version: require('bee-queue/package.json').version,

  async fill(port, tasks) {
    const Queue = require('bee-queue');
    const queue = new Queue(QUEUE, { redis: redisOptions(port), isWorker: false, getEvents: false });
    try {
      await queue.ready();
      for (let start = 0; start < tasks; start += FILL_BATCH) {
        const jobs = [];
        for (let n = start; n < Math.min(tasks, start + FILL_BATCH); n++) {
          jobs.push(queue.createJob({ n }));
        }
        const errors = await queue.saveAll(jobs);
        if (errors.size) {
          const [job, err] = errors.entries().next().value;
          throw new Error(`Bee-Queue: ${errors.size} jobs not saved, e.g. ${job.id}: ${err.message}`);
        }
      }
    } finally {
      await queue.close();
    }
  },

  async consumer(port, concurrency, onCompleted) {
    const Queue = require('bee-queue');
    const queue = new Queue(QUEUE, { redis: redisOptions(port), getEvents: false });
    queue.on('succeeded', (job) => onCompleted(job.id));
    queue.on('failed', (job, err) => {
      throw new Error(`Bee-Queue job ${job && job.id} failed: ${err && err.message}`);
    });
    queue.on('error', (err) => {
      throw new Error(`Bee-Queue error: ${err && err.message}`);
    });
    await queue.ready();
    return {
      start() {
        queue.process(concurrency, async () => null);
      },
      async close() {
        await queue.close(10_000);
      },
    };
  },

  async verify(port, tasks) {
    const Queue = require('bee-queue');
    const queue = new Queue(QUEUE, { redis: redisOptions(port), isWorker: false, getEvents: false });
    try {
      await queue.ready();
      const health = await queue.checkHealth();
      const { succeeded, waiting, active, failed, delayed } = health;
      if (succeeded !== tasks || waiting || active || failed || delayed) {
        throw new Error(`Bee-Queue: Redis shows ${JSON.stringify(health)}, expected ${tasks} succeeded and nothing else`);
      }
      return health;
    } finally {
      await queue.close();
    }
  },
};

module.exports = { bullmq, 'bee-queue': beeQueue };
