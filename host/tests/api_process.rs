//! The `dtq api` process under a low file-descriptor limit (issue 10): an
//! API that could open only a few dozen descriptors became unreachable
//! under 148 idle connections, because it accepted until `accept` failed
//! with EMFILE and never closed an idle connection. With the connection cap
//! (at most half the soft `RLIMIT_NOFILE`) and the header timeout, idle
//! connections wait their turn and are cut off, and a new client is served.
//!
//! The process runs with its default API settings: nothing here needs a
//! flag, since the cap follows the descriptor limit by itself.

use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use dtq_tests::process::{DtqProcess, dtq_command};
use dtq_tests::{RedisServer, TempDir, free_port};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The soft descriptor limit the API process runs under.
const FD_LIMIT: libc::rlim_t = 64;

/// The connection cap that limit gives: half of it.
const CAP: u32 = (FD_LIMIT / 2) as u32;

/// Idle connections opened against it: more than the process has
/// descriptors left for once its own are open.
const IDLE: u32 = 60;

/// The default header timeout (`--api-header-timeout-ms`), which cuts off
/// an idle connection.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Scheduling slack on top of the design's bound.
const SLACK: Duration = Duration::from_secs(3);

/// Start `dtq api` on `port` with a soft `RLIMIT_NOFILE` of `FD_LIMIT`.
fn start_api(dir: &TempDir, redis: &RedisServer, port: u16) -> Result<DtqProcess> {
    let log = dir.path.join("api.log");
    let mut cmd = dtq_command(DTQ);
    cmd.arg("api")
        .args(["--redis", &redis.url()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--handlers")
        .arg(&dir.path);
    // SAFETY: the closure runs in the forked child before exec and calls
    // only getrlimit(2) and setrlimit(2), which are async-signal-safe, on a
    // local `rlimit`; it allocates nothing and takes no lock.
    unsafe {
        cmd.pre_exec(|| {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            limit.rlim_cur = FD_LIMIT;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    DtqProcess::spawn("api", cmd, log, format!("http://127.0.0.1:{port}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_low_fd_limit_idle_connections_do_not_make_the_api_unreachable() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("api-process")?;
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let mut api = start_api(&dir, &redis, port)?;
    api.wait_healthy(Duration::from_secs(60)).await?;
    let log = api.log_text();
    ensure!(
        log.contains("connection cap lowered") && log.contains("cap=32"),
        "the cap did not follow the descriptor limit:\n{log}"
    );
    ensure!(
        log.contains("the API is open"),
        "no warning that the API is open:\n{log}"
    );

    let mut idle = Vec::new();
    for _ in 0..IDLE {
        idle.push(TcpStream::connect(("127.0.0.1", port)).await?);
    }
    // The backlog is served in order, CAP at a time, each batch of idle
    // connections cut off by the header timeout.
    let design = HEADER_TIMEOUT * IDLE.div_ceil(CAP);
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .get(format!("{base}/healthz"))
        .timeout(design + SLACK)
        .send()
        .await
        .with_context(|| {
            format!(
                "a new client was not answered within {:?}:\n{}",
                design + SLACK,
                api.log_text()
            )
        })?;
    ensure!(resp.status() == 200, "{}", resp.status());
    let waited = started.elapsed();
    // Every idle connection is closed by the server in the end.
    let mut buf = [0u8; 64];
    for mut conn in idle {
        let closed = tokio::time::timeout(design + SLACK, conn.read(&mut buf)).await;
        ensure!(
            matches!(closed, Ok(Ok(0) | Err(_))),
            "an idle connection was kept open"
        );
    }
    ensure!(
        api.exit_status()?.is_none(),
        "dtq api exited:\n{}",
        api.log_text()
    );
    eprintln!("new client answered after {waited:?} behind {IDLE} idle connections");
    Ok(())
}
