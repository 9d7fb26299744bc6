'use strict';
// The rounds of scripts/bench-peers, interleaved: every configuration's
// process is started once and kept (so its later rounds run warmed up),
// then round 1 of each configuration runs in turn, then round 2 of each,
// and so on. This VM's speed moves within a minute; interleaving spreads
// that over every system instead of letting one system's block fall in a
// slow minute. The order within a round is rotated from one round to the
// next. Only one configuration works at a time: the others wait, idle.
//
//   node run.js --port PORT --tasks N --rounds R --systems "bullmq bee-queue dtq"
//               --procs "1 2" --concurrency 50 --set-requests 50000
//               --round-timeout-s 600 [--mode pinned] --results FILE --root REPO
//
// The peers' rounds run in drain.js (--step); dtq's in the peer mode of
// tests/benches/queue.rs (DTQ_BENCH_REDIS_PORT, DTQ_BENCH_STEP=1) through
// `cargo bench`. Every round's JSON line is appended to --results, with
// `mode` (the script's CPU mode, pinned or unpinned) added when given.

const { spawn } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');
const readline = require('node:readline');

function parseArgs(argv) {
  const opts = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith('--') || argv[i + 1] === undefined) throw new Error(`bad argument ${argv[i]}`);
    opts[argv[i].slice(2)] = argv[i + 1];
  }
  for (const k of ['port', 'tasks', 'rounds', 'systems', 'procs', 'concurrency', 'set-requests', 'round-timeout-s', 'results', 'root']) {
    if (opts[k] === undefined) throw new Error(`--${k} is required`);
  }
  return opts;
}

function log(...args) {
  console.error('bench-peers:', ...args);
}

// A configuration's process: one result line per round asked for.
class Config {
  constructor(label, command, args, env, isResult, isReady) {
    this.label = label;
    this.failed = null;
    this.child = spawn(command, args, { env: { ...process.env, ...env }, stdio: ['pipe', 'pipe', 'inherit'] });
    this.isResult = isResult;
    this.isReady = isReady;
    this.lines = [];
    this.waiter = null;
    this.child.on('error', (err) => this.fail(`cannot start: ${err.message}`));
    this.child.on('exit', (code, signal) => {
      this.exited = true;
      if (!this.closing) this.fail(`exited (${signal || code})`);
    });
    this.child.stdin.on('error', () => {}); // an exit is reported above
    readline.createInterface({ input: this.child.stdout }).on('line', (line) => {
      const ready = this.isReady(line);
      const result = this.isResult(line);
      if (ready || result) {
        this.lines.push(ready ? { ready: true } : result);
        this.wake();
      } else if (line.trim()) {
        console.error(`  ${line}`);
      }
    });
  }

  fail(why) {
    if (!this.failed) this.failed = why;
    this.wake();
  }

  wake() {
    if (this.waiter) {
      const w = this.waiter;
      this.waiter = null;
      w();
    }
  }

  // The next ready or result line, within `ms`.
  next(ms, what) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => this.fail(`timed out after ${ms / 1000} s waiting for ${what}`), ms);
      const check = () => {
        if (this.lines.length) {
          clearTimeout(timer);
          resolve(this.lines.shift());
        } else if (this.failed) {
          clearTimeout(timer);
          reject(new Error(`${this.label}: ${this.failed}`));
        } else {
          this.waiter = check;
        }
      };
      check();
    });
  }

  async round(ms) {
    this.child.stdin.write('\n');
    return this.next(ms, 'its round');
  }

  close() {
    this.closing = true;
    this.child.stdin.end();
  }

  kill() {
    this.closing = true;
    if (!this.exited) this.child.kill('SIGTERM');
  }
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const rounds = Number(opts.rounds);
  const roundMs = Number(opts['round-timeout-s']) * 1000;
  const configs = [];
  const failures = [];
  const stopAll = () => {
    for (const c of configs) c.kill();
  };
  process.on('SIGTERM', () => {
    stopAll();
    process.exit(143);
  });
  process.on('SIGINT', () => {
    stopAll();
    process.exit(130);
  });

  const drain = path.join(__dirname, 'drain.js');
  for (const system of opts.systems.split(/\s+/).filter(Boolean)) {
    if (system === 'dtq') {
      configs.push(
        new Config(
          'dtq',
          'cargo',
          ['bench', '-q', '-p', 'dtq-tests', '--bench', 'queue', '--manifest-path', path.join(opts.root, 'Cargo.toml')],
          {
            DTQ_BENCH_REDIS_PORT: opts.port,
            DTQ_BENCH_TASKS: opts.tasks,
            DTQ_BENCH_ROUNDS: opts.rounds,
            DTQ_BENCH_STEP: '1',
          },
          (line) => (line.startsWith('peer-result ') ? JSON.parse(line.slice('peer-result '.length)) : null),
          (line) => line === 'peer-ready'
        )
      );
      continue;
    }
    for (const procs of opts.procs.split(/\s+/).filter(Boolean)) {
      configs.push(
        new Config(
          `${system}, ${procs} process(es)`,
          process.execPath,
          [drain, '--system', system, '--port', opts.port, '--tasks', opts.tasks, '--rounds', opts.rounds,
            '--procs', procs, '--concurrency', opts.concurrency, '--set-requests', opts['set-requests'],
            '--timeout-s', opts['round-timeout-s'], '--step'],
          {},
          (line) => {
            if (!line.startsWith('{')) return null;
            const r = JSON.parse(line);
            return r.ready ? null : r;
          },
          (line) => line === '{"ready":true}'
        )
      );
    }
  }

  // Every process up (dtq's handlers loaded, the consumers forked) before
  // the first round, so that no start-up runs beside a round.
  let live = [];
  for (const c of configs) {
    try {
      await c.next(3_600_000, 'it to start');
      live.push(c);
    } catch (err) {
      log(`${err.message}; going on without it`);
      failures.push(c.label);
      c.kill();
    }
  }

  for (let n = 1; n <= rounds; n++) {
    const shift = (n - 1) % Math.max(live.length, 1);
    const order = [...live.slice(shift), ...live.slice(0, shift)];
    for (const c of order) {
      try {
        const r = await c.round(roundMs);
        if (opts.mode) r.mode = opts.mode;
        fs.appendFileSync(opts.results, JSON.stringify(r) + '\n');
        log(
          `${opts.mode ? `${opts.mode}, ` : ''}round ${n}, ${c.label}: ${Math.round(r.rate)} tasks/s (${r.drain_s.toFixed(2)} s), ` +
            `SET ${Math.round(r.set)}/s, ${((r.rate / r.set) * 100).toFixed(1)}% of SET; ` +
            `Redis ${r.redis_cpu_per_task_us.toFixed(1)} µs/task; fill ${r.fill_s.toFixed(2)} s` +
            (r.per_process && r.per_process.length > 1 ? `, per process ${r.per_process.join('+')}` : '')
        );
      } catch (err) {
        log(`${err.message}; going on without it`);
        failures.push(c.label);
        c.kill();
        live = live.filter((x) => x !== c);
      }
    }
  }
  for (const c of live) c.close();
  const guard = setTimeout(() => {
    log('a configuration did not exit within 60 s of its last round; stopping it');
    stopAll();
  }, 60_000);
  await Promise.all(
    live.map((c) => (c.exited ? null : new Promise((resolve) => c.child.on('exit', resolve))))
  );
  clearTimeout(guard);
  if (failures.length) {
    log(`failed: ${failures.join('; ')}`);
    process.exit(1);
  }
}

main().catch((err) => {
  console.error(`bench-peers: ${err.stack || err.message || err}`);
  process.exit(1);
});
