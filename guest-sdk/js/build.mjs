#!/usr/bin/env node
// Build JavaScript dtq handlers into components with componentize-js (its
// library API).
//
//   node guest-sdk/js/build.mjs [--wit DIR] [--out-dir DIR] HANDLER_DIR...
//
// A handler directory holds handler.js (and any modules it imports by
// relative path), which calls `task("<name>", fn)` once, importing the SDK
// as `dtq`. The build:
//
// 1. reads the task name and namespace from the `task(...)` call (string
//    literals, as the Rust `handler!` macro takes them);
// 2. lays out the SDK (src/) and the handler in a work directory, the
//    handler's `from "dtq"` resolved to the SDK, and an entry module that
//    imports the handler and re-exports the SDK's `handle`;
// 3. runs componentize-js against the repository's wit/ (world `handler`),
//    with its generated import glue corrected for negative `s64` arguments
//    (see `componentizeWithSignedI64`); `fetch` (http.js) runs over the
//    engine's own wasi:http imports;
// 4. appends a `dtq-namespace` custom section when the handler asks for a
//    namespace, and writes `<out-dir>/<name>.wasm`, printing its path.

import { cp, mkdir, mkdtemp, readFile, readdir, rename, rm, writeFile } from 'node:fs/promises';
import { existsSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const SDK = join(dirname(fileURLToPath(import.meta.url)), 'src');
const NAMESPACE = /^[A-Za-z0-9_.-]{1,64}$/;
const TASK_CALL =
  /\btask\(\s*(['"])([^'"]+)\1\s*(?:,\s*\{\s*namespace\s*:\s*(['"])([^'"]+)\3\s*(?:,[^}]*)?\})?/g;
const DTQ_IMPORT = /(\bfrom\s*|\bimport\s*\(?\s*)(['"])dtq\2/g;

class BuildError extends Error {}

/** `{name, namespace}` of the one `task(...)` call in `source`. */
function declaredTask(source, path) {
  const calls = [...source.matchAll(TASK_CALL)];
  if (calls.length !== 1) {
    throw new BuildError(
      `${path}: expected exactly one task("<name>", …) call with a string literal name, ` +
        `found ${calls.length}`,
    );
  }
  const [, , name, , namespace] = calls[0];
  if (/[\\/]/.test(name) || name.startsWith('.')) {
    throw new BuildError(`${path}: ${JSON.stringify(name)} cannot name a component file`);
  }
  if (namespace !== undefined && !NAMESPACE.test(namespace)) {
    throw new BuildError(
      `${path}: namespace ${JSON.stringify(namespace)}: a dtq namespace may hold only 1 to 64 ` +
        "ASCII letters, digits, '-', '_' and '.'",
    );
  }
  return { name, namespace };
}

/** The nearest `wit/` holding the dtq:handler package, upward from `start`. */
function findWit(start) {
  for (let dir = resolve(start); ; dir = dirname(dir)) {
    const world = join(dir, 'wit', 'world.wit');
    if (existsSync(world)) return join(dir, 'wit');
    if (dirname(dir) === dir) return null;
  }
}

/** A wasm custom section (id 0) named `name` holding `data`. */
function customSection(name, data) {
  const leb = (n) => {
    const out = [];
    do {
      let byte = n & 0x7f;
      n >>>= 7;
      if (n) byte |= 0x80;
      out.push(byte);
    } while (n);
    return Buffer.from(out);
  };
  const nameBytes = Buffer.from(name);
  const body = Buffer.concat([leb(nameBytes.length), nameBytes, data]);
  return Buffer.concat([Buffer.from([0]), leb(body.length), body]);
}

/** Copy the handler directory, resolving its `dtq` imports to the SDK. */
async function copyHandler(from, to) {
  await mkdir(to, { recursive: true });
  for (const entry of await readdir(from, { withFileTypes: true })) {
    if (entry.name === 'node_modules') continue;
    const [src, dst] = [join(from, entry.name), join(to, entry.name)];
    if (entry.isDirectory()) {
      await copyHandler(src, dst);
    } else if (/\.m?js$/.test(entry.name)) {
      const depth = dst.slice(to.length).split('/').length - 1;
      const sdk = `${'../'.repeat(depth)}../dtq/index.js`;
      const text = await readFile(src, 'utf8');
      await writeFile(dst, text.replace(DTQ_IMPORT, (_, lead, q) => `${lead}${q}${sdk}${q}`));
    } else {
      await cp(src, dst);
    }
  }
}

/** The toInt64 intrinsic of componentize-js's generated import glue. */
const TO_INT64 =
  /function toInt64\(val\)\s*\{\s*const converted = BigInt\(val\)\s*return BigInt\.asIntN\(64, converted\);\s*\}/g;
/** Where componentize.js writes the glue; the patch goes just before it. */
const WRITE_GLUE = 'await writeFile(initializerPath, jsBindings);';

/**
 * componentize-js's `componentize`, with one correction to the JS glue it
 * generates for imports.
 *
 * The glue lowers an `s64` argument with `BigInt.asIntN(64, …)`, which
 * gives a negative BigInt for a negative value, but the engine's
 * `coreabi_from_bigint64` accepts only what fits a `u64` and aborts the
 * call otherwise (ComponentizeJS issue 343, open in 0.23.0): `kv.incrBy(k,
 * -1)` would trap. `BigInt.asUintN` passes the same 64 bits, which the
 * engine hands on unchanged, so the host gets the signed value. The
 * corrected module is written beside the original (its relative imports
 * must resolve) in the project-local node_modules; the pinned version's
 * source is checked to hold exactly the expected text.
 */
async function componentizeWithSignedI64() {
  const original = fileURLToPath(import.meta.resolve('@bytecodealliance/componentize-js'));
  const source = await readFile(original, 'utf8');
  if (!source.includes(WRITE_GLUE)) {
    throw new BuildError(`${original} does not look like componentize-js 0.23.0`);
  }
  const fix =
    'jsBindings = jsBindings.replace(' +
    `${TO_INT64}, ` +
    "'function toInt64(val) { return BigInt.asUintN(64, BigInt(val)); }');\n  ";
  const patched = join(dirname(original), 'componentize.dtq-signed-i64.js');
  const text = source.replace(WRITE_GLUE, fix + WRITE_GLUE);
  if (!existsSync(patched) || (await readFile(patched, 'utf8')) !== text) {
    await writeFile(patched, text);
  }
  return (await import(pathToFileURL(patched).href)).componentize;
}

/** Build `handlerDir` into `outDir/<name>.wasm`; the path written. */
export async function build(handlerDir, outDir, wit) {
  handlerDir = resolve(handlerDir);
  const source = join(handlerDir, 'handler.js');
  if (!existsSync(source)) throw new BuildError(`${handlerDir} has no handler.js`);
  const { name, namespace } = declaredTask(await readFile(source, 'utf8'), source);
  const witPath = wit ? resolve(wit) : findWit(handlerDir) ?? findWit(process.cwd());
  if (!witPath || !statSync(witPath).isDirectory()) {
    throw new BuildError(`cannot find the dtq wit/ above ${handlerDir}: pass --wit DIR`);
  }
  const work = await mkdtemp(join(tmpdir(), 'dtq-js-build-'));
  try {
    await cp(SDK, join(work, 'dtq'), { recursive: true });
    await copyHandler(handlerDir, join(work, 'handler'));
    const entry = join(work, 'entry.js');
    await writeFile(
      entry,
      "// Generated by the dtq JS build: the component's entry module.\n" +
        "import './handler/handler.js';\n" +
        "export { handle } from './dtq/index.js';\n",
    );
    const componentize = await componentizeWithSignedI64();
    const { component } = await componentize({
      sourcePath: entry,
      witPath,
      worldName: 'handler',
    });
    let wasm = Buffer.from(component);
    if (namespace !== undefined) {
      wasm = Buffer.concat([wasm, customSection('dtq-namespace', Buffer.from(namespace))]);
    }
    await mkdir(outDir, { recursive: true });
    const output = join(resolve(outDir), `${name}.wasm`);
    await writeFile(`${output}.partial`, wasm);
    await rename(`${output}.partial`, output);
    return output;
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

async function main(argv) {
  let outDir = 'target/js';
  let wit = process.env.DTQ_WIT;
  const dirs = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--out-dir' || argv[i] === '-o') outDir = argv[++i];
    else if (argv[i] === '--wit') wit = argv[++i];
    else dirs.push(argv[i]);
  }
  if (dirs.length === 0) {
    console.error('usage: build.mjs [--wit DIR] [--out-dir DIR] HANDLER_DIR...');
    return 2;
  }
  for (const dir of dirs) {
    const started = Date.now();
    try {
      const output = await build(dir, outDir, wit);
      const size = statSync(output).size / 2 ** 20;
      const took = (Date.now() - started) / 1000;
      console.error(`dtq-js: built ${output} (${size.toFixed(1)} MiB) in ${took.toFixed(1)} s`);
      console.log(output);
    } catch (e) {
      console.error(`dtq-js: ${e instanceof BuildError ? e.message : e?.stack ?? e}`);
      return 1;
    }
  }
  return 0;
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  process.exitCode = await main(process.argv.slice(2));
}
