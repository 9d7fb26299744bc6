//! Shared harness for dtq's integration tests.
//!
//! Every test talks to a real `redis-server` that it starts itself on a free
//! loopback port ([`RedisServer::start`]) and runs real guest components that
//! `build.rs` compiled from source ([`guests`]). Nothing here mocks Redis.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Paths of the guest components `build.rs` compiled for this test run.
pub mod guests {
    include!(concat!(env!("OUT_DIR"), "/guests.rs"));
}

/// A `redis-server` child process on a free loopback port, killed on drop.
///
/// Each test gets its own server, so tests never share keys and never need to
/// flush anything.
pub struct RedisServer {
    child: Child,
    port: u16,
    _dir: TempDir,
}

impl RedisServer {
    /// Start a fresh `redis-server` with no persistence and wait until it
    /// answers `PING`.
    ///
    /// A missing `redis-server` binary is an error that says how to install it,
    /// never a silently skipped test.
    pub fn start() -> Result<Self> {
        let mut last_err = None;
        // A port free when probed may be taken before redis binds it, so a
        // failed start is retried on another port.
        for _ in 0..5 {
            let dir = TempDir::new("redis")?;
            let port = free_port()?;
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string()])
                .args(["--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&dir.path)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context(
                    "cannot run `redis-server`: install it (Debian: `apt-get install redis-server`) \
                     or run the tests through .ci/run, which installs it",
                )?;
            let mut server = RedisServer { child, port, _dir: dir };
            match server.wait_ready(Duration::from_secs(10)) {
                Ok(()) => return Ok(server),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("redis-server did not start")))
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("redis-server exited early with {status}");
            }
            if let Ok(client) = redis::Client::open(self.url()) {
                if let Ok(mut conn) = client.get_connection() {
                    if redis::cmd("PING").query::<String>(&mut conn).is_ok() {
                        return Ok(());
                    }
                }
            }
            if start.elapsed() > timeout {
                bail!("redis-server on port {} did not answer PING within {timeout:?}", self.port);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A fresh multiplexed async connection.
    pub async fn conn(&self) -> Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(self.url())?;
        Ok(client.get_multiplexed_async_connection().await?)
    }

    /// A connection manager (reconnects by itself), as the host uses.
    pub async fn manager(&self) -> Result<redis::aio::ConnectionManager> {
        let client = redis::Client::open(self.url())?;
        Ok(redis::aio::ConnectionManager::new(client).await?)
    }

    /// Every key in the server, sorted; tests use it to prove where writes landed.
    pub async fn keys(&self) -> Result<Vec<String>> {
        let mut conn = self.conn().await?;
        let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await?;
        keys.sort();
        Ok(keys)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free TCP port on 127.0.0.1, as the OS hands it out for port 0.
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// A temporary directory removed on drop.
pub struct TempDir {
    /// The directory's path.
    pub path: PathBuf,
}

impl TempDir {
    /// Create a new, empty, uniquely named directory under the system temp dir.
    pub fn new(prefix: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(format!("dtq-{prefix}-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(TempDir { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
