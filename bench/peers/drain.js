'use strict';
// Drain rounds of one peer queue in one configuration, against a running
// redis-server (scripts/bench-peers starts it):
//
//   node drain.js --system bullmq|bee-queue --port PORT [--tasks 100000]
//                 [--rounds 3] [--procs 1] [--concurrency 50]
//                 [--set-requests 50000] [--timeout-s 300] [--step]
//
// With --step (how run.js drives it), it prints `{"ready":true}` once its
// consumer processes are up, then runs one round per line read on stdin,
// until stdin ends or --rounds are done: so that run.js can interleave the
// rounds of every system while each keeps its processes (and warmed-up
// code) from one round to the next.
//
// Each round: FLUSHALL; the consumer processes (`--procs`, each with
// `--concurrency`) connect and get ready; `--tasks` no-op jobs are put on
// the queue; then the clock starts and every consumer is told to start at
// once. The drain ends at the last completion: the consumers count
// completions in process (the library's completion event, fired after it
// has written the completion to Redis) and report counts every 20 ms; when
// the counts add up to `--tasks`, the consumers are stopped and report the
// time of their last completion. The round fails unless every job was
// counted exactly once (ids checked across processes) and Redis shows every
// job completed and nothing else. Right after, `redis-benchmark -t set`
// (50 clients) measures the same server.
//
// One JSON line per round on stdout; progress on stderr.

const { fork, execFile } = require('node:child_process');
const path = require('node:path');
const readline = require('node:readline');
const Redis = require('ioredis');
const systems = require('./systems');

function parseArgs(argv) {
  const opts = {
    system: '',
    port: 0,
    tasks: 100000,
    rounds: 3,
    procs: 1,
    concurrency: 50,
    setRequests: 50000,
    timeoutS: 300,
    step: false,
  };
  const names = {
    '--system': 'system',
    '--port': 'port',
    '--tasks': 'tasks',
    '--rounds': 'rounds',
    '--procs': 'procs',
    '--concurrency': 'concurrency',
    '--set-requests': 'setRequests',
    '--timeout-s': 'timeoutS',
  };
  for (let i = 0; i < argv.length; i += 2) {
    if (argv[i] === '--step') {
      opts.step = true;
      i -= 1;
      continue;
    }
    const key = names[argv[i]];
    if (!key || argv[i + 1] === undefined) throw new Error(`unknown or incomplete argument ${argv[i]}`);
    opts[key] = key === 'system' ? argv[i + 1] : Number(argv[i + 1]);
    if (key !== 'system' && !(Number.isInteger(opts[key]) && opts[key] > 0)) {
      throw new Error(`${argv[i]} needs a positive whole number, not ${argv[i + 1]}`);
    }
  }
  if (!systems[opts.system]) {
    throw new Error(`--system must be one of ${Object.keys(systems).join(', ')}`);
  }
  if (!opts.port) throw new Error('--port is required');
  return opts;
}

function log(...args) {
  console.error('drain:', ...args);
}

const seconds = (from, to) => Number(to - from) / 1e9;

// Redis's counters so far: CPU seconds in user space and in the kernel (all
// its threads, to the microsecond), read events and commands (the scripts'
// included).
async function redisStats(admin) {
  const info = await admin.info('cpu', 'stats');
  const stats = {};
  for (const line of info.split('\n')) {
    const [k, v] = line.trim().split(':');
    if (v !== undefined) stats[k] = Number(v);
  }
  return {
    user: stats.used_cpu_user,
    sys: stats.used_cpu_sys,
    cpu: stats.used_cpu_user + stats.used_cpu_sys,
    reads: stats.total_reads_processed,
    commands: stats.total_commands_processed,
  };
}

// Redis's CPU seconds so far (user + system, all its threads).
async function redisCpu(admin) {
  return (await redisStats(admin)).cpu;
}

function redisBenchmarkSet(port, requests) {
  return new Promise((resolve, reject) => {
    execFile(
      'redis-benchmark',
      ['-h', '127.0.0.1', '-p', String(port), '-t', 'set', '-n', String(requests), '--csv'],
      { timeout: 120_000 },
      (err, stdout, stderr) => {
        if (err) return reject(new Error(`redis-benchmark failed: ${err.message} ${stderr}`));
        for (const line of stdout.split('\n').slice(1)) {
          const cols = line.split(',').map((c) => c.replace(/"/g, ''));
          if (cols[0] === 'SET') return resolve(Number(cols[1]));
        }
        reject(new Error(`no SET figure in redis-benchmark's output: ${stdout}`));
      }
    );
  });
}

// The consumer processes, and a way to wait for their messages.
class Consumers {
  constructor(opts) {
    this.opts = opts;
    this.children = [];
    this.failure = null;
    this.waiters = [];
    this.counts = [];
  }

  async spawn() {
    const script = path.join(__dirname, 'consumer.js');
    for (let i = 0; i < this.opts.procs; i++) {
      const child = fork(script, [this.opts.system, String(this.opts.port), String(this.opts.concurrency)], {
        stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
        serialization: 'advanced',
      });
      const slot = { child, inbox: [], exited: false };
      child.on('message', (msg) => {
        if (msg.type === 'error') {
          this.fail(new Error(`consumer ${i + 1}: ${msg.message}`));
        } else if (msg.type === 'progress') {
          this.counts[i] = msg.count;
        } else {
          slot.inbox.push(msg);
        }
        this.wake();
      });
      child.on('exit', (code, signal) => {
        slot.exited = true;
        if (!this.closing) this.fail(new Error(`consumer ${i + 1} exited (${signal || code})`));
        this.wake();
      });
      this.children.push(slot);
    }
    await this.collect('alive', 30_000);
  }

  fail(err) {
    if (!this.failure) this.failure = err;
  }

  wake() {
    const waiters = this.waiters;
    this.waiters = [];
    for (const w of waiters) w();
  }

  // Resolve when `done()` is true; reject on a consumer's failure or after
  // `ms` milliseconds, with `what` in the message.
  until(done, ms, what) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.fail(new Error(`timed out after ${ms / 1000} s waiting for ${what()}`));
        this.wake();
      }, ms);
      const check = () => {
        if (this.failure) {
          clearTimeout(timer);
          reject(this.failure);
        } else if (done()) {
          clearTimeout(timer);
          resolve();
        } else {
          this.waiters.push(check);
        }
      };
      check();
    });
  }

  // One message of `type` from every consumer.
  async collect(type, ms) {
    const ready = () => this.children.every((s) => s.inbox.some((m) => m.type === type));
    await this.until(ready, ms, () => `'${type}' from every consumer`);
    return this.children.map((s) => {
      const at = s.inbox.findIndex((m) => m.type === type);
      return s.inbox.splice(at, 1)[0];
    });
  }

  send(msg) {
    for (const s of this.children) s.child.send(msg);
  }

  total() {
    return this.counts.reduce((a, b) => a + (b || 0), 0);
  }

  close() {
    this.closing = true;
    for (const s of this.children) {
      if (!s.exited) s.child.kill('SIGTERM');
    }
  }
}

async function round(opts, system, consumers, admin, n) {
  await admin.flushall();
  consumers.counts = consumers.children.map(() => 0);
  consumers.send({ type: 'prepare' });
  await consumers.collect('ready', 30_000);

  let t = process.hrtime.bigint();
  await system.fill(opts.port, opts.tasks);
  const fillS = seconds(t, process.hrtime.bigint());

  const before = await redisStats(admin);
  const startedAt = process.hrtime.bigint();
  consumers.send({ type: 'start' });
  // The counts arrive every 20 ms; the end time comes from the consumers.
  let last = 0;
  let lastMoved = Date.now();
  await consumers.until(
    () => {
      const total = consumers.total();
      if (total !== last) {
        last = total;
        lastMoved = Date.now();
      }
      return total >= opts.tasks;
    },
    opts.timeoutS * 1000,
    () => `${opts.tasks} completions (${consumers.total()} counted, the last ${((Date.now() - lastMoved) / 1000).toFixed(1)} s ago)`
  );
  const after = await redisStats(admin);
  consumers.send({ type: 'stop' });
  const done = await consumers.collect('done', 60_000);

  const endedAt = done.reduce((m, d) => (BigInt(d.lastAt) > m ? BigInt(d.lastAt) : m), 0n);
  const counted = done.reduce((a, d) => a + d.count, 0);
  const ids = new Set();
  for (const d of done) for (const id of d.ids) ids.add(String(id));
  if (counted !== opts.tasks || ids.size !== opts.tasks) {
    throw new Error(
      `round ${n}: ${counted} completions counted for ${ids.size} distinct jobs; expected ${opts.tasks} of each`
    );
  }
  const drainS = seconds(startedAt, endedAt);

  const setCpuBefore = await redisCpu(admin);
  const set = await redisBenchmarkSet(opts.port, opts.setRequests);
  const setCpu = (await redisCpu(admin)) - setCpuBefore;
  await system.verify(opts.port, opts.tasks);

  return {
    system: opts.system,
    name: system.name,
    version: system.version,
    config: `${opts.procs} proc${opts.procs > 1 ? 's' : ''}`,
    procs: opts.procs,
    concurrency: opts.concurrency,
    round: n,
    tasks: opts.tasks,
    fill_s: fillS,
    drain_s: drainS,
    rate: opts.tasks / drainS,
    set,
    redis_cpu_per_task_us: ((after.cpu - before.cpu) / opts.tasks) * 1e6,
    redis_cpu_user_per_task_us: ((after.user - before.user) / opts.tasks) * 1e6,
    redis_cpu_sys_per_task_us: ((after.sys - before.sys) / opts.tasks) * 1e6,
    // One INFO is not the consumers': its read (after) or its command
    // (before).
    redis_reads_per_task: (after.reads - before.reads - 1) / opts.tasks,
    redis_commands_per_task: (after.commands - before.commands - 1) / opts.tasks,
    // The consumer processes' CPU from their start to their stop (a few
    // idle milliseconds after the last completion included).
    client_cpu_per_task_us: (done.reduce((a, d) => a + d.cpuS, 0) / opts.tasks) * 1e6,
    redis_cpu_per_set_us: (setCpu / opts.setRequests) * 1e6,
    per_process: done.map((d) => d.count),
  };
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const system = systems[opts.system];
  const admin = new Redis({ host: '127.0.0.1', port: opts.port, maxRetriesPerRequest: 1, lazyConnect: true });
  admin.on('error', () => {}); // the command that meets it fails
  await admin.connect();
  const consumers = new Consumers(opts);
  const stop = () => {
    consumers.close();
    process.exit(1);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
  try {
    await consumers.spawn();
    const lines = opts.step ? readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]() : null;
    if (opts.step) process.stdout.write(JSON.stringify({ ready: true }) + '\n');
    for (let n = 1; n <= opts.rounds; n++) {
      if (lines && (await lines.next()).done) break;
      const r = await round(opts, system, consumers, admin, n);
      if (!opts.step) log(
        `${system.name} ${r.config}, round ${n}: ${Math.round(r.rate)} tasks/s (${r.drain_s.toFixed(2)} s),` +
          ` SET ${Math.round(r.set)}/s, fill ${r.fill_s.toFixed(2)} s, per process ${r.per_process.join('+')}`
      );
      process.stdout.write(JSON.stringify(r) + '\n');
    }
  } finally {
    consumers.close();
    admin.disconnect();
  }
}

main().then(
  () => process.exit(0),
  (err) => {
    console.error(`drain: ${(err && err.message) || err}`);
    process.exit(1);
  }
);
