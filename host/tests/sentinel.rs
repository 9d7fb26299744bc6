//! dtq on Redis behind Sentinel (`--redis redis+sentinel://…`): a master, a
//! replica and a Sentinel, real processes, and a `dtq serve` that follows
//! a failover forced in the middle of a run without a restart. Tasks
//! submitted before, during and after the failover all succeed, none is
//! lost, and an idempotency key used before it still names its task.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_tests::process::{DtqProcess, dtq_command};
use dtq_tests::{ApiClient, TempDir, free_port, guests};
use serde_json::json;

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The name the Sentinel knows the master by.
const MASTER: &str = "dtqmaster";

/// Longest wait for a step of the failover, or a task to end.
const WAIT: Duration = Duration::from_secs(60);

/// A `redis-server` process (a server or a Sentinel), killed on drop.
struct Node {
    child: Child,
    port: u16,
    _dir: TempDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    /// `redis-server` on a free port with `args`; for a Sentinel, `conf`
    /// is its configuration file's text (Sentinel rewrites the file).
    fn start(name: &str, args: &[String], conf: Option<String>) -> Result<Node> {
        let dir = TempDir::new(name)?;
        let port = free_port()?;
        let mut cmd = Command::new("redis-server");
        if let Some(conf) = conf {
            let path = dir.path.join("sentinel.conf");
            std::fs::write(&path, format!("port {port}\nbind 127.0.0.1\n{conf}"))?;
            cmd.arg(&path).arg("--sentinel");
        } else {
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&dir.path)
                .args(args);
        }
        let log = std::fs::File::create(dir.path.join("log"))?;
        let child = cmd
            .stdout(log.try_clone()?)
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .context("redis-server")?;
        Ok(Node {
            child,
            port,
            _dir: dir,
        })
    }

    async fn conn(&self) -> Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}/", self.port))?;
        Ok(client.get_multiplexed_async_connection().await?)
    }

    /// Run `cmd` until `ok` holds of its reply, or fail after [`WAIT`].
    async fn until<T: redis::FromRedisValue>(
        &self,
        what: &str,
        cmd: &redis::Cmd,
        ok: impl Fn(&T) -> bool,
    ) -> Result<T> {
        let start = Instant::now();
        loop {
            if let Ok(mut conn) = self.conn().await
                && let Ok(reply) = cmd.query_async::<T>(&mut conn).await
                && ok(&reply)
            {
                return Ok(reply);
            }
            ensure!(start.elapsed() < WAIT, "{what}: not within {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The port the Sentinel names as the master's.
fn master_port(cmd: &mut redis::Cmd) -> &mut redis::Cmd {
    cmd.arg("GET-MASTER-ADDR-BY-NAME").arg(MASTER)
}

/// Submit `n` tasks of `task` with `payload`, keyed `<prefix>-<i>`; a 503
/// (Redis unreachable for the moment) is tried again, as a client would.
async fn submit_all(
    api: &ApiClient,
    prefix: &str,
    n: usize,
    task: &str,
    payload: serde_json::Value,
) -> Result<Vec<String>> {
    let mut ids = Vec::new();
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        let start = Instant::now();
        loop {
            let body = json!({"task": task, "payload": payload});
            let (status, answer) = api.submit("default", body, Some(&key)).await?;
            if status == 202 {
                ids.push(answer["task_id"].as_str().context("task_id")?.to_owned());
                break;
            }
            if status != 503 || start.elapsed() > WAIT {
                bail!("submission {key}: {status} {answer}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(ids)
}

/// Wait until every task of `ids` has SUCCEEDED; a read that fails for the
/// moment is tried again.
async fn all_succeed(api: &ApiClient, ids: &[String]) -> Result<()> {
    for id in ids {
        let start = Instant::now();
        loop {
            match api.task("default", id).await {
                Ok(task) if task["status"] == "SUCCEEDED" => break,
                Ok(task) if start.elapsed() > WAIT => bail!("task {id}: {task:#}"),
                Err(e) if start.elapsed() > WAIT => return Err(e),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    Ok(())
}

fn serve(dir: &Path, sentinel: &Node) -> Result<(DtqProcess, ApiClient)> {
    let port = free_port()?;
    let url = format!("redis+sentinel://127.0.0.1:{}/{MASTER}", sentinel.port);
    let mut cmd = dtq_command(DTQ);
    cmd.arg("serve")
        .args(["--redis", &url])
        .args(["--handlers", guests::EXAMPLES_DIR])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--visibility-timeout-ms", "1000"])
        .args(["--retry-base-ms", "20", "--retry-max-ms", "100"])
        .arg("--cache-dir")
        .arg(std::env::temp_dir().join("dtq-test-artifact-cache"));
    let api = format!("http://127.0.0.1:{port}");
    let process = DtqProcess::spawn("serve", cmd, dir.join("serve.log"), api.clone())?;
    Ok((process, ApiClient::new(api)))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failover_behind_sentinel_is_followed_and_loses_no_task() -> Result<()> {
    let master = Node::start("sentinel-master", &[], None)?;
    let replica = Node::start(
        "sentinel-replica",
        &["--replicaof".into(), format!("127.0.0.1 {}", master.port)],
        None,
    )?;
    let sentinel = Node::start(
        "sentinel",
        &[],
        Some(format!(
            "sentinel monitor {MASTER} 127.0.0.1 {} 1\n\
             sentinel down-after-milliseconds {MASTER} 1000\n\
             sentinel failover-timeout {MASTER} 10000\n",
            master.port
        )),
    )?;
    replica
        .until::<String>(
            "the replica links up",
            redis::cmd("INFO").arg("replication"),
            |i| i.contains("master_link_status:up"),
        )
        .await?;
    // A manual failover needs a replica the Sentinel knows of (it learns
    // of them from the master's INFO, every ten seconds).
    sentinel
        .until::<Vec<redis::Value>>(
            "the Sentinel knows the replica",
            redis::cmd("SENTINEL").arg("REPLICAS").arg(MASTER),
            |r| !r.is_empty(),
        )
        .await?;

    let dir = TempDir::new("sentinel")?;
    let (mut dtq, api) = serve(&dir.path, &sentinel)?;
    dtq.wait_healthy(Duration::from_secs(120)).await?;

    let before = submit_all(&api, "before", 10, "echo", json!({"n": 1})).await?;
    all_succeed(&api, &before).await?;
    // Running while the master changes.
    let during = submit_all(&api, "during", 10, "sleep", json!({"ms": 200})).await?;
    let _: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5_000)
        .query_async(&mut master.conn().await?)
        .await?;
    let _: String = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(MASTER)
        .query_async(&mut sentinel.conn().await?)
        .await?;
    let new_port = replica.port.to_string();
    sentinel
        .until::<Vec<String>>(
            "the Sentinel names the replica",
            master_port(&mut redis::cmd("SENTINEL")),
            |addr| addr.get(1) == Some(&new_port),
        )
        .await?;

    // The old master comes back as the new one's replica: from then on a
    // write there is refused (READONLY), and only following the move
    // keeps dtq writing.
    master
        .until::<String>(
            "the old master follows the new",
            redis::cmd("INFO").arg("replication"),
            |i| i.contains("role:slave") && i.contains("master_link_status:up"),
        )
        .await?;
    let after = submit_all(&api, "after", 10, "echo", json!({"n": 2})).await?;
    all_succeed(&api, &during).await?;
    all_succeed(&api, &after).await?;
    all_succeed(&api, &before).await?;
    // The keys of before the failover still name their tasks.
    let (status, replay) = api
        .submit(
            "default",
            json!({"task": "echo", "payload": {"n": 1}}),
            Some("before-0"),
        )
        .await?;
    ensure!(
        status == 200 && replay["duplicate"] == true && replay["task_id"] == before[0].as_str(),
        "the replay of before-0: {status} {replay}"
    );
    // The process followed the move, rather than the old master coming back.
    ensure!(
        dtq.log_text()
            .contains("the Sentinels name a new Redis master"),
        "no log line of the move:\n{}",
        dtq.log_text()
    );
    Ok(())
}
