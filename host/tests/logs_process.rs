//! `--log-format json` (issue 13): a real `dtq serve` writes one JSON
//! object per line to stderr, from start to shutdown, each with its
//! timestamp, level, target and message, and the warning of a failed
//! attempt names its task.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use dtq_tests::process::{DtqProcess, dtq_command};
use dtq_tests::{ApiClient, RedisServer, TempDir, free_port, guests};
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_are_one_object_per_line_with_the_task_fields() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("logs-process")?;
    let port = free_port()?;
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    let mut cmd = dtq_command(DTQ);
    cmd.arg("serve")
        .args(["--redis", &redis.url()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--retry-base-ms", "20", "--retry-max-ms", "100"])
        .args(["--log-format", "json"])
        .arg("--handlers")
        .arg(guests::EXAMPLES_DIR)
        .arg("--cache-dir")
        .arg(&cache);
    let log = dir.path.join("serve.log");
    let mut serve = DtqProcess::spawn("serve", cmd, log, format!("http://127.0.0.1:{port}"))?;
    serve.wait_healthy(Duration::from_secs(60)).await?;

    // A task whose first attempt fails: a warning.
    let api = ApiClient::new(serve.api.clone());
    let body = json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 3});
    let id = api.submit_new("default", body, None).await?;
    api.wait_for("default", &id, &["SUCCEEDED"], Duration::from_secs(30))
        .await?;
    serve.signal(libc::SIGTERM)?;
    let status = serve.wait_exit(Duration::from_secs(30)).await?;
    ensure!(status.success(), "exited with {status}");

    // Every line (stdout and stderr both go to the log) is an object with
    // the four fields.
    let text = serve.log_text();
    let mut lines = Vec::new();
    for line in text.lines() {
        let value: Value =
            serde_json::from_str(line).with_context(|| format!("not JSON: {line:?}"))?;
        let timestamp = value["timestamp"].as_str().unwrap_or_default();
        ensure!(
            timestamp.len() >= 20 && timestamp.contains('T') && timestamp.ends_with('Z'),
            "timestamp: {line}"
        );
        ensure!(
            ["TRACE", "DEBUG", "INFO", "WARN", "ERROR"]
                .contains(&value["level"].as_str().unwrap_or_default()),
            "level: {line}"
        );
        ensure!(
            value["target"]
                .as_str()
                .is_some_and(|t| t.starts_with("dtq")),
            "target: {line}"
        );
        ensure!(
            value["message"].as_str().is_some_and(|m| !m.is_empty()),
            "message: {line}"
        );
        lines.push(value);
    }
    for message in ["worker started", "API listening", "worker stopped"] {
        ensure!(
            lines.iter().any(|l| l["message"] == message),
            "no {message:?} in:\n{text}"
        );
    }

    // The failed attempt, with its task's fields among its own (the task's
    // span is at debug level, so not in these logs).
    let failed = lines
        .iter()
        .find(|l| l["message"] == "attempt failed")
        .with_context(|| format!("no failed attempt in:\n{text}"))?;
    ensure!(failed["level"] == "WARN", "{failed}");
    ensure!(
        failed["error"]
            .as_str()
            .is_some_and(|e| e.contains("fails on purpose")),
        "{failed}"
    );
    ensure!(
        failed["task_id"] == id.as_str()
            && failed["queue"] == "default"
            && failed["task"] == "flaky"
            && failed["attempt"] == 1,
        "{failed}"
    );
    Ok(())
}
