// The dashboard's shell: the token form, the error notice and a small
// hash router (`#/queues`, `#/queues/{q}/tasks`, `#/queues/{q}/tasks/{id}`,
// `#/queues/{q}/dlq`, `#/handlers`). Each page gets an AbortSignal that
// aborts when the operator leaves it, which stops its refreshes and
// closes its event stream.

import { token, setToken } from './api.js';
import {
  queuesPage, tasksPage, taskPage, dlqPage, handlersPage, firstQueue, focusNextHeading,
} from './pages.js';

const ROUTES = [
  [/^\/queues$/, 'queues', queuesPage],
  [/^\/tasks$/, 'tasks', (ctx) => firstQueue(ctx, 'tasks')],
  [/^\/dlq$/, 'dlq', (ctx) => firstQueue(ctx, 'dlq')],
  [/^\/queues\/([^/]+)\/tasks$/, 'tasks', tasksPage],
  [/^\/queues\/([^/]+)\/tasks\/([^/]+)$/, 'tasks', taskPage],
  [/^\/queues\/([^/]+)\/dlq$/, 'dlq', dlqPage],
  [/^\/handlers$/, 'handlers', handlersPage],
];

const main = document.getElementById('main');
const noticeBox = document.getElementById('notice');

// Show an API error (its code and message, as the API gave them) or clear
// the notice (null).
function notice(e) {
  if (!e) {
    noticeBox.hidden = true;
    noticeBox.replaceChildren();
    return;
  }
  if (e.name === 'AbortError') return;
  const code = e.code ?? 'ERROR';
  const where = e.status ? ` (HTTP ${e.status})` : '';
  const strong = document.createElement('strong');
  strong.textContent = code;
  noticeBox.replaceChildren(strong, `${where}: ${e.message}`);
  if (code === 'UNAUTHORIZED' || code === 'FORBIDDEN') {
    noticeBox.append(' — enter a token with the needed scope above.');
  }
  noticeBox.hidden = false;
}

function go(hash, replace = false) {
  if (replace) {
    history.replaceState(null, '', hash);
    route();
  } else {
    location.hash = hash;
  }
}

let current = null;

function route() {
  current?.abort();
  current = new AbortController();
  notice(null);
  const raw = location.hash.replace(/^#/, '') || '/queues';
  const [path, search] = raw.split('?', 2);
  const found = ROUTES.find(([re]) => re.test(path));
  for (const a of document.querySelectorAll('[data-nav]')) {
    if (found && a.dataset.nav === found[1]) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  if (!found) {
    main.replaceChildren(Object.assign(document.createElement('h1'), { textContent: 'No such page' }));
    return;
  }
  const [re, , page] = found;
  const params = re.exec(path).slice(1).map(decodeURIComponent);
  const ctx = {
    main, params, query: new URLSearchParams(search ?? ''), signal: current.signal, notice, go,
  };
  // A page's promise ends only when it stops refreshing.
  page(ctx).catch((e) => { if (!ctx.signal.aborted) notice(e); });
}

function tokenForm() {
  const form = document.getElementById('token-form');
  const input = document.getElementById('token');
  const state = document.getElementById('token-state');
  const show = () => {
    state.textContent = token() ? 'token set for this tab' : 'no token (open API only)';
  };
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    setToken(input.value.trim());
    input.value = '';
    show();
    route();
  });
  document.getElementById('token-forget').addEventListener('click', () => {
    setToken('');
    input.value = '';
    show();
    route();
  });
  show();
}

tokenForm();
window.addEventListener('hashchange', () => { focusNextHeading(); route(); });
route();
