"""``namespaced`` (Python): the twin of ``tests/guests/namespaced``, which
asks for the namespace ``shared-ns``.

Payload → result: ``{"key": K, "value": V}`` → ``{"ok": true}``, after
setting kv key K to V, which the host stores at ``dtq:guest:{shared-ns}:K``
when the operator grants the task that namespace; without the grant the
host refuses to load the component.
"""

from dtq_guest import kv, task


@task("namespaced", namespace="shared-ns")
def set_key(payload, ctx):
    kv.set(payload["key"], payload["value"])
    return {"ok": True}
