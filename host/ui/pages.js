// The pages. Each is `async (ctx) => void`: it fills `ctx.main` and keeps
// it fresh until `ctx.signal` aborts (the operator went to another page).
// `ctx.params` holds the route's parts, `ctx.query` the hash's query,
// `ctx.notice(error)` shows an error plainly, `ctx.go(hash)` navigates.

import { call, get, seg, followEvents } from './api.js';
import { Throughput, WINDOW_S } from './chart.js';
import {
  h, fill, when, duration, json, status, digest, dl, table, TERMINAL, STATUSES, CHILD_ONLY,
} from './dom.js';

// How often lists and waiting tasks are read again (ms).
const REFRESH_MS = 2000;

// Run `fn` now and every REFRESH_MS until `signal` aborts; a failure is
// shown and the next round tries again.
async function every(signal, notice, fn) {
  while (!signal.aborted) {
    try {
      if (await fn() === false) return;
    } catch (e) {
      if (signal.aborted) return;
      notice(e);
    }
    await new Promise((resolve) => {
      const t = setTimeout(resolve, REFRESH_MS);
      signal.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
    });
  }
}

let focusNext = false;

// Move focus to the next page's heading once it is shown (after a
// navigation, not on first load), so a keyboard or screen-reader user
// lands on it.
export function focusNextHeading() {
  focusNext = true;
}

// The page's <h1>; it names the document too.
function heading(text) {
  const el = h('h1', { tabindex: '-1' }, text);
  document.title = `${text} — dtq`;
  if (focusNext) {
    focusNext = false;
    requestAnimationFrame(() => el.focus());
  }
  return el;
}

// A live region for the outcome of an action.
function statusLine(id) {
  return h('p', { id, role: 'status', class: 'muted' });
}

const taskHash = (q, id) => `#/queues/${seg(q)}/tasks/${seg(id)}`;

// A select of every queue the token may read; choosing one goes to its
// `page` (`tasks`, `dlq`).
async function queuePicker(ctx, current, page) {
  const { queues } = await get('v1/queues', ctx.signal);
  const names = queues.map((q) => q.queue);
  if (current && !names.includes(current)) names.unshift(current);
  const select = h('select', {
    id: 'queue-picker',
    onchange: (e) => ctx.go(`#/queues/${seg(e.target.value)}/${page}`),
  }, names.map((n) => h('option', { value: n, selected: n === current }, n)));
  return h('p', { class: 'picker' }, h('label', { for: 'queue-picker' }, 'Queue '), select);
}

// `#/tasks`, `#/dlq`: the first queue's page, or a word when there is none.
export async function firstQueue(ctx, page) {
  const { queues } = await get('v1/queues', ctx.signal);
  if (queues.length) {
    ctx.go(`#/queues/${seg(queues[0].queue)}/${page}`, true);
    return;
  }
  ctx.main.replaceChildren(heading(page === 'dlq' ? 'Dead letters' : 'Tasks'),
    h('p', {}, 'No queue has received a submission yet (or this token may read none).'));
}

// ---- Queues ---------------------------------------------------------------

export async function queuesPage(ctx) {
  const tbody = h('tbody');
  const updated = h('p', { class: 'muted' });
  const chartQueue = h('select', { id: 'chart-queue' });
  const streamState = h('span', { class: 'muted', id: 'stream-state' });
  const chartBox = h('div');
  const events = h('tbody');
  ctx.main.replaceChildren(
    heading('Queues'),
    h('table', { id: 'queues' },
      h('caption', { class: 'sr-only' }, 'Queues and their counts'),
      h('thead', {}, h('tr', {}, ['Queue', 'State', 'Ready', 'Running', 'Delayed', 'Waiting', 'Dead-lettered', '']
        .map((c) => h('th', { scope: 'col' }, c)))),
      tbody),
    updated,
    h('section', { 'aria-labelledby': 'throughput-h' },
      h('h2', { id: 'throughput-h' }, 'Throughput'),
      h('p', { class: 'picker' },
        h('label', { for: 'chart-queue' }, 'Queue '), chartQueue, ' ', streamState),
      chartBox),
    h('section', { 'aria-labelledby': 'events-h' },
      h('h2', { id: 'events-h' }, 'Recent events'),
      h('p', { class: 'muted' }, `The last ${RECENT_EVENTS} lifecycle events of the queue chosen above, newest first.`),
      table('Recent events, newest first', ['At', 'Task id', 'Task', 'Status', 'Attempt'], events, { id: 'events' })),
  );

  // The chart follows one queue's events at a time.
  let follow = null;
  const startChart = (queue) => {
    follow?.abort();
    follow = new AbortController();
    const signal = AbortSignal.any([ctx.signal, follow.signal]);
    const chart = new Throughput();
    chartBox.replaceChildren(chart.figure);
    events.replaceChildren(h('tr', { class: 'none' }, h('td', { colspan: 5 }, 'No event yet.')));
    const timer = setInterval(() => chart.render(), 1000);
    signal.addEventListener('abort', () => clearInterval(timer), { once: true });
    streamState.textContent = 'connecting…';
    followEvents(queue, {
      // Events since the window's start, so the chart opens filled in.
      since: `${Date.now() - WINDOW_S * 1000}-0`,
      signal,
      onEvent: (ev) => {
        chart.add(ev);
        recentEvent(events, queue, ev);
      },
      onState: (state, e) => {
        streamState.textContent = state === 'live' ? 'live' : `reconnecting (${e?.code ?? ''} ${e?.message ?? ''})`;
      },
    });
  };
  chartQueue.addEventListener('change', () => startChart(chartQueue.value));

  await every(ctx.signal, ctx.notice, async () => {
    const { queues } = await get('v1/queues', ctx.signal);
    tbody.replaceChildren(...queues.map((q) => h('tr', { 'data-queue': q.queue },
      h('th', { scope: 'row' }, h('a', { href: `#/queues/${seg(q.queue)}/tasks` }, q.queue)),
      h('td', { 'data-state': q.paused ? 'paused' : 'running' }, q.paused ? 'paused' : 'running'),
      h('td', { 'data-count': 'ready' }, q.ready),
      h('td', { 'data-count': 'running' }, q.running),
      h('td', { 'data-count': 'delayed' }, q.delayed),
      h('td', { 'data-count': 'waiting' }, q.waiting ?? 0),
      h('td', { 'data-count': 'dead_lettered' },
        h('a', { href: `#/queues/${seg(q.queue)}/dlq` }, q.dead_lettered)),
      h('td', {}, h('a', { href: `#/queues/${seg(q.queue)}/tasks` }, 'tasks'))),
    ));
    if (!queues.length) {
      tbody.replaceChildren(h('tr', {}, h('td', { colspan: 8 },
        'No queue has received a submission yet (or this token may read none).')));
    }
    updated.textContent = `Updated ${new Date().toLocaleTimeString()}`;
    const names = queues.map((q) => q.queue);
    const known = [...chartQueue.options].map((o) => o.value);
    if (names.join('\n') !== known.join('\n')) {
      const keep = chartQueue.value;
      chartQueue.replaceChildren(...names.map((n) => h('option', { value: n, selected: n === keep }, n)));
    }
    if (!follow && names.length) startChart(chartQueue.value);
  });
}

// How many events the queues page lists.
const RECENT_EVENTS = 20;

// Add a lifecycle event (`event:` the task's new status, `data:` `{task_id,
// task, status, attempt, at}`) at the top of the recent events, which keep
// the last RECENT_EVENTS. A `gap` (events missed) is left to the chart's
// count; it names no task.
function recentEvent(tbody, queue, ev) {
  let d;
  try { d = JSON.parse(ev.data); } catch { return; }
  if (!d?.task_id) return;
  tbody.querySelector('tr.none')?.remove();
  const st = d.status ?? ev.event;
  tbody.prepend(h('tr', { 'data-task-id': d.task_id, 'data-status': st },
    h('td', {}, when(d.at)),
    h('td', {}, h('a', { href: taskHash(queue, d.task_id) }, h('code', {}, d.task_id))),
    h('td', {}, d.task ?? '—'),
    h('td', {}, status(st)),
    h('td', {}, d.attempt ?? '—')));
  while (tbody.rows.length > RECENT_EVENTS) tbody.lastElementChild.remove();
}

// ---- Tasks ----------------------------------------------------------------

export async function tasksPage(ctx) {
  const queue = ctx.params[0];
  const st = ctx.query.get('status') ?? '';
  const cursor = ctx.query.get('cursor');
  const pageHash = (params) => {
    const q = new URLSearchParams(params).toString();
    return `#/queues/${seg(queue)}/tasks${q ? `?${q}` : ''}`;
  };
  const statusSelect = h('select', {
    id: 'status-filter',
    onchange: (e) => ctx.go(pageHash(e.target.value ? { status: e.target.value } : {})),
  },
  h('option', { value: '' }, 'all'),
  STATUSES.map((s) => h('option', { value: s, selected: s === st }, s)));

  const search = h('input', { id: 'search', type: 'search', required: true, spellcheck: 'false' });
  const found = statusLine('search-status');
  const searchForm = h('form', {
    role: 'search',
    class: 'search',
    onsubmit: (e) => { e.preventDefault(); find(ctx, queue, search.value.trim(), found); },
  },
  h('label', { for: 'search' }, 'Find a task by id or idempotency key '),
  search, ' ', h('button', { type: 'submit' }, 'Find'));

  const tbody = h('tbody');
  const pager = h('nav', { 'aria-label': 'Pages of tasks', class: 'pager' });
  const pause = pauseControl(ctx, queue);
  ctx.main.replaceChildren(
    heading(`Tasks of ${queue}`),
    await queuePicker(ctx, queue, 'tasks'),
    pause.element,
    searchForm, found,
    h('p', { class: 'picker' }, h('label', { for: 'status-filter' }, 'Status '), statusSelect),
    table(`Tasks of ${queue}, newest first`,
      ['Task id', 'Task', 'Status', 'Attempts', 'Created', 'Updated'], tbody, { id: 'tasks' }),
    pager,
  );

  await every(ctx.signal, ctx.notice, async () => {
    await pause.refresh();
    const q = new URLSearchParams({ limit: '50' });
    if (st) q.set('status', st);
    if (cursor) q.set('cursor', cursor);
    const page = await get(`v1/queues/${seg(queue)}/tasks?${q}`, ctx.signal);
    tbody.replaceChildren(...page.tasks.map((t) => h('tr', { 'data-task-id': t.task_id },
      h('td', {}, h('a', { href: taskHash(queue, t.task_id), 'data-task-id': t.task_id },
        h('code', {}, t.task_id))),
      h('td', {}, t.task),
      h('td', {}, status(t.status), t.held_by ? ` (held: ${t.held_by === 'rate' ? 'rate limit' : 'group busy'})` : null),
      h('td', {}, `${t.attempts}/${t.max_attempts}`),
      h('td', {}, when(t.created_at)),
      h('td', {}, when(t.updated_at)))));
    if (!page.tasks.length) {
      tbody.replaceChildren(h('tr', {}, h('td', { colspan: 6 }, page.next_cursor
        ? 'None of this status among the tasks read for this page; older ones follow.'
        : 'No task.')));
    }
    const base = st ? { status: st } : {};
    fill(pager,
      cursor ? h('a', { href: pageHash(base) }, 'Newest') : null, ' ',
      page.next_cursor ? h('a', { href: pageHash({ ...base, cursor: page.next_cursor }), rel: 'next' }, 'Older →') : null,
    );
    // A later page does not change as tasks are added: read it once.
    return !cursor;
  });
}

// Whether `queue` is paused, and the button that pauses or resumes it
// (admin on the queue). A paused queue takes submissions; no worker starts
// its tasks until it is resumed.
function pauseControl(ctx, queue) {
  const state = h('span', { id: 'queue-state' });
  const button = h('button', { type: 'button', id: 'pause-toggle' });
  let paused = false;
  const show = () => {
    state.textContent = paused ? 'Paused: no worker starts its tasks.' : 'Running.';
    button.textContent = paused ? 'Resume' : 'Pause';
  };
  button.addEventListener('click', async () => {
    try {
      const r = await call('POST', `v1/queues/${seg(queue)}/${paused ? 'resume' : 'pause'}`);
      paused = r.paused;
      show();
      ctx.notice(null);
    } catch (e) { ctx.notice(e); }
  });
  return {
    element: h('p', { class: 'picker' }, state, ' ', button),
    refresh: async () => {
      paused = (await get(`v1/queues/${seg(queue)}`, ctx.signal)).paused;
      show();
    },
  };
}

// The search box: a task id, else an idempotency key.
async function find(ctx, queue, text, out) {
  if (!text) return;
  out.textContent = 'Searching…';
  try {
    await get(`v1/queues/${seg(queue)}/tasks/${seg(text)}`, ctx.signal);
    ctx.go(taskHash(queue, text));
    return;
  } catch (e) {
    if (e.code !== 'TASK_NOT_FOUND') { out.textContent = ''; ctx.notice(e); return; }
  }
  try {
    const rec = await get(`v1/queues/${seg(queue)}/idempotency/${seg(text)}`, ctx.signal);
    ctx.go(taskHash(queue, rec.task_id));
  } catch (e) {
    if (e.code === 'UNKNOWN_KEY' || e.code === 'INVALID_IDEMPOTENCY_KEY') {
      out.textContent = `No task with id or idempotency key “${text}” in ${queue}.`;
    } else {
      out.textContent = '';
      ctx.notice(e);
    }
  }
}

// ---- One task -------------------------------------------------------------

// A task's page. Its fields and sections are drawn again on each refresh;
// its children (flows) are a tree kept across refreshes and updated in
// place, so what the operator expanded, and the focus, stay put.
export async function taskPage(ctx) {
  const [queue, id] = ctx.params;
  const head = h('div');
  const rest = h('div');
  const actions = statusLine('task-action');
  const tree = childList(ctx);
  const children = h('section', { 'aria-labelledby': 'children-h', hidden: true },
    h('h2', { id: 'children-h' }, 'Children'), h('div', { id: 'children' }, tree.element));
  ctx.main.replaceChildren(
    h('p', {}, h('a', { href: `#/queues/${seg(queue)}/tasks` }, `← Tasks of ${queue}`)),
    heading(`Task ${id}`), actions, head, children, rest);

  await every(ctx.signal, ctx.notice, async () => {
    const t = await get(`v1/queues/${seg(queue)}/tasks/${seg(id)}`, ctx.signal);
    const kids = t.children ?? [];
    fill(head, taskHead(ctx, t, actions));
    fill(rest, taskBody(t));
    children.hidden = !kids.length;
    await tree.update(kids);
    // A task that ended, and whose children ended, changes no more.
    return !TERMINAL.includes(t.status) || kids.some((c) => !ended(c.status));
  });
}

function taskHead(ctx, t, actions) {
  const cancellable = !TERMINAL.includes(t.status);
  const kids = t.children ?? [];
  const cancel = async () => {
    try {
      const r = await call('POST', `v1/queues/${seg(t.queue)}/tasks/${seg(t.task_id)}/cancel`);
      const took = r.cancelled_children ?? [];
      fill(actions,
        r.cancel_requested
          ? 'Cancel requested: the running attempt is being interrupted.'
          : `Task is ${r.status}.`,
        took.length || kids.length
          ? [' ', h('span', { id: 'cancelled-children', title: took.join(', ') || null },
            `${plural(took.length, 'child task')} (its children and theirs) cancelled with it.`)]
          : null);
    } catch (e) { ctx.notice(e); }
  };
  const waiting = t.status === 'WAITING' && kids.length
    ? ` (waiting for its children: ${kids.filter((c) => !ended(c.status)).length} of ${kids.length} not ended)`
    : null;
  return [
    cancellable ? h('p', {}, h('button', { type: 'button', id: 'cancel', onclick: cancel }, 'Cancel task')) : null,
    dl([
      ['Status', h('span', { id: 'task-status' }, status(t.status), waiting,
        t.cancel_requested ? ' (cancel requested)' : null,
        t.held ? h('span', { id: 'task-held' },
          ` (held by ${t.held.by === 'rate' ? "the queue's rate limit" : 'its group'} until `,
          when(t.held.until), ')') : null)],
      t.parent ? ['Parent', h('span', { id: 'task-parent' },
        h('a', { href: taskHash(t.parent.queue, t.parent.task_id), id: 'parent-link' },
          h('code', {}, t.parent.task_id)),
        h('span', { class: 'muted' }, ` in ${t.parent.queue}`))] : null,
      ['Queue', t.queue],
      ['Group', t.group ?? '—'],
      ['Task', t.task],
      ['Attempts', `${t.attempts} of ${t.max_attempts}`],
      ['Progress', progress(t.progress)],
      ['Idempotency key', t.idempotency_key ? h('code', {}, t.idempotency_key) : '—'],
      ['Handler digest', digest(t.handler_digest)],
      ['Timeout', duration(t.timeout_ms)],
      ['Created', when(t.created_at)],
      ['Run at', when(t.run_at)],
      ['Started', when(t.started_at)],
      ['Finished', when(t.finished_at)],
      ['Updated', when(t.updated_at)],
      ['Expires', when(t.expires_at)],
    ].filter(Boolean)),
  ];
}

function taskBody(t) {
  return [
    section('payload', 'Payload', json(t.payload)),
    section('result', 'Result', t.result === null || t.result === undefined ? h('p', {}, '—') : json(t.result)),
    t.error ? section('error', 'Error', h('pre', { class: 'error' }, t.error)) : null,
    section('attempts', 'Attempts', attempts(t)),
    section('log', 'Log', t.log ? h('pre', { class: 'log' }, t.log) : h('p', {}, 'Nothing logged.')),
  ];
}

// `n thing` or `n things`.
function plural(n, thing) {
  return `${n} ${n === 1 ? thing : `${thing}s`}`;
}

// Whether a child changes no more: its status is terminal, or it was
// refused, or its record is gone.
const ended = (s) => TERMINAL.includes(s) || CHILD_ONLY.includes(s);

// "10 children: 8 SUCCEEDED, 2 RUNNING", statuses in lifecycle order.
function childCounts(children) {
  const counts = new Map();
  for (const c of children) counts.set(c.status, (counts.get(c.status) ?? 0) + 1);
  const order = [...STATUSES, ...CHILD_ONLY];
  const rank = (s) => (order.includes(s) ? order.indexOf(s) : order.length);
  const parts = [...counts].sort(([a], [b]) => rank(a) - rank(b)).map(([s, n]) => `${n} ${s}`);
  const total = `${children.length} ${children.length === 1 ? 'child' : 'children'}`;
  return parts.length ? `${total}: ${parts.join(', ')}` : 'No child task.';
}

// The children of a task (flows), as a list that `update(children)`
// brings up to date in place: children only ever join at the end (they
// come in submission order), so the rows already shown are kept, with
// whatever was expanded under them. Each row links to the child's page
// and can be expanded to list the child's own children, read when it is
// expanded and again on each refresh while it stays expanded.
function childList(ctx) {
  const summary = h('p', { class: 'children-summary' });
  const list = h('ul', { class: 'tree' });
  const rows = [];
  return {
    element: h('div', { class: 'children' }, summary, list),
    async update(children) {
      summary.textContent = childCounts(children);
      if (rows.length > children.length || rows.some((r, i) => r.key !== childKey(children[i]))) {
        rows.length = 0;
        list.replaceChildren();
      }
      children.forEach((c, i) => {
        if (!rows[i]) {
          rows[i] = childRow(ctx, c);
          list.append(rows[i].element);
        }
        rows[i].set(c);
      });
      await Promise.all(rows.map((r) => r.refresh()));
    },
  };
}

const childKey = (c) => `${c.queue}/${c.task_id}`;

let subtrees = 0;

// One child: a button that expands its own children (not for a refused
// child or one whose record is gone: they have none to read), its id (a
// link to its page, but for those two), task name, queue, status, and its
// error if any.
function childRow(ctx, first) {
  const readable = !CHILD_ONLY.includes(first.status);
  subtrees += 1;
  const sub = h('div', { class: 'subtree', id: `subtree-${subtrees}`, hidden: true });
  const info = h('span', { class: 'child-info' });
  const error = h('div');
  let child = first;
  let expanded = false;
  let list = null;
  const load = async () => {
    try {
      const t = await get(`v1/queues/${seg(child.queue)}/tasks/${seg(child.task_id)}`, ctx.signal);
      if (!list) {
        list = childList(ctx);
        fill(sub, list.element);
      }
      await list.update(t.children ?? []);
    } catch (e) {
      if (ctx.signal.aborted) return;
      list = null;
      fill(sub, h('p', { class: 'muted' },
        `Cannot read the children of ${child.task_id}: ${e.code ?? 'ERROR'}: ${e.message}`));
    }
  };
  const toggle = readable
    ? h('button', {
      type: 'button',
      class: 'expand',
      'aria-expanded': 'false',
      'aria-controls': sub.id,
      'aria-label': `Children of ${first.task_id}`,
      onclick: async () => {
        expanded = !expanded;
        toggle.setAttribute('aria-expanded', String(expanded));
        toggle.textContent = expanded ? '▾' : '▸';
        sub.hidden = !expanded;
        if (expanded) {
          if (!list) fill(sub, h('p', { class: 'muted' }, 'Loading…'));
          await load();
        }
      },
    }, '▸')
    : h('span', { class: 'expand-none' });
  const id = readable
    ? h('a', { href: taskHash(first.queue, first.task_id), class: 'child-link' }, h('code', {}, first.task_id))
    : h('code', { class: 'child-id', title: first.status === 'REFUSED' ? 'refused: no task was made' : 'its record is gone' }, first.task_id);
  const element = h('li', { class: 'child', 'data-task-id': first.task_id, 'data-queue': first.queue },
    h('div', { class: 'node' }, toggle, id, info), error, sub);
  return {
    key: childKey(first),
    element,
    set(c) {
      child = c;
      element.dataset.status = c.status;
      fill(info,
        h('span', { class: 'child-task' }, c.task || '—'),
        h('span', { class: 'muted' }, `in ${c.queue}`),
        status(c.status));
      fill(error, c.error ? h('pre', { class: 'error' }, c.error) : null);
    },
    refresh: () => (expanded ? load() : Promise.resolve()),
  };
}

// The last attempt's progress, as its handler last reported it: a bar,
// the percentage and the handler's message; '—' before any report.
function progress(p) {
  if (!p) return h('span', { id: 'task-progress' }, '—');
  const pct = Math.round(Number(p.fraction) * 100);
  return h('span', { id: 'task-progress' },
    h('progress', { max: 100, value: pct, 'aria-label': `${pct}% done` }),
    ` ${pct}%`, p.message ? ` — ${p.message}` : null,
    p.updated_at ? h('span', { class: 'muted' }, ' (', when(p.updated_at), ')') : null);
}

function section(id, title, content) {
  return h('section', { 'aria-labelledby': `${id}-h` }, h('h2', { id: `${id}-h` }, title),
    h('div', { id }, content));
}

// The attempts: `attempt_history` when the API gives it, else the digest
// each attempt ran (`attempt_digests`; the error and log above are the
// last attempt's).
function attempts(t) {
  if (Array.isArray(t.attempt_history) && t.attempt_history.length) {
    return table('Attempts', ['#', 'Outcome', 'Started', 'Duration', 'Code', 'Error', 'Log'],
      t.attempt_history.map((a) => h('tr', {},
        h('td', {}, a.attempt),
        h('td', {}, a.outcome ? status(a.outcome) : '—'),
        h('td', {}, when(a.started_at)),
        h('td', {}, duration(a.duration_ms ?? (a.finished_at && a.started_at ? a.finished_at - a.started_at : null))),
        h('td', {}, digest(a.digest)),
        h('td', {}, a.error ? h('pre', { class: 'error' }, a.error) : '—'),
        h('td', {}, a.log ? h('details', {}, h('summary', {}, 'log'), h('pre', { class: 'log' }, a.log)) : '—'))),
    { id: 'attempt-history' });
  }
  const digests = t.attempt_digests ?? [];
  if (!digests.length) return h('p', {}, 'No attempt has run yet.');
  return table('Code each attempt ran', ['#', 'Code'],
    digests.map((d, i) => h('tr', {}, h('td', {}, i + 1), h('td', {}, digest(d)))));
}

// ---- Dead letters ---------------------------------------------------------

export async function dlqPage(ctx) {
  const queue = ctx.params[0];
  const base = `v1/queues/${seg(queue)}/dlq`;
  const tbody = h('tbody');
  const done = statusLine('dlq-status');
  const selected = () => [...tbody.querySelectorAll('input[type=checkbox]:checked')]
    .map((c) => c.value);
  const all = h('input', {
    type: 'checkbox',
    id: 'select-all',
    onchange: (e) => tbody.querySelectorAll('input[type=checkbox]')
      .forEach((c) => { c.checked = e.target.checked; }),
  });
  const act = async (label, fn) => {
    done.textContent = `${label}…`;
    try {
      done.textContent = await fn();
      ctx.notice(null);
    } catch (e) {
      done.textContent = '';
      ctx.notice(e);
    }
    await refresh();
  };
  const bulkRequeue = (body) => act('Requeueing', async () => {
    const r = await call('POST', `${base}/requeue`, body);
    const skipped = r.not_dead_lettered?.length ? `; not dead-lettered: ${r.not_dead_lettered.join(', ')}` : '';
    return `Requeued ${r.requeued}${skipped}.`;
  });
  const purge = (body, what) => {
    if (!window.confirm(`Purge ${what} from ${queue}? This cannot be undone.`)) return;
    act('Purging', async () => `Purged ${(await call('DELETE', base, body)).purged}.`);
  };
  const needSelection = (fn) => () => {
    const ids = selected();
    if (!ids.length) { done.textContent = 'Select tasks first.'; return; }
    fn(ids);
  };

  ctx.main.replaceChildren(
    heading(`Dead letters of ${queue}`),
    await queuePicker(ctx, queue, 'dlq'),
    h('p', { class: 'muted' }, 'Requeue and purge need a token with the admin scope.'),
    h('div', { class: 'toolbar', role: 'group', 'aria-label': 'Actions on dead letters' },
      h('button', { type: 'button', id: 'requeue-selected', onclick: needSelection((ids) => bulkRequeue({ ids })) }, 'Requeue selected'),
      h('button', { type: 'button', id: 'requeue-all', onclick: () => bulkRequeue({ all: true }) }, 'Requeue all'),
      h('button', { type: 'button', id: 'purge-selected', class: 'danger', onclick: needSelection((ids) => purge({ ids }, `${ids.length} task(s)`)) }, 'Purge selected'),
      h('button', { type: 'button', id: 'purge-all', class: 'danger', onclick: () => purge({ all: true }, 'every dead-lettered task') }, 'Purge all')),
    done,
    h('table', { id: 'dlq' },
      h('caption', { class: 'sr-only' }, `Dead-lettered tasks of ${queue}, oldest first`),
      h('thead', {}, h('tr', {},
        h('th', { scope: 'col' }, h('label', { class: 'sr-only', for: 'select-all' }, 'Select all'), all),
        ['Task id', 'Task', 'Attempts', 'Error', 'Dead-lettered', ''].map((c) => h('th', { scope: 'col' }, c)))),
      tbody),
  );

  const row = (t) => {
    const box = `pick-${t.task_id}`;
    return h('tr', { 'data-task-id': t.task_id },
      h('td', {}, h('input', { type: 'checkbox', id: box, value: t.task_id }),
        h('label', { class: 'sr-only', for: box }, `Select ${t.task_id}`)),
      h('td', {}, h('a', { href: taskHash(queue, t.task_id) }, h('code', {}, t.task_id))),
      h('td', {}, t.task),
      h('td', {}, `${t.attempts}/${t.max_attempts}`),
      h('td', { class: 'clip', title: t.error }, t.error ?? '—'),
      h('td', {}, when(t.finished_at ?? t.updated_at)),
      h('td', {}, h('button', {
        type: 'button',
        class: 'requeue',
        'aria-label': `Requeue ${t.task_id}`,
        onclick: () => act('Requeueing', async () => {
          await call('POST', `${base}/${seg(t.task_id)}/requeue`);
          return `Requeued ${t.task_id}.`;
        }),
      }, 'Requeue')));
  };
  const refresh = async () => {
    try {
      const { tasks } = await get(`${base}?limit=200`, ctx.signal);
      const keep = new Set(selected());
      tbody.replaceChildren(...tasks.map(row));
      tbody.querySelectorAll('input[type=checkbox]').forEach((c) => { c.checked = keep.has(c.value); });
      if (!tasks.length) tbody.replaceChildren(h('tr', {}, h('td', { colspan: 7 }, 'No dead-lettered task.')));
    } catch (e) {
      if (!ctx.signal.aborted) ctx.notice(e);
    }
  };
  await refresh();
}

// ---- Handlers -------------------------------------------------------------

export async function handlersPage(ctx) {
  const handlers = h('tbody');
  const workers = h('tbody');
  ctx.main.replaceChildren(
    heading('Handlers'),
    h('h2', {}, 'Deployed'),
    table('Deployed handlers', ['Task', 'Code', 'Size', 'Deployed', 'Settings', 'Workers running it'], handlers, { id: 'handlers' }),
    h('h2', {}, 'Live workers'),
    table('Live workers', ['Worker', 'Queues', 'Handlers loaded', 'Failed to load'], workers, { id: 'workers' }),
  );
  await every(ctx.signal, ctx.notice, async () => {
    const r = await get('v1/handlers', ctx.signal);
    handlers.replaceChildren(...r.handlers.map((d) => h('tr', {},
      h('th', { scope: 'row' }, d.task),
      h('td', {}, digest(d.digest)),
      h('td', {}, d.size === undefined ? '—' : `${(d.size / 1024).toFixed(0)} KiB`),
      h('td', {}, when(d.deployed_at)),
      h('td', {}, settings(d.settings)),
      h('td', {}, `${d.workers?.running ?? 0} of ${d.workers?.total ?? 0}`))));
    if (!r.handlers.length) {
      handlers.replaceChildren(h('tr', {}, h('td', { colspan: 6 },
        'Nothing deployed through the API (workers may run handlers from their own directory; see below).')));
    }
    workers.replaceChildren(...r.workers.map((w) => h('tr', {},
      h('th', { scope: 'row' }, h('code', {}, w.id)),
      h('td', {}, w.queues.join(', ')),
      h('td', {}, h('ul', { class: 'plain' }, Object.entries(w.loaded ?? {})
        .map(([task, d]) => h('li', {}, `${task} `, digest(d))))),
      h('td', {}, h('ul', { class: 'plain' }, Object.entries(w.failed ?? {})
        .map(([task, why]) => h('li', {}, `${task}: ${why}`)))))));
    if (!r.workers.length) workers.replaceChildren(h('tr', {}, h('td', { colspan: 4 }, 'No live worker.')));
  });
}

function settings(s) {
  if (!s) return '—';
  const parts = Object.entries(s).filter(([, v]) => v !== null && v !== undefined
    && !(Array.isArray(v) && !v.length));
  if (!parts.length) return 'defaults';
  return h('ul', { class: 'plain' }, parts.map(([k, v]) =>
    h('li', {}, `${k}: ${Array.isArray(v) ? v.join(', ') : v}`)));
}
