// The dashboard's only way to the data: the JSON API, with the token the
// operator typed in.
//
// The token lives in sessionStorage: it survives a reload and navigation
// within the tab, and is gone when the tab closes. It is sent as
// `Authorization: Bearer` on every call. Without one, calls go out without
// the header, which an API without tokens (development mode) accepts for
// everything but the admin routes.

const TOKEN_KEY = 'dtq.token';

// The API's root, relative to this page (`/ui/` → `/`), so a proxy that
// mounts the API under a prefix keeps working.
const ROOT = new URL('../', document.baseURI);

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) ?? '';
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

// An error answer of the API (`{"error": {"code", "message", "details"}}`),
// or a network failure (code `NETWORK`).
export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details ?? {};
  }
}

function headers(extra = {}) {
  const h = { Accept: 'application/json', ...extra };
  const t = token();
  if (t) h.Authorization = `Bearer ${t}`;
  return h;
}

// A path segment: ids and keys may hold any character.
export const seg = encodeURIComponent;

async function errorOf(resp) {
  const text = await resp.text();
  let body = null;
  try { body = JSON.parse(text); } catch { /* not JSON: shown as text */ }
  const e = body?.error;
  return new ApiError(
    resp.status,
    e?.code ?? `HTTP_${resp.status}`,
    e?.message ?? (text.slice(0, 300) || resp.statusText),
    e?.details,
  );
}

// Call the API: `path` is relative to its root (`v1/queues`). Resolves to
// the JSON body; rejects with an ApiError.
export async function call(method, path, body, signal) {
  const init = { method, headers: headers(), cache: 'no-store', signal };
  if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(new URL(path, ROOT), init);
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new ApiError(0, 'NETWORK', `cannot reach the API: ${e.message}`);
  }
  if (!resp.ok) throw await errorOf(resp);
  return resp.status === 204 ? null : resp.json();
}

export const get = (path, signal) => call('GET', path, undefined, signal);

const sleep = (ms, signal) => new Promise((resolve) => {
  const t = setTimeout(resolve, ms);
  signal.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
});

// Follow a queue's lifecycle events (Server-Sent Events) until `signal`
// aborts. EventSource cannot send an Authorization header, so the stream
// is read with fetch and parsed here. `since` (an event id) starts after
// it; reconnects resume after the last event seen (`Last-Event-ID`), with
// backoff. `onEvent({id, event, data})` gets each event, `onState(state,
// error)` 'live' or 'retrying'.
export async function followEvents(queue, { since, onEvent, onState, signal }) {
  let last = null;
  let backoff = 500;
  while (!signal.aborted) {
    try {
      const h = headers({ Accept: 'text/event-stream' });
      let path = `v1/queues/${seg(queue)}/events`;
      if (last) h['Last-Event-ID'] = last;
      else if (since) path += `?since=${seg(since)}`;
      const resp = await fetch(new URL(path, ROOT), { headers: h, cache: 'no-store', signal });
      if (!resp.ok) throw await errorOf(resp);
      onState('live');
      backoff = 500;
      for await (const ev of parseSse(resp.body, signal)) {
        if (ev.id) last = ev.id;
        onEvent(ev);
      }
      onState('retrying', new ApiError(0, 'NETWORK', 'the event stream ended'));
    } catch (e) {
      if (signal.aborted) return;
      onState('retrying', e);
    }
    await sleep(backoff, signal);
    backoff = Math.min(backoff * 2, 10_000);
  }
}

// The events of an SSE body (the format of the HTML standard, "Server-sent
// events"): fields up to a blank line; comments (`:`) skipped.
async function* parseSse(body, signal) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  signal.addEventListener('abort', () => reader.cancel().catch(() => {}), { once: true });
  let buffer = '';
  let ev = { id: '', event: 'message', data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let nl;
    while ((nl = buffer.indexOf('\n')) >= 0) {
      const line = buffer.slice(0, nl).replace(/\r$/, '');
      buffer = buffer.slice(nl + 1);
      if (line === '') {
        if (ev.data.length) yield { id: ev.id, event: ev.event, data: ev.data.join('\n') };
        ev = { id: '', event: 'message', data: [] };
        continue;
      }
      if (line.startsWith(':')) continue;
      const colon = line.indexOf(':');
      const field = colon < 0 ? line : line.slice(0, colon);
      const val = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
      if (field === 'data') ev.data.push(val);
      else if (field === 'event') ev.event = val;
      else if (field === 'id') ev.id = val;
    }
  }
}
