// Building the page. Text from the API (payloads, results, errors, logs)
// only ever becomes text nodes, never markup.

// `h('a', {href: '#/x'}, 'text', child)`: an element with attributes
// (`on*` functions become listeners, `null`/`false` ones are left out) and
// children (strings become text nodes; null and arrays are flattened).
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else if (v === true) el.setAttribute(k, '');
    else el.setAttribute(k, String(v));
  }
  append(el, children);
  return el;
}

// Replace `el`'s children, as `h` takes them.
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : String(c));
  }
}

// An SVG element (namespaced, so `h` cannot make it).
export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  append(el, children);
  return el;
}

// A time (ms since the epoch) as local date and time; '—' if absent.
export function when(ms) {
  if (ms === null || ms === undefined || ms === '') return '—';
  const d = new Date(Number(ms));
  return h('time', { datetime: d.toISOString() }, d.toLocaleString());
}

// A duration in ms, readable.
export function duration(ms) {
  if (ms === null || ms === undefined) return '—';
  if (ms < 1000) return `${ms} ms`;
  if (ms < 60_000) return `${(ms / 1000).toFixed(1)} s`;
  return `${Math.floor(ms / 60_000)} min ${Math.round((ms % 60_000) / 1000)} s`;
}

// A JSON value, pretty, in a <pre>.
export function json(value) {
  const text = typeof value === 'string' ? value : JSON.stringify(value, null, 2);
  return h('pre', { class: 'json' }, text);
}

// A status as a badge (the class gives its colour; the text says it).
export function status(s) {
  return h('span', { class: `status status-${String(s).toLowerCase()}` }, s);
}

// A digest, shortened, the whole of it a tooltip and in the text for
// copying.
export function digest(d) {
  if (!d || d === '-') return '—';
  return h('code', { class: 'digest', title: d }, d.length > 16 ? `${d.slice(0, 12)}…` : d);
}

// Definition list from [term, value] pairs.
export function dl(pairs) {
  return h('dl', { class: 'fields' },
    pairs.map(([t, v]) => [h('dt', {}, t), h('dd', {}, v ?? '—')]));
}

// A table with a header row and `rows` (rows, or a <tbody> to fill
// later). `caption` names it for assistive technology.
export function table(caption, head, rows, attrs = {}) {
  return h('table', attrs,
    h('caption', { class: 'sr-only' }, caption),
    h('thead', {}, h('tr', {}, head.map((c) => h('th', { scope: 'col' }, c)))),
    rows instanceof HTMLTableSectionElement ? rows : h('tbody', {}, rows));
}

// The statuses a task never leaves.
export const TERMINAL = ['SUCCEEDED', 'FAILED', 'DEAD_LETTERED', 'CANCELLED', 'EXPIRED'];

// Every status, in lifecycle order. WAITING: the task ran and waits for
// its children (flows), holding no worker slot; it runs again once they
// have all ended.
export const STATUSES = ['QUEUED', 'SCHEDULED', 'RUNNING', 'RETRYING', 'WAITING', ...TERMINAL];

// What a child (flows) may show besides a status: REFUSED (its
// submission was refused; it never ran and has no page) and MISSING (its
// record is gone, expired after its retention). Both count as ended.
export const CHILD_ONLY = ['REFUSED', 'MISSING'];
