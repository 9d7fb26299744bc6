//! The OpenAPI document at `GET /v1/openapi.json` through the tools that
//! consume it (issue 34):
//!
//! - schemathesis (pinned, from PyPI into a venv of the test's own) runs
//!   every one of its checks against a real dtq with tokens configured,
//!   generating requests from the document: a server error, a status, a
//!   content type or a body the document does not give, data the document
//!   allows that the server refuses (or the reverse), a route that takes
//!   no token while the document says it needs one: each is a failure.
//!   Here it runs a few examples per operation; `scripts/schemathesis`
//!   runs the long form (`DTQ_SCHEMATHESIS_EXAMPLES`).
//! - openapi-typescript generates TypeScript types from the document, and
//!   `tsc --strict` type-checks a use of them with openapi-fetch (submit,
//!   status, list): a change of the document that breaks those calls fails
//!   here. All three are pinned, installed with npm into a temp dir.
//!
//! Needs `python3` (with `venv`) and `node` with `npm`, and PyPI and the
//! npm registry reachable.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use dtq_tests::{Dtq, TempDir};
use serde_json::Value;

/// The test token: every queue scope (`*`, admin included), every queue.
const TOKEN: &str = "openapi-tools-token-0123456789abcdef01234";

/// The pinned schemathesis.
const SCHEMATHESIS: &str = "schemathesis==4.32.5";

/// The pinned TypeScript tools.
const NPM_PACKAGES: [&str; 3] = [
    "openapi-typescript@7.13.0",
    "openapi-fetch@0.17.0",
    "typescript@5.9.3",
];

/// Examples per operation in the short form (the long form sets
/// `DTQ_SCHEMATHESIS_EXAMPLES`).
const SHORT_EXAMPLES: usize = 8;

/// How long an install (pip, npm) may take.
const INSTALL: Duration = Duration::from_secs(300);

/// How long a schemathesis run or a type check may take.
const RUN: Duration = Duration::from_secs(1800);

/// Run `program` with `args` in `dir` to its end, within `limit`: its
/// exit success and both outputs.
async fn run(program: &Path, args: &[&str], dir: &Path, limit: Duration) -> Result<(bool, String)> {
    run_with(program, args, &[], dir, limit).await
}

/// [`run`] with `envs` set.
async fn run_with(
    program: &Path,
    args: &[&str],
    envs: &[(&str, &Path)],
    dir: &Path,
    limit: Duration,
) -> Result<(bool, String)> {
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(dir)
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let what = format!("{} {}", program.display(), args.join(" "));
    let output = tokio::time::timeout(limit, command.output())
        .await
        .with_context(|| format!("`{what}` did not finish within {limit:?}"))?
        .with_context(|| format!("cannot run `{what}`: is it installed?"))?;
    let text = format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((output.status.success(), text))
}

/// [`run`], failing on a non-zero exit.
async fn run_ok(program: &Path, args: &[&str], dir: &Path, limit: Duration) -> Result<String> {
    let (ok, text) = run(program, args, dir, limit).await?;
    ensure!(
        ok,
        "`{} {}` failed\n{text}",
        program.display(),
        args.join(" ")
    );
    Ok(text)
}

/// The document a dtq serves.
async fn document(dtq: &Dtq) -> Result<Value> {
    let resp = reqwest::get(format!("{}/v1/openapi.json", dtq.api)).await?;
    ensure!(
        resp.status() == 200,
        "GET /v1/openapi.json: {}",
        resp.status()
    );
    Ok(resp.json().await?)
}

#[tokio::test]
async fn schemathesis_finds_no_difference_between_the_document_and_the_server() -> Result<()> {
    let examples = dtq_tests::env_usize("DTQ_SCHEMATHESIS_EXAMPLES", SHORT_EXAMPLES)?;
    let tokens = format!("{TOKEN} *");
    let dtq = Dtq::start(true, &["--tokens", &tokens]).await?;
    let dir = TempDir::new("schemathesis")?;
    let venv = dir.path.join("venv");
    let venv_arg = venv.to_str().context("a UTF-8 temp dir")?;
    run_ok(
        "python3".as_ref(),
        &["-m", "venv", venv_arg],
        &dir.path,
        INSTALL,
    )
    .await?;
    run_ok(
        &venv.join("bin/pip"),
        &["install", "--quiet", SCHEMATHESIS],
        &dir.path,
        INSTALL,
    )
    .await?;
    // What the run takes beside the document: the statuses a few
    // operations answer for what no schema can state, and a serializer for
    // the deploy's `application/wasm` body (each file says why).
    let own = Path::new(env!("CARGO_MANIFEST_DIR")).join("schemathesis");
    let config = own.join("schemathesis.toml");
    let config = config.to_str().context("a UTF-8 repository path")?;
    let hooks = own.join("hooks.py");
    let url = format!("{}/v1/openapi.json", dtq.api);
    let header = format!("Authorization: Bearer {TOKEN}");
    let examples = examples.to_string();
    let args = [
        "--no-color",
        "--config-file",
        config,
        "run",
        &url,
        "--checks",
        "all",
        "--header",
        &header,
        "--max-examples",
        &examples,
        "--seed",
        "34",
        "--workers",
        "1",
        "--generation-database",
        "none",
        // An event stream has no end: it is read for this long, then left.
        "--request-timeout",
        "5",
    ];
    let envs = [("SCHEMATHESIS_HOOKS", hooks.as_path())];
    let (ok, text) = run_with(&venv.join("bin/st"), &args, &envs, &dir.path, RUN).await?;
    if !ok {
        bail!("schemathesis found differences between the document and the server\n{text}");
    }
    // Every phase that generates requests ran and passed, and no operation
    // was left out for a schema it could not read.
    for phase in ["✅ Coverage", "✅ Fuzzing", "✅ Stateful"] {
        ensure!(text.contains(phase), "no `{phase}` in the run\n{text}");
    }
    ensure!(!text.contains("Errored:"), "{text}");
    Ok(())
}

/// A file that calls submit, status and list tasks with the generated
/// types: the names and types it takes from them are the ones a client
/// relies on.
const USE_TS: &str = r#"
import createClient from "openapi-fetch";
import type { components, paths } from "./dtq";

type TaskStatus = components["schemas"]["TaskStatus"];

const client = createClient<paths>({
  baseUrl: "http://127.0.0.1:8080",
  headers: { Authorization: "Bearer token" },
});

export async function submitAndRead(queue: string): Promise<TaskStatus | undefined> {
  const submitted = await client.POST("/v1/queues/{queue}/tasks", {
    params: { path: { queue } },
    body: { task: "echo", payload: { n: 1 }, idempotency_key: "k-1", max_attempts: 3 },
  });
  if (submitted.error) {
    const code: components["schemas"]["ErrorCode"] = submitted.error.error.code;
    throw new Error(`${code}: ${submitted.error.error.message}`);
  }
  const id: string = submitted.data.task_id;
  const duplicate: boolean = submitted.data.duplicate;
  const task = await client.GET("/v1/queues/{queue}/tasks/{id}", {
    params: { path: { queue, id } },
  });
  if (task.error) {
    throw new Error(task.error.error.message);
  }
  const attempts: number = task.data.attempts;
  const result: unknown = task.data.result;
  console.log(duplicate, attempts, result);
  return task.data.status;
}

export async function listQueued(queue: string): Promise<string[]> {
  const status: TaskStatus = "QUEUED";
  const page = await client.GET("/v1/queues/{queue}/tasks", {
    params: { path: { queue }, query: { status, limit: 10 } },
  });
  if (page.error) {
    throw new Error(page.error.error.message);
  }
  const next: string | null | undefined = page.data.next_cursor;
  console.log(next);
  return page.data.tasks.map((t) => t.task_id);
}
"#;

/// The same calls with a field the submission's answer does not have: the
/// types must refuse it, or they check nothing.
const WRONG_TS: &str = r#"
import createClient from "openapi-fetch";
import type { paths } from "./dtq";

const client = createClient<paths>({ baseUrl: "http://127.0.0.1:8080" });

export async function wrong(): Promise<string> {
  const submitted = await client.POST("/v1/queues/{queue}/tasks", {
    params: { path: { queue: "default" } },
    body: { task: "echo", payload: {} },
  });
  if (submitted.error) {
    throw new Error("refused");
  }
  return submitted.data.no_such_field;
}
"#;

#[tokio::test]
async fn a_typescript_client_generated_from_the_document_type_checks() -> Result<()> {
    let tokens = format!("{TOKEN} *");
    let dtq = Dtq::start(false, &["--tokens", &tokens]).await?;
    let doc = document(&dtq).await?;
    let dir = TempDir::new("openapi-typescript")?;
    let path = &dir.path;
    std::fs::write(path.join("dtq.json"), serde_json::to_vec_pretty(&doc)?)?;
    std::fs::write(
        path.join("package.json"),
        r#"{"private": true, "type": "module"}"#,
    )?;
    let npm: &Path = "npm".as_ref();
    let mut install = vec!["install", "--no-audit", "--no-fund", "--silent"];
    install.extend(NPM_PACKAGES);
    run_ok(npm, &install, path, INSTALL).await?;
    let bin = path.join("node_modules/.bin");
    run_ok(
        &bin.join("openapi-typescript"),
        &["dtq.json", "--output", "dtq.ts"],
        path,
        RUN,
    )
    .await?;
    std::fs::write(path.join("use.ts"), USE_TS)?;
    std::fs::write(path.join("wrong.ts"), WRONG_TS)?;
    let tsc = bin.join("tsc");
    let check = |file: &'static str| {
        [
            "--noEmit",
            "--strict",
            "--target",
            "es2022",
            "--module",
            "esnext",
            "--moduleResolution",
            "bundler",
            "--skipLibCheck",
            file,
        ]
    };
    run_ok(&tsc, &check("use.ts"), path, RUN).await?;
    let (ok, text) = run(&tsc, &check("wrong.ts"), path, RUN).await?;
    ensure!(
        !ok && text.contains("no_such_field"),
        "tsc took a field the document does not give: the generated types check nothing\n{text}"
    );
    Ok(())
}
