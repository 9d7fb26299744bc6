"""``dtq-py build``: turn a handler directory into a dtq component.

A handler directory holds ``handler.py`` (and any modules it imports), with
one function decorated ``@task("<name>")``. The build:

1. reads the task name and namespace from the ``@task`` call in the source
   (they must be string literals: the namespace is embedded in the
   component, as the Rust ``handler!`` macro does at compile time);
2. lays out a WIT world that includes the repository's ``dtq:handler``
   world (``wit/``, found upward from the handler directory or given with
   ``--wit``) and imports ``wasi:http/outgoing-handler`` (from the WASI
   0.2 WIT shipped in this package), so that componentize-py generates the
   bindings from the same contract as the Rust SDK, at build time;
3. runs componentize-py on a generated entry module that imports the
   handler and exports :class:`dtq_guest.handler.WitWorld`;
4. appends a ``dtq-namespace`` custom section when the handler asks for a
   namespace, and writes ``<out-dir>/<name>.wasm``.

Only the handler directory and this package go into the component (plus
the Python standard library componentize-py bundles); install pure-Python
dependencies into the handler directory (``pip install --target``).
"""

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The WIT package and world a dtq handler is built against.
DTQ_WORLD = "dtq:handler/handler@0.2.0"
#: The wasi:http interface handlers may import (the WASI version componentize-py uses).
WASI_HTTP = "wasi:http/outgoing-handler@0.2.12"
#: The module componentize-py is pointed at.
ENTRY = "dtq_entry"
#: The custom section the host reads a handler's namespace from.
NAMESPACE_SECTION = "dtq-namespace"
NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

PACKAGE_DIR = Path(__file__).resolve().parent


class BuildError(Exception):
    """A handler that cannot be built, with the reason."""


def declared_task(source, path):
    """``(name, namespace)`` of the ``@task(...)`` in ``source``."""
    tree = ast.parse(source, filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            func = deco.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "task":
                found.append((node, deco))
    if len(found) != 1:
        raise BuildError(
            f"{path}: expected exactly one function decorated with @task(\"<name>\"), "
            f"found {len(found)}"
        )
    node, deco = found[0]

    def literal(expr, what):
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        raise BuildError(f"{path}:{deco.lineno}: the {what} of @task must be a string literal")

    if not deco.args:
        raise BuildError(f"{path}:{deco.lineno}: @task needs the task name: @task(\"<name>\")")
    task = literal(deco.args[0], "task name")
    namespace = None
    for kw in deco.keywords:
        if kw.arg == "namespace":
            namespace = literal(kw.value, "namespace")
    if not task or any(c in task for c in "/\\") or task.startswith("."):
        raise BuildError(f"{path}: {task!r} cannot name a component file")
    if namespace is not None and not NAMESPACE.fullmatch(namespace):
        raise BuildError(
            f"{path}: namespace {namespace!r}: a dtq namespace may hold only 1 to 64 ASCII "
            "letters, digits, '-', '_' and '.'"
        )
    return task, namespace


def find_wit(start):
    """The nearest ``wit/`` holding the ``dtq:handler`` package, upward from ``start``."""
    for dir in [start, *start.parents]:
        world = dir / "wit" / "world.wit"
        if world.is_file() and "package dtq:handler" in world.read_text():
            return dir / "wit"
    return None


def layout_wit(dtq_wit, dest):
    """Write the build's WIT tree to ``dest``: a root world over the repository's
    ``dtq:handler`` world and wasi:http, with both as dependencies."""
    deps = dest / "deps"
    shutil.copytree(dtq_wit, deps / "dtq-handler", ignore=shutil.ignore_patterns("deps"))
    for wit in sorted((PACKAGE_DIR / "wit" / "deps").glob("*.wit")):
        (deps / f"wasi-{wit.stem}").mkdir(parents=True)
        shutil.copy(wit, deps / f"wasi-{wit.stem}" / wit.name)
    (dest / "world.wit").write_text(
        "package dtq:python-guest;\n\n"
        "/// The dtq handler world, and outbound HTTP for `dtq_guest.http`.\n"
        "world handler {\n"
        f"    include {DTQ_WORLD};\n"
        f"    import {WASI_HTTP};\n"
        "}\n"
    )


def custom_section(name, data):
    """A wasm custom section (id 0) named ``name`` holding ``data``."""
    body = _leb128(len(name.encode())) + name.encode() + data
    return b"\x00" + _leb128(len(body)) + body


def _leb128(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def build(handler_dir, out_dir, wit=None, quiet=False):
    """Build ``handler_dir`` into ``out_dir/<task>.wasm``; the path written."""
    handler_dir = Path(handler_dir).resolve()
    source_path = handler_dir / "handler.py"
    if not source_path.is_file():
        raise BuildError(f"{handler_dir} has no handler.py")
    task, namespace = declared_task(source_path.read_text(), source_path)
    dtq_wit = Path(wit).resolve() if wit else find_wit(handler_dir) or find_wit(Path.cwd())
    if dtq_wit is None or not (dtq_wit / "world.wit").is_file():
        raise BuildError(
            "cannot find the dtq WIT (a wit/ directory with package dtq:handler) above "
            f"{handler_dir}: pass --wit DIR or set DTQ_WIT"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / f"{task}.wasm"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dtq-py-build-") as tmp:
        tmp = Path(tmp)
        layout_wit(dtq_wit, tmp / "wit")
        app = tmp / "app"
        # Only the SDK's Python sources go in, not whatever else sits beside
        # it (a site-packages with componentize-py itself, say).
        shutil.copytree(
            PACKAGE_DIR,
            app / "dtq_guest",
            ignore=shutil.ignore_patterns("wit", "build.py", "__pycache__"),
        )
        (app / f"{ENTRY}.py").write_text(
            "# Generated by dtq-py build: the component's entry module.\n"
            "import handler  # noqa: F401 - registers the @task function\n"
            "from dtq_guest.handler import WitWorld  # noqa: F401 - the export\n"
        )
        component = tmp / "component.wasm"
        command = [
            sys.executable,
            "-c",
            "import sys; from componentize_py import script; "
            "sys.argv[0] = 'componentize-py'; sys.exit(script())",
            "-d",
            str(tmp / "wit"),
            "-w",
            "handler",
            *(["--quiet"] if quiet else []),
            "componentize",
            ENTRY,
            "-p",
            str(app),
            "-p",
            str(handler_dir),
            "-o",
            str(component),
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        done = subprocess.run(command, env=env, cwd=tmp)
        if done.returncode != 0:
            raise BuildError(f"componentize-py failed ({done.returncode}) for {handler_dir}")
        wasm = component.read_bytes()
        if namespace is not None:
            wasm += custom_section(NAMESPACE_SECTION, namespace.encode())
        partial = output.with_suffix(".wasm.partial")
        partial.write_bytes(wasm)
        partial.replace(output)
    if not quiet:
        took = time.monotonic() - started
        print(
            f"dtq-py: built {output} ({len(wasm) / 2**20:.1f} MiB, task {task!r}"
            f"{f', namespace {namespace!r}' if namespace else ''}) in {took:.1f} s",
            file=sys.stderr,
        )
    return output


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="dtq-py", description="Build Python dtq task handlers into components."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build handler directories into <out-dir>/<task>.wasm")
    b.add_argument("handlers", nargs="+", help="directories holding handler.py")
    b.add_argument("-o", "--out-dir", default="target/python", help="default: target/python")
    b.add_argument("--wit", default=os.environ.get("DTQ_WIT"), help="the dtq wit/ directory")
    b.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        for handler in args.handlers:
            path = build(handler, args.out_dir, wit=args.wit, quiet=args.quiet)
            print(path)
    except BuildError as e:
        print(f"dtq-py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
