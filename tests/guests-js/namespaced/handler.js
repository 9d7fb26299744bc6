// `namespaced` (JavaScript): the twin of `tests/guests/namespaced`, which
// asks for the namespace `shared-ns`.
//
// Payload → result: `{"key": K, "value": V}` → `{"ok": true}`, after setting
// kv key K to V, which the host stores at `dtq:guest:{shared-ns}:K` when the
// operator grants the task that namespace; without the grant the host
// refuses to load the component.

import { kv, task } from 'dtq';

task('namespaced', { namespace: 'shared-ns' }, (payload) => {
  kv.set(payload.key, payload.value);
  return { ok: true };
});
