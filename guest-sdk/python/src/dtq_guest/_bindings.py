"""The WIT bindings.

componentize-py generates the package ``wit_world`` from the repository's
``wit/`` when it builds a handler; it exists only inside the component.

Every bindings module the SDK uses is imported here, when the SDK is
imported: componentize-py snapshots the interpreter after the handler's
module (and so this one) has been imported, and a dtq sandbox has no
filesystem to import anything from later. Outside a component (an ordinary
Python importing the SDK, to test its pure parts) the imports fail quietly,
and calling a host import raises :class:`RuntimeError`.
"""

import importlib

#: The bindings modules of the dtq world and of wasi:http the SDK calls.
MODULES = (
    "dtq_handler_types",
    "idempotency",
    "kv",
    "log",
    "progress",
    "tasks",
    "wasi_http_types",
    "outgoing_handler",
    "streams",
    "poll",
    "error",
)

_loaded = {}
for _name in MODULES:
    try:
        _loaded[_name] = importlib.import_module(f"wit_world.imports.{_name}")
    except ImportError:  # pragma: no cover - only outside a component
        pass


def module(name):
    """The bindings module ``wit_world.imports.<name>``."""
    try:
        return _loaded[name]
    except KeyError:
        raise RuntimeError(
            "the dtq host imports exist only inside a dtq worker: build the handler "
            "with `dtq-py build` and run it there"
        ) from None


def err_value(exc):
    """The WIT error carried by a ``componentize_py_types.Err``, else None."""
    try:
        from componentize_py_types import Err
    except ImportError:  # pragma: no cover
        return None
    return exc.value if isinstance(exc, Err) else None
