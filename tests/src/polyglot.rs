//! Handlers in every language the project has an SDK for, built from source
//! at test time, so that one test can run the same assertions over each.
//!
//! Rust components come from `build.rs` (the [`guests`]
//! constants). Python ones are built here with the project's build tool
//! (`guest-sdk/python`, componentize-py from `.venv-guests/`, which
//! `scripts/setup` installs); JavaScript ones with `guest-sdk/js` and the
//! project-local `node_modules`. A Python or JS build takes tens of seconds,
//! so its component is cached in the target directory under a hash of every
//! input (the handler's directory, the SDK, the WIT and the tool's version):
//! a test run pays for a build only after one of them changed.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Context as _, Result, bail};

use crate::guests;

/// A language handlers are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lang {
    /// `guest-sdk` (wit-bindgen), built by `build.rs`.
    Rust,
    /// `guest-sdk/python` (componentize-py).
    Python,
    /// `guest-sdk/js` (componentize-js).
    Js,
}

impl fmt::Display for Lang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Lang::Rust => "rust",
            Lang::Python => "python",
            Lang::Js => "js",
        })
    }
}

/// The languages whose handlers the tests run.
pub const LANGS: &[Lang] = &[Lang::Rust, Lang::Python, Lang::Js];

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The component of example handler `name` (`examples/<name>`,
/// `examples/python/<name>`, `examples/js/<name>`), built if needed.
pub fn example(lang: Lang, name: &str) -> Result<PathBuf> {
    match lang {
        Lang::Rust => Ok(Path::new(guests::EXAMPLES_DIR).join(format!("{name}.wasm"))),
        Lang::Python => built(lang, &repo_root().join("examples/python").join(name)),
        Lang::Js => built(lang, &repo_root().join("examples/js").join(name)),
    }
}

/// The component of test guest `name` (`tests/guests/<name>`,
/// `tests/guests-py/<name>`, `tests/guests-js/<name>`), built if needed.
pub fn test_guest(lang: Lang, name: &str) -> Result<PathBuf> {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
    match lang {
        Lang::Rust => Ok(Path::new(guests::TEST_GUESTS_DIR).join(format!("{name}.wasm"))),
        Lang::Python => built(lang, &tests.join("guests-py").join(name)),
        Lang::Js => built(lang, &tests.join("guests-js").join(name)),
    }
}

/// Every Python and JavaScript handler the tests may build: each
/// directory under `examples/python`, `examples/js`, `tests/guests-py` and
/// `tests/guests-js`, with its language.
pub fn every_handler() -> Result<Vec<(Lang, PathBuf)>> {
    let root = repo_root();
    let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut handlers = Vec::new();
    for (lang, parent) in [
        (Lang::Python, root.join("examples/python")),
        (Lang::Js, root.join("examples/js")),
        (Lang::Python, tests.join("guests-py")),
        (Lang::Js, tests.join("guests-js")),
    ] {
        let entries = std::fs::read_dir(&parent)
            .with_context(|| format!("read directory {}", parent.display()))?;
        let mut dirs = Vec::new();
        for entry in entries {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            }
        }
        dirs.sort();
        handlers.extend(dirs.into_iter().map(|dir| (lang, dir)));
    }
    Ok(handlers)
}

/// The component of the `lang` handler in `dir`, built if needed (what
/// [`example`] and [`test_guest`] give, by directory).
pub fn component(lang: Lang, dir: &Path) -> Result<PathBuf> {
    match lang {
        Lang::Rust => bail!("Rust guests are built by build.rs"),
        Lang::Python | Lang::Js => built(lang, dir),
    }
}

/// The bytes of [`example`].
pub fn example_wasm(lang: Lang, name: &str) -> Result<Vec<u8>> {
    let path = example(lang, name)?;
    std::fs::read(&path).with_context(|| format!("read {}", path.display()))
}

/// The bytes of [`test_guest`].
pub fn test_guest_wasm(lang: Lang, name: &str) -> Result<Vec<u8>> {
    let path = test_guest(lang, name)?;
    std::fs::read(&path).with_context(|| format!("read {}", path.display()))
}

/// The cached component of the handler in `dir`, built when its inputs
/// changed. Builds of one handler within a process are serialized; builds
/// from several processes at once each write a complete file and rename it
/// into place, so a reader never sees half of one.
fn built(lang: Lang, dir: &Path) -> Result<PathBuf> {
    static LOCKS: OnceLock<Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>> = OnceLock::new();
    let lock = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(dir.to_path_buf())
        .or_default()
        .clone();
    let _held = lock.lock().unwrap_or_else(|e| e.into_inner());

    let tool = Tool::of(lang)?;
    let digest = inputs_digest(&tool, dir)?;
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("a handler directory has a name")?;
    let cache = cache_dir().join(lang.to_string());
    let cached = cache.join(format!("{name}-{}.wasm", &digest[..16]));
    if cached.is_file() {
        return Ok(cached);
    }
    let out = cache.join(format!("build-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    let output = tool
        .command(dir, &out)
        .output()
        .with_context(|| format!("run the {lang} build of {}", dir.display()))?;
    if !output.status.success() {
        bail!(
            "building {} failed ({}):\n{}{}",
            dir.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    // The tool prints the path it wrote; the file is named by the task the
    // handler declares, which need not be the directory's name.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let written = stdout
        .lines()
        .rev()
        .map(str::trim)
        .find(|line| line.ends_with(".wasm"))
        .map(PathBuf::from)
        .with_context(|| format!("the {lang} build printed no .wasm path: {stdout}"))?;
    std::fs::rename(&written, &cached)
        .with_context(|| format!("move {} to {}", written.display(), cached.display()))?;
    let _ = std::fs::remove_dir_all(&out);
    Ok(cached)
}

/// Where built components are kept: `$CARGO_TARGET_DIR/polyglot`, else the
/// workspace's `target/polyglot`.
fn cache_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"))
        .join("polyglot")
}

/// Where the polyglot suite keeps the compiled artifacts of the
/// components it runs (the sandbox's `cache_dir`), shared by its tests and
/// by `polyglot_prebuild`: an interpreter component takes seconds to
/// compile, and once per build of the tests is enough.
pub fn artifact_dir() -> PathBuf {
    cache_dir().join("artifacts")
}

/// How one language's handlers are built.
struct Tool {
    lang: Lang,
    /// The program that runs the build.
    program: PathBuf,
    /// Directories whose files the component is made of, besides the
    /// handler's own.
    inputs: Vec<PathBuf>,
    /// The pinned tool's identity (its version), part of the cache key.
    version: String,
}

impl Tool {
    fn of(lang: Lang) -> Result<Tool> {
        let root = repo_root();
        match lang {
            Lang::Rust => bail!("Rust guests are built by build.rs"),
            Lang::Python => {
                let python = root.join(".venv-guests/bin/python");
                if !python.is_file() {
                    bail!(
                        "{} is missing: run scripts/setup, which installs componentize-py \
                         for the Python handlers",
                        python.display()
                    );
                }
                Ok(Tool {
                    lang,
                    version: tool_version(&root.join(".venv-guests/bin/componentize-py"))?,
                    program: python,
                    inputs: vec![root.join("guest-sdk/python/src"), root.join("wit")],
                })
            }
            Lang::Js => {
                let modules = root.join("guest-sdk/js/node_modules");
                if !modules.is_dir() {
                    bail!(
                        "{} is missing: run scripts/setup, which installs componentize-js \
                         for the JavaScript handlers",
                        modules.display()
                    );
                }
                let lock = root.join("guest-sdk/js/package-lock.json");
                Ok(Tool {
                    lang,
                    program: PathBuf::from("node"),
                    version: std::fs::read_to_string(&lock)
                        .with_context(|| format!("read {}", lock.display()))?,
                    inputs: vec![
                        root.join("guest-sdk/js/src"),
                        root.join("guest-sdk/js/build.mjs"),
                        root.join("wit"),
                    ],
                })
            }
        }
    }

    fn command(&self, dir: &Path, out: &Path) -> Command {
        let root = repo_root();
        let mut cmd = Command::new(&self.program);
        match self.lang {
            Lang::Rust => unreachable!("Rust guests are built by build.rs"),
            Lang::Python => {
                cmd.env("PYTHONPATH", root.join("guest-sdk/python/src"))
                    .args(["-m", "dtq_guest.build", "build", "--quiet", "--wit"])
                    .arg(root.join("wit"))
                    .arg("--out-dir")
                    .arg(out)
                    .arg(dir);
            }
            Lang::Js => {
                cmd.arg(root.join("guest-sdk/js/build.mjs"))
                    .arg("--wit")
                    .arg(root.join("wit"))
                    .arg("--out-dir")
                    .arg(out)
                    .arg(dir);
            }
        }
        cmd
    }
}

/// The first line `program --version` prints.
fn tool_version(program: &Path) -> Result<String> {
    let output = Command::new(program)
        .arg("--version")
        .output()
        .with_context(|| format!("run {} --version", program.display()))?;
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// SHA-256 over the tool's version and the path and contents of every file
/// under the handler's directory and the tool's inputs.
fn inputs_digest(tool: &Tool, dir: &Path) -> Result<String> {
    let mut files = Vec::new();
    for input in std::iter::once(dir).chain(tool.inputs.iter().map(PathBuf::as_path)) {
        collect_files(input, &mut files)?;
    }
    files.sort();
    let mut text = Vec::new();
    text.extend_from_slice(tool.version.as_bytes());
    for file in files {
        text.extend_from_slice(file.to_string_lossy().as_bytes());
        text.push(0);
        let bytes = std::fs::read(&file).with_context(|| format!("read {}", file.display()))?;
        text.extend_from_slice(crate::sha256_hex(&bytes).as_bytes());
    }
    Ok(crate::sha256_hex(&text))
}

/// Every file under `path` (or `path` itself), skipping caches and
/// installed packages.
fn collect_files(path: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    if path.is_file() {
        files.push(path.to_path_buf());
        return Ok(());
    }
    let entries =
        std::fs::read_dir(path).with_context(|| format!("read directory {}", path.display()))?;
    for entry in entries {
        let path = entry?.path();
        let skipped = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| matches!(n, "__pycache__" | "node_modules" | "target"));
        if skipped {
            continue;
        }
        if path.is_dir() {
            collect_files(&path, files)?;
        } else {
            files.push(path);
        }
    }
    Ok(())
}
