// Outbound HTTP through `fetch`, which the engine runs over
// `wasi:http/outgoing-handler`. The operator decides which hosts a handler
// may call (`allow_hosts`, or `dtq serve --allow-host TASK=PATTERN`); inside
// an idempotent operation the host adds an `Idempotency-Key` header unless
// the request sets one. A request that fails (denied, refused, timed out)
// is a `RetryableError`; a response is not an error whatever its status:
// `errorForStatus()` makes one of a non-2xx status.

import { RetryableError } from './errors.js';

/** A response, read whole. */
export class Response {
  constructor(status, headers, body) {
    /** The status code. */
    this.status = status;
    /** The headers, `[name, value]` pairs, names in lowercase. */
    this.headers = headers;
    /** The body text. */
    this.body = body;
  }

  /** Whether the status is 2xx. */
  get isSuccess() {
    return this.status >= 200 && this.status < 300;
  }

  /** The first value of header `name` (any case), or `null`. */
  header(name) {
    const found = this.headers.find(([n]) => n.toLowerCase() === name.toLowerCase());
    return found ? found[1] : null;
  }

  /** The body parsed as JSON; a body that does not parse is retryable. */
  json() {
    try {
      return JSON.parse(this.body);
    } catch (e) {
      throw new RetryableError(
        `the response body (HTTP ${this.status}) is not the JSON expected: ${e.message}`,
      );
    }
  }

  /** This response if its status is 2xx, else a `RetryableError`. */
  errorForStatus() {
    if (this.isSuccess) return this;
    throw new RetryableError(`the server answered HTTP ${this.status}`);
  }
}

/** Send a request (`fetch` options) and read the whole response. */
export async function request(url, init = {}) {
  const method = init.method ?? 'GET';
  let reply;
  try {
    reply = await fetch(url, init);
  } catch (e) {
    const origin = originOf(url);
    const why = String(e?.message ?? e);
    throw new RetryableError(
      /denied|HTTP-request-denied/i.test(why)
        ? `request to ${origin} denied: the host is not in this handler's allow-list ` +
            `(deploy setting allow_hosts, or dtq serve --allow-host TASK=PATTERN)`
        : `${method} ${url} failed: ${why}`,
    );
  }
  const body = await reply.text();
  return new Response(reply.status, [...reply.headers.entries()], body);
}

/** Send `GET url`. */
export function get(url) {
  return request(url);
}

/** Send `POST url` with `body` as JSON (`Content-Type: application/json`). */
export function postJson(url, body) {
  return request(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
}

function originOf(url) {
  const m = /^(\w+):\/\/([^/?#]+)/.exec(url);
  if (!m) return url;
  const [, scheme, authority] = m;
  const port = /:\d+$/.test(authority) ? '' : scheme === 'https' ? ':443' : ':80';
  return `${scheme.toLowerCase()}://${authority.toLowerCase()}${port}`;
}
