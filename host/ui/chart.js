// Completions per second over the last minutes, from a queue's live
// events: every event whose status is terminal counts once, in the second
// of its `at` (the time Redis stamped it), split into succeeded and the
// rest. Drawn as an inline SVG bar chart, with a text summary beside it
// for screen readers and for exact figures.

import { TERMINAL, h, svg } from './dom.js';

// Seconds shown.
export const WINDOW_S = 120;

const WIDTH = 1000;
const HEIGHT = 160;
const PAD = { left: 36, right: 6, top: 10, bottom: 20 };

export class Throughput {
  constructor() {
    // second (epoch) → { ok, failed }
    this.buckets = new Map();
    this.figure = h('figure', { class: 'chart' });
    this.caption = h('figcaption');
    this.plot = svg('svg', {
      viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
      role: 'img',
      class: 'plot',
    });
    this.figure.append(this.plot, this.caption);
    this.render();
  }

  // Count one event of the stream (`data` is its JSON).
  add(event) {
    if (!TERMINAL.includes(event.event)) return;
    let at = Date.now();
    try { at = JSON.parse(event.data).at ?? at; } catch { /* keep now */ }
    const s = Math.floor(at / 1000);
    const b = this.buckets.get(s) ?? { ok: 0, failed: 0 };
    if (event.event === 'SUCCEEDED') b.ok += 1; else b.failed += 1;
    this.buckets.set(s, b);
  }

  // Redraw for the window ending now; drop what fell out of it.
  render() {
    const now = Math.floor(Date.now() / 1000);
    const first = now - WINDOW_S + 1;
    for (const s of this.buckets.keys()) if (s < first) this.buckets.delete(s);
    let peak = 0;
    let total = 0;
    let failed = 0;
    for (const b of this.buckets.values()) {
      peak = Math.max(peak, b.ok + b.failed);
      total += b.ok + b.failed;
      failed += b.failed;
    }
    const top = niceCeiling(Math.max(peak, 1));
    const w = (WIDTH - PAD.left - PAD.right) / WINDOW_S;
    const plotH = HEIGHT - PAD.top - PAD.bottom;
    const y = (v) => PAD.top + plotH - (v / top) * plotH;

    const nodes = [
      svg('line', { class: 'axis', x1: PAD.left, y1: y(0), x2: WIDTH - PAD.right, y2: y(0) }),
      svg('line', { class: 'grid', x1: PAD.left, y1: y(top), x2: WIDTH - PAD.right, y2: y(top) }),
      svg('text', { class: 'tick', x: PAD.left - 4, y: y(top) + 4, 'text-anchor': 'end' }, String(top)),
      svg('text', { class: 'tick', x: PAD.left - 4, y: y(0), 'text-anchor': 'end' }, '0'),
      svg('text', { class: 'tick', x: PAD.left, y: HEIGHT - 4 }, `${WINDOW_S / 60} min ago`),
      svg('text', { class: 'tick', x: WIDTH - PAD.right, y: HEIGHT - 4, 'text-anchor': 'end' }, 'now'),
    ];
    for (const [s, b] of this.buckets) {
      const x = PAD.left + (s - first) * w;
      const bw = Math.max(w - 0.3, 0.8);
      if (b.ok) nodes.push(svg('rect', { class: 'ok', x, width: bw, y: y(b.ok), height: y(0) - y(b.ok) }));
      if (b.failed) {
        nodes.push(svg('rect', {
          class: 'failed', x, width: bw, y: y(b.ok + b.failed), height: y(b.ok) - y(b.ok + b.failed),
        }));
      }
    }
    this.plot.replaceChildren(...nodes);
    const last10 = [...this.buckets].filter(([s]) => s > now - 10)
      .reduce((n, [, b]) => n + b.ok + b.failed, 0);
    const summary = `${total} completed in the last ${WINDOW_S / 60} minutes `
      + `(${failed} not succeeded); peak ${peak}/s; last 10 s ${(last10 / 10).toFixed(1)}/s`;
    this.plot.setAttribute('aria-label', `Completions per second. ${summary}`);
    this.caption.replaceChildren(
      h('span', { class: 'key ok' }, 'succeeded'), ' ',
      h('span', { class: 'key failed' }, 'failed, dead-lettered, cancelled or expired'), ' — ',
      summary,
    );
  }
}

// 1, 2, 5, 10, 20, 50, … at or above `v`.
function niceCeiling(v) {
  let m = 1;
  for (;;) {
    for (const f of [1, 2, 5]) if (f * m >= v) return f * m;
    m *= 10;
  }
}
