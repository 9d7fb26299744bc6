"""Schemathesis hooks for dtq's OpenAPI document (loaded through
SCHEMATHESIS_HOOKS by tests/tests/openapi_tools.rs).

The deploy route's body is a WebAssembly component, `application/wasm`,
which schemathesis has no serializer for: the bytes it generates for the
body's binary schema are sent as they are, as for
`application/octet-stream`.
"""

import schemathesis


@schemathesis.serializer("application/wasm")
def wasm(ctx, value):
    if isinstance(value, str):
        value = value.encode("utf-8")
    elif not isinstance(value, (bytes, bytearray)):
        value = bytes(str(value), "utf-8")
    return {"data": bytes(value)}
