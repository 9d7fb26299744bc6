//! Real `dtq` child processes, for the tests of the binary (`host/tests/`):
//! each writes its log to a file, is polled for readiness, and is killed
//! when dropped, however the test ends.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};

/// A `dtq` command (`bin`: the binary under test) with no `DTQ_*` variable
/// inherited from the environment, so only the flags a test passes
/// configure it.
pub fn dtq_command(bin: &str) -> Command {
    let mut cmd = Command::new(bin);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|n| n.starts_with("DTQ_")) {
            cmd.env_remove(name);
        }
    }
    cmd.env("DTQ_LOG", "info");
    cmd
}

/// A `dtq` server process, killed on drop.
pub struct DtqProcess {
    /// What the test calls it, in messages.
    pub name: String,
    child: Child,
    /// The file its stdout and stderr go to.
    pub log: PathBuf,
    /// `http://127.0.0.1:<port>` (meaningful for a process with an API).
    pub api: String,
    /// Set once the process is known to have exited.
    exited: Option<ExitStatus>,
    /// Print the log when dropped (shown only if the test fails, since the
    /// harness captures it); off for tests whose logs are too long.
    pub print_log_on_drop: bool,
}

impl DtqProcess {
    /// Spawn `cmd` with its output into `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf, api: String) -> Result<Self> {
        let out = File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
        Ok(DtqProcess {
            name: name.to_owned(),
            child,
            log,
            api,
            exited: None,
            print_log_on_drop: true,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything it has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The exit status, if the process has exited.
    pub fn exit_status(&mut self) -> Result<Option<ExitStatus>> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait()?;
        }
        Ok(self.exited)
    }

    /// Fail with the log if the process has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.exit_status()? {
            bail!(
                "{} exited early with {status}; its log:\n{}",
                self.name,
                self.log_text()
            );
        }
        Ok(())
    }

    /// Wait until `/healthz` answers 200; fail after `timeout` or if the
    /// process exits.
    pub async fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let http = reqwest::Client::new();
        let url = format!("{}/healthz", self.api);
        let start = Instant::now();
        loop {
            self.check_alive()?;
            if let Ok(resp) = http.get(&url).send().await
                && resp.status() == 200
            {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} did not answer {url} within {timeout:?}; its log:\n{}",
                    self.name,
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until the log contains `needle`; fail after `timeout` or if the
    /// process exits.
    pub async fn wait_log(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            self.check_alive()?;
            if self.log_text().contains(needle) {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} did not log {needle:?} within {timeout:?}; its log:\n{}",
                    self.name,
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Send `signal` to the process. It is reaped only in `crash`,
    /// `wait_exit` or on drop, so its pid is still its own.
    pub fn signal(&self, signal: libc::c_int) -> Result<()> {
        send_signal(self.pid(), signal)
    }

    /// SIGKILL: the process dies at once, as in a crash.
    pub fn crash(&mut self) -> Result<()> {
        self.child.kill()?;
        self.exited = Some(self.child.wait()?);
        Ok(())
    }

    /// Wait for the process to exit; fail after `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.exit_status()? {
                return Ok(status);
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} did not exit within {timeout:?}; its log:\n{}",
                    self.name,
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for DtqProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.print_log_on_drop {
            eprintln!(
                "--- log of {} ({}) ---\n{}",
                self.name,
                self.log.display(),
                self.log_text()
            );
        }
    }
}

/// A `dtq` client command of binary `bin` (`dtq submit ...`), as a script
/// runs it: no stdin, stdout and stderr piped, killed if dropped.
pub fn client_command(bin: &str, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::from(dtq_command(bin));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Run [`client_command`] to completion, within `within`.
pub async fn run_client(
    bin: &str,
    args: &[&str],
    within: Duration,
) -> Result<std::process::Output> {
    tokio::time::timeout(within, client_command(bin, args).output())
        .await
        .with_context(|| format!("dtq {args:?} did not finish within {within:?}"))?
        .with_context(|| format!("cannot run dtq {args:?}"))
}

/// `out`'s exit code is `want`; otherwise an error with its output.
pub fn expect_code(out: &std::process::Output, want: i32, what: &str) -> Result<()> {
    ensure!(
        out.status.code() == Some(want),
        "{what}: exit {:?}, want {want}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// `out`'s stdout as one JSON value.
pub fn stdout_json(out: &std::process::Output) -> Result<serde_json::Value> {
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "stdout is not one JSON value: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// `out`'s stderr as text.
pub fn stderr_text(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Send `signal` to process `pid`, a child of this process that has not
/// been reaped (so the pid cannot have been reused by another process).
pub fn send_signal(pid: u32, signal: libc::c_int) -> Result<()> {
    let pid = libc::pid_t::try_from(pid).context("pid fits pid_t")?;
    // SAFETY: kill(2) with a pid and a signal number; the caller's child
    // is not reaped, so the pid names it.
    let rc = unsafe { libc::kill(pid, signal) };
    ensure!(
        rc == 0,
        "kill({pid}, {signal}): {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}
