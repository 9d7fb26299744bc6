//! Build the guest components the integration tests run, from source.
//!
//! The example handlers (`../examples`) and the test guests (`guests/`) are
//! cargo workspaces of their own, built for `wasm32-wasip2` by a nested
//! `cargo build --release`. Their paths are written to `$OUT_DIR/guests.rs`,
//! which `src/lib.rs` includes as the `guests` module, so a test names a
//! component by constant and no `.wasm` is ever checked in.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The target every guest is built for.
const TARGET: &str = "wasm32-wasip2";

/// Example handlers in `../examples`, by task name (= crate name = file stem).
const EXAMPLES: &[&str] = &[
    "counter",
    "send_receipt",
    "echo",
    "flaky",
    "sleep",
    "order_total",
    "fan_out",
    "square",
];

/// Test guests in `guests/`.
const TEST_GUESTS: &[&str] = &[
    "adversarial",
    "http_client",
    "namespaced",
    "operations",
    "flows",
    "progress",
    "versioned_v1",
    "versioned_v2",
    "waiter",
    "waiter_raw",
];

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf();
    let examples = root.join("examples");
    let guests = manifest_dir.join("guests");

    rerun_if_changed(&root.join("wit"));
    rerun_if_changed_crate(&root.join("guest-sdk"));
    rerun_if_changed_workspace(&examples);
    rerun_if_changed_workspace(&guests);

    check_target_installed();
    let examples_dir = build_workspace(&examples, EXAMPLES);
    let guests_dir = build_workspace(&guests, TEST_GUESTS);

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join("guests.rs");
    let source = generate(&examples_dir, &guests_dir);
    fs::write(&out, source).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

/// Build `workspace` in release mode for [`TARGET`] and return the directory
/// holding its components, after checking that each of `crates` is there.
fn build_workspace(workspace: &Path, crates: &[&str]) -> PathBuf {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    // The target directory is named explicitly so that no cargo configuration
    // of the machine's can move the components away from where they are looked
    // for below.
    let target_dir = workspace.join("target");
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args(["build", "--release", "--target", TARGET, "--target-dir"])
        .arg(&target_dir);
    scrub_env(&mut cmd);

    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run cargo to build {}: {e}", workspace.display()));
    if !output.status.success() {
        panic!(
            "building the guest components in {} failed ({}):\n{}",
            workspace.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }

    let dir = target_dir.join(TARGET).join("release");
    for name in crates {
        let wasm = dir.join(format!("{name}.wasm"));
        if !wasm.is_file() {
            panic!(
                "building {} succeeded but left no {}:\n{}",
                workspace.display(),
                wasm.display(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
    dir
}

/// Remove what this build script inherits from the outer cargo that would
/// redirect or reconfigure the nested build: its target directory, target,
/// flags and wrappers are the host build's, not the guests'. The jobserver
/// (`CARGO_MAKEFLAGS`) is kept so both builds share the same job slots.
fn scrub_env(cmd: &mut Command) {
    for name in [
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_BUILD_TARGET_DIR",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_RUSTC_WRAPPER",
        "CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "OUT_DIR",
        "TARGET",
        "HOST",
        "PROFILE",
        "OPT_LEVEL",
        "DEBUG",
        "NUM_JOBS",
        "RUSTDOC",
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
    ] {
        cmd.env_remove(name);
    }
    for (name, _) in env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let inherited = [
            "CARGO_PROFILE_",
            "CARGO_CFG_",
            "CARGO_FEATURE_",
            "CARGO_PKG_",
            "DEP_",
        ]
        .iter()
        .any(|prefix| name.starts_with(prefix));
        if inherited {
            cmd.env_remove(name);
        }
    }
}

/// Panic with the fix when the standard library for [`TARGET`] is missing,
/// rather than letting the nested build fail with a less direct message.
fn check_target_installed() {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let output = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", rustc.to_string_lossy()));
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_string();
    let target_lib = Path::new(&sysroot).join("lib").join("rustlib").join(TARGET);
    if !target_lib.is_dir() {
        panic!(
            "the {TARGET} target is not installed in {sysroot}; the tests need it to build their \
             guest components: run `rustup target add {TARGET}`"
        );
    }
}

/// The contents of `guests.rs`.
fn generate(examples_dir: &Path, guests_dir: &Path) -> String {
    let mut src = String::from("// Generated by tests/build.rs; do not edit.\n\n");
    push_const(
        &mut src,
        "EXAMPLES_DIR",
        "The directory holding `<task>.wasm` for every example handler.",
        examples_dir,
    );
    push_const(
        &mut src,
        "TEST_GUESTS_DIR",
        "The directory holding the test guest components.",
        guests_dir,
    );
    for name in EXAMPLES {
        let doc = format!("The `{name}` example handler component (`examples/{name}`).");
        push_const(
            &mut src,
            &name.to_uppercase(),
            &doc,
            &examples_dir.join(format!("{name}.wasm")),
        );
    }
    for name in TEST_GUESTS {
        let doc = format!("The `{name}` test guest component (`tests/guests/{name}`).");
        push_const(
            &mut src,
            &name.to_uppercase(),
            &doc,
            &guests_dir.join(format!("{name}.wasm")),
        );
    }
    src.push_str(
        "/// The task names of the example handlers; each is `EXAMPLES_DIR/<name>.wasm`.\n",
    );
    let names: Vec<String> = EXAMPLES.iter().map(|name| format!("{name:?}")).collect();
    let _ = writeln!(
        src,
        "pub const EXAMPLES: &[&str] = &[{}];",
        names.join(", ")
    );
    src
}

fn push_const(src: &mut String, name: &str, doc: &str, path: &Path) {
    let path = path
        .to_str()
        .unwrap_or_else(|| panic!("{} is not valid UTF-8", path.display()));
    let _ = writeln!(src, "/// {doc}\npub const {name}: &str = {path:?};\n");
}

/// Rebuild when anything under `path` changes.
fn rerun_if_changed(path: &Path) {
    println!("cargo:rerun-if-changed={}", path.display());
}

/// Watch a crate's manifest and sources.
fn rerun_if_changed_crate(dir: &Path) {
    rerun_if_changed(&dir.join("Cargo.toml"));
    rerun_if_changed(&dir.join("src"));
}

/// Watch a workspace's manifest, lock file and every member crate in it, but
/// not its `target/`.
fn rerun_if_changed_workspace(dir: &Path) {
    rerun_if_changed(&dir.join("Cargo.toml"));
    rerun_if_changed(&dir.join("Cargo.lock"));
    let entries =
        fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    let mut members: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.join("Cargo.toml").is_file())
        .collect();
    members.sort();
    for member in members {
        rerun_if_changed_crate(&member);
    }
}
