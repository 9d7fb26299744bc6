'use strict';
// The tables of scripts/bench-peers, from the JSON lines of its rounds
// (drain.js's and the dtq queue bench's `peer-result` lines), read from the
// file named on the command line. One table per CPU mode (the `mode` that
// run.js adds to each line: pinned, unpinned), in the order the modes ran;
// lines without a mode (older files) make one table.
//
// Per configuration: the median over rounds of drain tasks/s; the median
// over rounds of each round's drain tasks/s ÷ the SET ops/s measured right
// after it (so that a round's two figures share the machine's state); and
// the median over rounds of Redis's CPU per drained task (INFO cpu read
// right before and after the drain), also in SETs of the benchmark after
// it. A system's figure is its best configuration's median. The ratios
// compare dtq with the fastest peer (the peer configuration with the highest
// median tasks/s) within each mode: the modes ran one after the other, each
// with its own rounds, so only ratios within a mode share the machine's
// state.

const fs = require('node:fs');

const file = process.argv[2];
if (!file) {
  console.error('usage: report.js RESULTS.jsonl');
  process.exit(2);
}
const rows = fs
  .readFileSync(file, 'utf8')
  .split('\n')
  .filter((l) => l.trim())
  .map((l) => JSON.parse(l));
if (!rows.length) {
  console.error('report: no results');
  process.exit(1);
}

// issue 37: dtq ≥ 2× the fastest peer, in drain tasks/s, in each mode.
const TARGET = 2;

// The median (the upper one of an even count, as the queue bench takes it).
function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)];
}

// The median, or undefined when a round lacks the figure.
const maybeMedian = (values) => (values.every((v) => typeof v === 'number') ? median(values) : undefined);

const fmt = (x) => Math.round(x).toLocaleString('en-US');
const pct = (x) => `${(x * 100).toFixed(1)}%`;
const times = (x) => `${x.toFixed(2)}×`;

const MODES = {
  pinned: 'pinned: Redis alone on the first CPU, consumers, producers and redis-benchmark on the rest',
  unpinned: 'unpinned: Redis, consumers, producers and redis-benchmark share every CPU',
};

function printTable(table) {
  const widths = table[0].map((_, i) => Math.max(...table.map((row) => row[i].length)));
  const line = (row) =>
    '| ' + row.map((cell, i) => (i === 0 ? cell.padEnd(widths[i]) : cell.padStart(widths[i]))).join(' | ') + ' |';
  console.log(line(table[0]));
  console.log('|' + widths.map((w, i) => (i === 0 ? '-'.repeat(w + 2) : '-'.repeat(w + 1) + ':')).join('|') + '|');
  for (const row of table.slice(1)) console.log(line(row));
}

// The summary of one mode's rounds: per system, per configuration.
function summarize(modeRows) {
  // system → config → rounds, in the order seen.
  const systems = new Map();
  for (const r of modeRows) {
    if (!systems.has(r.system)) systems.set(r.system, { name: r.name, version: r.version, configs: new Map() });
    const s = systems.get(r.system);
    if (!s.configs.has(r.config)) s.configs.set(r.config, []);
    s.configs.get(r.config).push(r);
  }
  const summary = [];
  for (const [id, s] of systems) {
    const configs = [...s.configs].map(([config, rounds]) => ({
      config,
      concurrency: rounds[0].concurrency,
      rounds: rounds.length,
      tasks: rounds[0].tasks,
      rate: median(rounds.map((r) => r.rate)),
      ofSet: median(rounds.map((r) => r.rate / r.set)),
      set: median(rounds.map((r) => r.set)),
      low: Math.min(...rounds.map((r) => r.rate / r.set)),
      high: Math.max(...rounds.map((r) => r.rate / r.set)),
      cpuTask: median(rounds.map((r) => r.redis_cpu_per_task_us)),
      // Redis's CPU during the drain, in cores: what share of its CPU the
      // queue used (near 1: Redis is the bound; well under: the consumers).
      cores: median(rounds.map((r) => (r.redis_cpu_per_task_us * r.rate) / 1e6)),
      cpuSets: median(rounds.map((r) => r.redis_cpu_per_task_us / r.redis_cpu_per_set_us)),
      cpuLow: Math.min(...rounds.map((r) => r.redis_cpu_per_task_us)),
      cpuHigh: Math.max(...rounds.map((r) => r.redis_cpu_per_task_us)),
      // Lines of older runs lack these.
      cpuUser: maybeMedian(rounds.map((r) => r.redis_cpu_user_per_task_us)),
      cpuSys: maybeMedian(rounds.map((r) => r.redis_cpu_sys_per_task_us)),
      reads: maybeMedian(rounds.map((r) => r.redis_reads_per_task)),
      commands: maybeMedian(rounds.map((r) => r.redis_commands_per_task)),
      client: maybeMedian(rounds.map((r) => r.client_cpu_per_task_us)),
      total: maybeMedian(rounds.map((r) => r.redis_cpu_per_task_us + r.client_cpu_per_task_us)),
    }));
    const fastest = configs.reduce((a, b) => (b.rate > a.rate ? b : a));
    summary.push({
      id,
      name: s.name,
      version: s.version,
      configs,
      fastest,
      rate: fastest.rate,
      ofSet: Math.max(...configs.map((c) => c.ofSet)),
      cpuTask: Math.min(...configs.map((c) => c.cpuTask)),
    });
  }
  return summary;
}

const label = (s) => {
  const c = s.configs;
  if (s.id === 'dtq') return `dtq (${c.map((x) => x.config).join(' / ')})`;
  return `${s.name} ${s.version} (concurrency ${c[0].concurrency}; ${c.map((x) => x.config).join(' / ')})`;
};
const configName = (s, c) => (s.id === 'dtq' ? 'dtq' : `${s.name}, ${c.config}`);

// Print one mode's table and ratios; its verdict for the summary.
function report(mode, modeRows) {
  const summary = summarize(modeRows);
  if (mode) console.log(`${MODES[mode] || mode}`);
  console.log();
  const table = [
    [
      'system',
      'drain tasks/s',
      '% of SET ops/s',
      '% of SET, lowest – highest round',
      'Redis CPU per task, µs (in SETs)',
    ],
  ];
  for (const s of summary) {
    const each = (f) => s.configs.map(f).join(' / ');
    table.push([
      label(s),
      each((c) => fmt(c.rate)),
      each((c) => pct(c.ofSet)),
      each((c) => `${pct(c.low)} – ${pct(c.high)}`),
      each((c) => `${c.cpuTask.toFixed(1)} (${c.cpuSets.toFixed(2)})`),
    ]);
  }
  printTable(table);

  // Redis's work per drained task, per configuration.
  console.log();
  const opt = (x, digits) => (x === undefined ? '–' : x.toFixed(digits));
  const work = [
    [
      'Redis per drained task',
      'CPU, µs',
      'lowest – highest round',
      'user + sys, µs',
      'in SETs',
      'read events',
      'commands',
      'busy (cores)',
      'consumers\' CPU, µs',
      'Redis + consumers, µs',
    ],
  ];
  for (const s of summary) {
    for (const c of s.configs) {
      work.push([
        s.id === 'dtq' ? `dtq, ${c.config}` : `${s.name}, ${c.config}`,
        c.cpuTask.toFixed(1),
        `${c.cpuLow.toFixed(1)} – ${c.cpuHigh.toFixed(1)}`,
        `${opt(c.cpuUser, 1)} + ${opt(c.cpuSys, 1)}`,
        c.cpuSets.toFixed(2),
        opt(c.reads, 2),
        opt(c.commands, 2),
        c.cores.toFixed(2),
        opt(c.client, 1),
        opt(c.total, 1),
      ]);
    }
  }
  printTable(work);

  const counts = summary.flatMap((s) => s.configs.map((c) => c.rounds));
  const rounds =
    Math.min(...counts) === Math.max(...counts) ? `${counts[0]}` : `${Math.min(...counts)} – ${Math.max(...counts)}`;
  const tasks = [...new Set(summary.flatMap((s) => s.configs.map((c) => c.tasks)))];
  console.log();
  console.log(`Medians of ${rounds} round(s) of ${tasks.map(fmt).join('/')} no-op tasks per configuration.`);

  const dtq = summary.find((s) => s.id === 'dtq');
  const peers = summary.filter((s) => s.id !== 'dtq');
  if (!dtq || !peers.length) return null;
  const fastest = peers.reduce((a, b) => (b.rate > a.rate ? b : a));
  const bySet = peers.reduce((a, b) => (b.ofSet > a.ofSet ? b : a));
  const leanest = peers.reduce((a, b) => (b.cpuTask < a.cpuTask ? b : a));
  const ratio = dtq.rate / fastest.rate;
  const fastestName = configName(fastest, fastest.fastest);
  console.log();
  console.log(
    `dtq ÷ fastest peer, drain tasks/s:  ${times(ratio)}  (${fmt(dtq.rate)} vs ${fastestName} ${fmt(fastest.rate)})`
  );
  console.log(
    `dtq ÷ best peer, % of SET ops/s:    ${times(dtq.ofSet / bySet.ofSet)}  ` +
      `(${pct(dtq.ofSet)} vs ${bySet.name} ${pct(bySet.ofSet)})`
  );
  console.log(
    `Redis CPU per task: dtq ${dtq.cpuTask.toFixed(1)} µs; ${fastestName} ${fastest.fastest.cpuTask.toFixed(1)} µs ` +
      `(${times(fastest.fastest.cpuTask / dtq.cpuTask)} dtq's)` +
      (leanest !== fastest || leanest.cpuTask !== fastest.fastest.cpuTask
        ? `; the least of any peer ${leanest.name} ${leanest.cpuTask.toFixed(1)} µs (${times(leanest.cpuTask / dtq.cpuTask)})`
        : '')
  );
  const met = ratio >= TARGET;
  console.log(
    `target (issue 37), dtq ≥ ${TARGET}× the fastest peer's drain tasks/s: ${met ? 'met' : 'not met'}` +
      (met ? '' : ` (short by ${pct(1 - ratio / TARGET)}: ${fmt(TARGET * fastest.rate)} tasks/s needed)`)
  );
  return { mode, dtq, fastest, fastestName, ratio, met };
}

const modes = [...new Set(rows.map((r) => r.mode || ''))];
const verdicts = [];
for (const [i, mode] of modes.entries()) {
  if (i) console.log('\n');
  verdicts.push(report(mode, rows.filter((r) => (r.mode || '') === mode)));
}

console.log();
console.log("% of SET: each round's drain tasks/s ÷ redis-benchmark SET ops/s (50 clients) measured right after it.");
console.log(
  'Redis CPU per task: INFO cpu (used_cpu_user + used_cpu_sys) right before and after the drain ÷ tasks;' +
    ' in SETs: ÷ Redis CPU per SET of that benchmark. Redis busy: its CPU during the drain.'
);
console.log(
  'Read events: total_reads_processed; commands: total_commands_processed (the scripts\' own included);' +
    ' both over the drain ÷ tasks, the bench\'s own INFO and polls aside.'
);
console.log(
  "Consumers' CPU: the consumer processes' (dtq: the worker's process, with the bench's polls) over the drain ÷ tasks."
);

if (modes.length > 1 && verdicts.every(Boolean)) {
  console.log();
  printTable([
    ['mode', 'dtq tasks/s', 'fastest peer', 'its tasks/s', 'dtq ÷ fastest', `≥ ${TARGET}×`, 'Redis µs/task: dtq', 'fastest peer'],
    ...verdicts.map((v) => [
      v.mode,
      fmt(v.dtq.rate),
      v.fastestName,
      fmt(v.fastest.rate),
      times(v.ratio),
      v.met ? 'met' : 'not met',
      v.dtq.cpuTask.toFixed(1),
      v.fastest.fastest.cpuTask.toFixed(1),
    ]),
  ]);
}
