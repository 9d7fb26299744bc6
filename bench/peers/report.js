'use strict';
// The table of scripts/bench-peers, from the JSON lines of its rounds
// (drain.js's and the dtq queue bench's `peer-result` lines), read from the
// file named on the command line.
//
// Per configuration: the median over rounds of drain tasks/s, and the median
// over rounds of each round's drain tasks/s ÷ the SET ops/s measured right
// after it (so that a round's two figures share the machine's state). A
// system's figure is its best configuration's median. The ratios compare
// dtq with the best peer by each measure.

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

// The median (the upper one of an even count, as the queue bench takes it).
function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)];
}

const fmt = (x) => Math.round(x).toLocaleString('en-US');
const pct = (x) => `${(x * 100).toFixed(1)}%`;

// system → config → rounds, in the order seen.
const systems = new Map();
for (const r of rows) {
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
  }));
  summary.push({
    id,
    name: s.name,
    version: s.version,
    configs,
    rate: Math.max(...configs.map((c) => c.rate)),
    ofSet: Math.max(...configs.map((c) => c.ofSet)),
  });
}

const label = (s) => {
  const c = s.configs;
  if (s.id === 'dtq') return `dtq (${c.map((x) => x.config).join(' / ')})`;
  return `${s.name} ${s.version} (concurrency ${c[0].concurrency}; ${c.map((x) => x.config).join(' / ')})`;
};

const table = [
  [
    'system',
    'drain tasks/s',
    '% of SET ops/s',
    '% of SET, lowest – highest round',
    'Redis CPU per task, µs (in SETs)',
    'Redis busy (cores)',
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
    each((c) => c.cores.toFixed(2)),
  ]);
}
const widths = table[0].map((_, i) => Math.max(...table.map((row) => row[i].length)));
const line = (row) =>
  '| ' + row.map((cell, i) => (i === 0 ? cell.padEnd(widths[i]) : cell.padStart(widths[i]))).join(' | ') + ' |';
console.log(line(table[0]));
console.log('|' + widths.map((w, i) => (i === 0 ? '-'.repeat(w + 2) : '-'.repeat(w + 1) + ':')).join('|') + '|');
for (const row of table.slice(1)) console.log(line(row));

const counts = summary.flatMap((s) => s.configs.map((c) => c.rounds));
const rounds =
  Math.min(...counts) === Math.max(...counts) ? `${counts[0]}` : `${Math.min(...counts)} – ${Math.max(...counts)}`;
const tasks = [...new Set(summary.flatMap((s) => s.configs.map((c) => c.tasks)))];
console.log();
console.log(`Medians of ${rounds} round(s) of ${tasks.map(fmt).join('/')} no-op tasks per configuration.`);
console.log('% of SET: each round\'s drain tasks/s ÷ redis-benchmark SET ops/s (50 clients) measured right after it.');
console.log('Redis CPU per task in SETs: ÷ Redis CPU per SET of that benchmark. Redis busy: its CPU during the drain.');

const dtq = summary.find((s) => s.id === 'dtq');
const peers = summary.filter((s) => s.id !== 'dtq');
if (dtq && peers.length) {
  const byRate = peers.reduce((a, b) => (b.rate > a.rate ? b : a));
  const bySet = peers.reduce((a, b) => (b.ofSet > a.ofSet ? b : a));
  console.log();
  console.log(
    `dtq ÷ best peer, drain tasks/s:  ${(dtq.rate / byRate.rate).toFixed(2)}×  ` +
      `(${fmt(dtq.rate)} vs ${byRate.name} ${fmt(byRate.rate)})`
  );
  console.log(
    `dtq ÷ best peer, % of SET ops/s: ${(dtq.ofSet / bySet.ofSet).toFixed(2)}×  ` +
      `(${pct(dtq.ofSet)} vs ${bySet.name} ${pct(bySet.ofSet)})`
  );
  const target = 2;
  const met = dtq.ofSet / bySet.ofSet >= target && dtq.rate / byRate.rate >= target;
  console.log(`target (issue 16): ≥ ${target}× the best peer: ${met ? 'met' : 'not met'}`);
}
