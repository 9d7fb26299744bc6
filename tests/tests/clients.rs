//! The client libraries for application code, `clients/python` and
//! `clients/js`, as their users get them: each installed the ordinary way
//! (`pip install` into a fresh venv, `npm install` of the packed package)
//! and run against a real dtq (a real redis-server, the API on a loopback
//! port, a worker running the example `echo` handler) by its smoke script,
//! which submits a keyed task and waits for its result, replays the key,
//! checks error answers, follows and resumes events, submits a batch and
//! cancels a delayed task, then prints what it saw for the checks here. The
//! same scripts against a server with `--events none` check that waiting
//! falls back to polling. Each client's unit tests (no server) run here too,
//! and the TypeScript declarations are compiled against a typed use of the
//! client when the `tsc` that `scripts/setup` installs is there.
//!
//! Needs `python3` (with `venv`) and `node` with `npm` (Node 18 or later);
//! `pip` fetches the build backend from PyPI only when the venv has no
//! setuptools 61 or later.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use dtq_tests::{Dtq, TempDir};
use serde_json::{Value, json};

/// How long an install (pip, npm) may take.
const INSTALL: Duration = Duration::from_secs(300);
/// How long a smoke script or a unit test suite may take.
const SCRIPT: Duration = Duration::from_secs(120);

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the repository")
        .to_path_buf()
}

/// Run `program` with `args` in `dir` to its end, within `limit`; its
/// stdout. A non-zero exit fails with both outputs.
async fn run(program: &str, args: &[&str], dir: &Path, limit: Duration) -> Result<String> {
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .current_dir(dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let what = format!("{program} {}", args.join(" "));
    let output = tokio::time::timeout(limit, command.output())
        .await
        .with_context(|| format!("`{what}` did not finish within {limit:?}"))?
        .with_context(|| format!("cannot run `{what}`: is {program} installed?"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!(
            "`{what}` exited with {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
            output.status
        );
    }
    Ok(stdout)
}

/// The last line of a smoke script's output, as JSON.
fn report(stdout: &str) -> Result<Value> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .with_context(|| format!("no report in {stdout:?}"))?;
    serde_json::from_str(line).with_context(|| format!("the report is not JSON: {line:?}"))
}

/// Copy the directory `from` to `to`, but for what builds leave there.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        let name_text = name.to_string_lossy();
        if matches!(&*name_text, "build" | "node_modules" | "__pycache__")
            || name_text.ends_with(".egg-info")
        {
            continue;
        }
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &to.join(&name))?;
        } else {
            std::fs::copy(entry.path(), to.join(&name))?;
        }
    }
    Ok(())
}

/// What every full smoke run must have seen, whichever the client: the
/// waited result is the handler's (echo: the payload), the replay of the
/// key is the same task, and the rest of the script's checks. The API,
/// read from here, agrees: the task succeeded with that result, and the
/// key names it.
async fn check_report(dtq: &Dtq, queue: &str, seen: &Value) -> Result<()> {
    let payload = json!({"n": 7, "text": "é/?#", "list": [1, 2.5, null, true]});
    assert_eq!(seen["result"], payload, "{seen:#}");
    let task_id = seen["task_id"].as_str().context("a task_id")?;
    assert_eq!(seen["duplicate"], true, "{seen:#}");
    assert_eq!(seen["duplicate_task_id"], task_id, "{seen:#}");
    assert_eq!(seen["status"], "SUCCEEDED", "{seen:#}");
    assert_eq!(
        seen["errors"],
        json!({"unknown_task": "UNKNOWN_TASK", "missing_task_id": "a/b?c#d"}),
        "{seen:#}"
    );
    let events: Vec<&str> = seen["events"]
        .as_array()
        .context("events")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(events.first(), Some(&"QUEUED"), "{seen:#}");
    assert_eq!(events.last(), Some(&"SUCCEEDED"), "{seen:#}");
    assert_eq!(seen["batch"], json!([202, 400]), "{seen:#}");
    assert_eq!(seen["cancelled"], "CANCELLED", "{seen:#}");

    let task = dtq.task(queue, task_id).await?;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"], payload, "{task:#}");
    let key = seen["key"].as_str().context("a key")?;
    let (status, record) = dtq
        .call(
            reqwest::Method::GET,
            &format!("/v1/queues/{queue}/idempotency/{key}"),
            None,
            &[],
        )
        .await?;
    assert_eq!(
        (status, &record["task_id"]),
        (200, &json!(task_id)),
        "{record:#}"
    );
    Ok(())
}

/// The smoke script's report against a server that writes no events:
/// `wait` polled its way to the handler's result.
async fn check_events_off_report(dtq: &Dtq, queue: &str, seen: &Value) -> Result<()> {
    assert_eq!(seen["result"], json!({"polled": true}), "{seen:#}");
    let task_id = seen["task_id"].as_str().context("a task_id")?;
    let task = dtq.task(queue, task_id).await?;
    assert_eq!(task["result"], json!({"polled": true}), "{task:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn python_client_unit_tests_pass() -> Result<()> {
    let dir = repo().join("clients/python");
    run(
        "python3",
        &[
            "-m",
            "unittest",
            "discover",
            "-s",
            "tests",
            "-p",
            "test_*.py",
            "-v",
        ],
        &dir,
        SCRIPT,
    )
    .await?;
    Ok(())
}

/// Exits 0 where setuptools can build the client's wheel by itself.
const BUILDS_WHEELS: &str = "import setuptools
v = tuple(int(x) for x in setuptools.__version__.split('.')[:2])
if v < (70, 1):
    import wheel
raise SystemExit(v < (61, 0))";

/// A venv in `dir` with `clients/python` installed: its `python`.
async fn python_venv_with_client(dir: &Path) -> Result<PathBuf> {
    let venv = dir.join("venv");
    let source = dir.join("dtq-client");
    // Built from a copy: a setuptools build leaves build/ and *.egg-info
    // in the source tree.
    copy_tree(&repo().join("clients/python"), &source)?;
    let venv_arg = venv.to_str().context("a UTF-8 temp dir")?;
    run("python3", &["-m", "venv", venv_arg], dir, INSTALL).await?;
    let python = venv.join("bin/python");
    let python_arg = python.to_str().context("a UTF-8 temp dir")?;
    let source_arg = source.to_str().context("a UTF-8 temp dir")?;
    // A venv whose setuptools can build a wheel (61 or later, with the
    // `wheel` package before 70.1) builds the package offline; without,
    // pip fetches the build backend the project names.
    let has_backend = run(python_arg, &["-c", BUILDS_WHEELS], dir, SCRIPT)
        .await
        .is_ok();
    let mut pip = vec!["-m", "pip", "install", "--quiet"];
    if has_backend {
        pip.extend(["--no-build-isolation", "--no-index"]);
    }
    pip.push(source_arg);
    run(python_arg, &pip, dir, INSTALL).await?;
    // Installed, not read from the source tree: the package's own files.
    let location = run(
        python_arg,
        &["-c", "import dtq_client; print(dtq_client.__file__)"],
        dir,
        SCRIPT,
    )
    .await?;
    ensure!(
        location.contains("site-packages"),
        "dtq_client imported from {location}"
    );
    Ok(python)
}

#[tokio::test(flavor = "multi_thread")]
async fn python_client_submits_waits_replays_follows_and_cancels() -> Result<()> {
    let tmp = TempDir::new("client-python")?;
    let python = python_venv_with_client(&tmp.path).await?;
    let python = python.to_str().context("a UTF-8 path")?;
    let smoke = repo().join("clients/python/tests/smoke.py");
    let smoke = smoke.to_str().context("a UTF-8 path")?;

    let dtq = Dtq::start(true, &["--queues", "clients-py"]).await?;
    let out = run(python, &[smoke, dtq.api.as_str()], &tmp.path, SCRIPT).await?;
    let seen = report(&out)?;
    check_report(&dtq, "clients-py", &seen).await?;
    assert_eq!(seen["async_result"], json!({"async": true}), "{seen:#}");

    let quiet = Dtq::start(true, &["--events", "none", "--queues", "clients-py"]).await?;
    let out = run(
        python,
        &[smoke, quiet.api.as_str(), "--events-off"],
        &tmp.path,
        SCRIPT,
    )
    .await?;
    check_events_off_report(&quiet, "clients-py", &report(&out)?).await
}

#[tokio::test(flavor = "multi_thread")]
async fn js_client_unit_tests_pass() -> Result<()> {
    let dir = repo().join("clients/js");
    run("node", &["--test", "test/unit.test.mjs"], &dir, SCRIPT).await?;
    Ok(())
}

/// A project in `dir` with `clients/js` installed from its packed tarball
/// (so only the files the package ships), and the smoke script beside it,
/// where `import "dtq-client"` finds the package.
async fn js_project_with_client(dir: &Path) -> Result<()> {
    let dir_arg = dir.to_str().context("a UTF-8 temp dir")?;
    let package = repo().join("clients/js");
    let package_arg = package.to_str().context("a UTF-8 path")?;
    let quiet = ["--no-audit", "--no-fund", "--loglevel=error"];
    let mut pack = vec!["pack", "--silent", "--pack-destination", dir_arg];
    pack.extend(quiet);
    pack.push(package_arg);
    let tarball = run("npm", &pack, dir, INSTALL).await?;
    let tarball = tarball
        .trim()
        .lines()
        .last()
        .context("npm pack named no file")?;
    std::fs::write(
        dir.join("package.json"),
        r#"{"name": "dtq-client-smoke", "private": true, "type": "module"}"#,
    )?;
    let tarball_arg = format!("./{tarball}");
    let mut install = vec!["install", tarball_arg.as_str()];
    install.extend(quiet);
    run("npm", &install, dir, INSTALL).await?;
    for file in ["smoke.mjs", "types.ts"] {
        std::fs::copy(package.join("test").join(file), dir.join(file))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn js_client_submits_waits_replays_follows_and_cancels() -> Result<()> {
    let tmp = TempDir::new("client-js")?;
    js_project_with_client(&tmp.path).await?;

    let dtq = Dtq::start(true, &["--queues", "clients-js"]).await?;
    let out = run("node", &["smoke.mjs", dtq.api.as_str()], &tmp.path, SCRIPT).await?;
    check_report(&dtq, "clients-js", &report(&out)?).await?;

    let quiet = Dtq::start(true, &["--events", "none", "--queues", "clients-js"]).await?;
    let out = run(
        "node",
        &["smoke.mjs", quiet.api.as_str(), "--events-off"],
        &tmp.path,
        SCRIPT,
    )
    .await?;
    check_events_off_report(&quiet, "clients-js", &report(&out)?).await?;

    // The declarations, compiled against a typed use of the client.
    let tsc = repo().join("guest-sdk/js/node_modules/.bin/tsc");
    if !tsc.exists() {
        eprintln!(
            "no {}: the TypeScript declarations are not checked (scripts/setup installs it)",
            tsc.display()
        );
        return Ok(());
    }
    let tsc = tsc.to_str().context("a UTF-8 path")?;
    run(
        tsc,
        &[
            "--noEmit",
            "--strict",
            "--module",
            "nodenext",
            "--moduleResolution",
            "nodenext",
            "--target",
            "es2022",
            "--lib",
            "es2022,dom",
            "--types",
            "",
            "types.ts",
        ],
        &tmp.path,
        SCRIPT,
    )
    .await?;
    Ok(())
}
