//! An idle worker's wake-up is one round trip: the read it waits in is the
//! read that delivers the message (`worker/fetch.rs`).
//!
//! The test watches the server with `MONITOR`, which lists every command in
//! the order the server ran them, with the client that sent it. It waits
//! until the worker is blocked in its wait, submits one task, and looks at
//! the reads the worker made from that wait until the task's completion:
//! the wait itself must be the one `XREADGROUP`, with no `XREAD` (which
//! delivers nothing, so a second read must follow it) and no `XINFO`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use dtq_tests::Dtq;
use serde_json::json;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;

/// One command as `MONITOR` shows it.
#[derive(Debug, Clone)]
struct Seen {
    /// `ip:port` of the client that sent it, or `lua` inside a script.
    client: String,
    /// The command's name, upper case.
    name: String,
    /// The whole line, for matching arguments and for failure messages.
    line: String,
}

impl Seen {
    /// Parse `+<time> [<db> <client>] "NAME" "arg" ...`.
    fn parse(line: &str) -> Option<Seen> {
        let open = line.find('[')?;
        let close = open + line[open..].find(']')?;
        let client = line[open + 1..close].split_whitespace().nth(1)?.to_owned();
        let name = line[close + 1..].trim_start().strip_prefix('"')?;
        let name = name[..name.find('"')?].to_ascii_uppercase();
        Some(Seen {
            client,
            name,
            line: line.to_owned(),
        })
    }

    fn is_read(&self) -> bool {
        matches!(self.name.as_str(), "XREAD" | "XREADGROUP" | "XINFO")
    }

    fn is_blocking_read(&self) -> bool {
        matches!(self.name.as_str(), "XREAD" | "XREADGROUP") && self.line.contains("\"BLOCK\"")
    }
}

/// Every command the server at `port` runs from now on, as they come.
async fn monitor(port: u16) -> Result<Arc<Mutex<Vec<Seen>>>> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    stream.write_all(b"MONITOR\r\n").await?;
    let mut lines = BufReader::new(stream).lines();
    let ok = lines.next_line().await?.context("MONITOR closed")?;
    ensure!(ok == "+OK", "MONITOR answered {ok:?}");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let into = seen.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(s) = Seen::parse(&line) {
                into.lock().expect("not poisoned").push(s);
            }
        }
    });
    Ok(seen)
}

fn snapshot(seen: &Mutex<Vec<Seen>>) -> Vec<Seen> {
    seen.lock().expect("not poisoned").clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_worker_wakes_with_the_read_that_delivers() -> Result<()> {
    // One slot: while the task runs and its completion is written, the
    // fetch loop has no slot to read with, so the reads up to the
    // completion are the wake-up alone.
    let dtq = Dtq::start(true, &["--queues", "w", "--concurrency", "1"]).await?;
    if dtq.redis.is_cluster() {
        // MONITOR watches one server; on a cluster the wait is per queue
        // (see `worker/fetch.rs`).
        return Ok(());
    }
    let seen = monitor(dtq.redis.single().port()).await?;

    // Settle: the worker is blocked in a wait begun just now (far from its
    // end, so that it does not time out around the submission).
    let start = Instant::now();
    let mut looked = 0;
    loop {
        let now = snapshot(&seen);
        if now[looked..].iter().any(Seen::is_blocking_read) {
            break;
        }
        looked = now.len();
        if start.elapsed() > Duration::from_secs(20) {
            bail!("the worker never waited in a blocking read: {now:#?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let id = dtq
        .submit_new("w", json!({"task": "echo", "payload": "wake"}), None)
        .await?;
    // Wait for the completion script to write the task's status, as
    // MONITOR shows it (no polling through the API meanwhile: its reads
    // name the task too).
    let start = Instant::now();
    let seen = loop {
        let now = snapshot(&seen);
        let done =
            |s: &Seen| s.client == "lua" && s.line.contains(&id) && s.line.contains("SUCCEEDED");
        if now.iter().any(done) {
            break now;
        }
        if start.elapsed() > Duration::from_secs(20) {
            bail!("the task was never completed: {now:#?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let task = dtq.task("w", &id).await?;
    assert_eq!(task["status"], "SUCCEEDED", "{task}");

    // The submission: the first command naming the task, from the API.
    let submit = seen
        .iter()
        .position(|s| s.client != "lua" && s.line.contains(&id))
        .context("no submission seen")?;
    let submitter = seen[submit].client.clone();
    // The completion: the next command naming it, from another client.
    let completion = submit
        + seen[submit..]
            .iter()
            .position(|s| s.client != "lua" && s.client != submitter && s.line.contains(&id))
            .context("no completion seen")?;
    // The wait the task arrived in: the last blocking read before it.
    let wait = seen[..submit]
        .iter()
        .rposition(Seen::is_blocking_read)
        .context("no wait before the submission")?;
    let wake_up: Vec<&Seen> = seen[wait..completion]
        .iter()
        .filter(|s| s.is_read())
        .collect();
    let names: Vec<&str> = wake_up.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["XREADGROUP"],
        "the wake-up took these reads:\n{}",
        wake_up
            .iter()
            .map(|s| s.line.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    Ok(())
}
