//! The sandbox's flags: what one handler call may use, where compiled
//! modules are cached, and what the operator grants the handlers of the
//! `--handlers` directory (namespaces, hosts).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{ConfigError, SubmitConfig, at_least};
use crate::sandbox::{AllowList, HandlerSettings, Limits, SandboxConfig, SubmitGrants};

/// What handler calls run by: the sandbox's flags.
#[derive(Debug, Clone, Args)]
pub struct GuestConfig {
    /// Linear memory one handler call may use, MiB.
    #[arg(long, env = "DTQ_MEMORY_MIB", default_value_t = 64)]
    pub memory_mib: usize,

    /// Fuel (roughly, wasm instructions) per call; unset is unlimited (the
    /// deadline still applies).
    #[arg(long, env = "DTQ_FUEL")]
    pub fuel: Option<u64>,

    /// Where compiled handler modules are cached. Default:
    /// `$XDG_CACHE_HOME/dtq`, else `~/.cache/dtq`.
    #[arg(long, env = "DTQ_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,

    /// Run TASK's handler in namespace NS instead of its task name: its kv
    /// keys and idempotency claims live under NS, so handlers given one
    /// namespace share them. Repeatable, or comma-separated in the
    /// variable. A component that asks for a namespace
    /// (`handler!(f, namespace = "NS")`) is loaded only when given exactly
    /// that one here.
    #[arg(
        long = "namespace",
        env = "DTQ_NAMESPACES",
        value_name = "TASK=NS",
        value_delimiter = ',',
        value_parser = parse_namespace
    )]
    pub namespaces: Vec<(String, String)>,

    /// Bytes (MiB) each handler namespace may be charged in Redis: its kv
    /// keys and idempotency claims (names, values, kept results, plus a
    /// fixed overhead per key and per claim; see docs/sandbox.md). A write
    /// past it gets the error `quota-exceeded` and writes nothing, so no
    /// tenant can fill Redis. 0: no budget.
    #[arg(long, env = "DTQ_KV_QUOTA_MIB", default_value_t = 256)]
    pub kv_quota_mib: u64,

    /// A file holding the fleet's secret (at least 32 bytes, e.g. `head -c
    /// 32 /dev/urandom | base64`), which keys the Idempotency-Key handlers'
    /// requests carry downstream, so that no handler can compute another's.
    /// Give every process of the fleet the same file. Without it, dtq makes
    /// one once, in Redis.
    #[arg(long, env = "DTQ_FLEET_SECRET_FILE", value_name = "FILE")]
    pub fleet_secret_file: Option<PathBuf>,

    /// Let TASK's handler send HTTP requests to hosts matching PATTERN
    /// (`scheme://host[:port]`: `https://api.example.com`,
    /// `https://*.example.com`, `http://127.0.0.1:*`). Repeatable, or
    /// comma-separated in the variable. For handlers of the --handlers
    /// directory; a deployed handler has its own (`dtq deploy
    /// --allow-hosts`). Without one, a handler reaches no host.
    #[arg(
        long = "allow-host",
        env = "DTQ_ALLOW_HOSTS",
        value_name = "TASK=PATTERN",
        value_delimiter = ',',
        value_parser = parse_allow_host
    )]
    pub allow_hosts: Vec<(String, String)>,

    /// Let TASK's handler submit tasks (flows, `dtq_guest::tasks`) to
    /// QUEUE: any task there, or only the TASKs named after it
    /// (`--submit-to fan_out=default:square`). Repeatable, or
    /// comma-separated in the variable. For handlers of the --handlers
    /// directory; a deployed handler has its own (`dtq deploy
    /// --submit-to`). Without one, a handler may submit nothing.
    #[arg(
        long = "submit-to",
        env = "DTQ_SUBMIT_TO",
        value_name = "TASK=QUEUE[:TASK...]",
        value_delimiter = ',',
        value_parser = parse_submit_to
    )]
    pub submit_to: Vec<(String, SubmitGrants)>,

    /// Longest an outbound HTTP request of a handler may take (ms); the
    /// task's remaining deadline caps it too.
    #[arg(long, env = "DTQ_HTTP_TIMEOUT_MS", default_value_t = 10_000)]
    pub http_timeout_ms: u64,

    /// Largest response body a handler's HTTP request may read, bytes.
    #[arg(long, env = "DTQ_HTTP_MAX_RESPONSE_BYTES", default_value_t = 4 << 20)]
    pub http_max_response_bytes: usize,

    /// HTTP requests one attempt of a handler may send.
    #[arg(long, env = "DTQ_HTTP_MAX_REQUESTS", default_value_t = 100)]
    pub http_max_requests: u64,
}

/// `TASK=PATTERN`, the pattern checked.
fn parse_allow_host(text: &str) -> Result<(String, String), String> {
    let (task, pattern) = text
        .split_once('=')
        .filter(|(task, pattern)| !task.is_empty() && !pattern.is_empty())
        .ok_or_else(|| format!("{text:?} is not TASK=PATTERN"))?;
    AllowList::parse(pattern).map_err(|e| e.to_string())?;
    Ok((task.to_string(), pattern.to_string()))
}

/// `TASK=QUEUE[:TASK...]`, the grant checked.
fn parse_submit_to(text: &str) -> Result<(String, SubmitGrants), String> {
    let (task, grant) = text
        .split_once('=')
        .filter(|(task, grant)| !task.is_empty() && !grant.is_empty())
        .ok_or_else(|| format!("{text:?} is not TASK=QUEUE[:TASK...]"))?;
    Ok((task.to_string(), SubmitGrants::parse(grant)?))
}

/// `TASK=NS`.
fn parse_namespace(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((task, ns)) if !task.is_empty() && !ns.is_empty() => {
            Ok((task.to_string(), ns.to_string()))
        }
        _ => Err(format!("{text:?} is not TASK=NAMESPACE")),
    }
}

impl GuestConfig {
    /// The sandbox's configuration: limits from these flags and the
    /// submission's (a call's deadline, its payload and result), the
    /// artifact cache at `--cache-dir` or its default place, and a pool of
    /// `slots` calls.
    pub fn sandbox_config(&self, submit: &SubmitConfig, slots: usize) -> SandboxConfig {
        let limits = Limits {
            deadline: Duration::from_millis(submit.task_timeout_ms),
            memory_bytes: self.memory_mib << 20,
            fuel: self.fuel,
            max_payload_bytes: submit.max_payload_bytes,
            max_result_bytes: submit.max_payload_bytes,
            // Room for a whole result or value, so their own limits answer.
            kv_quota_bytes: self.kv_quota_mib.saturating_mul(1 << 20),
            max_hostcall_bytes: Limits::default()
                .max_hostcall_bytes
                .max(submit.max_payload_bytes.saturating_add(1 << 20)),
            http_timeout: Duration::from_millis(self.http_timeout_ms),
            max_http_response_bytes: self.http_max_response_bytes,
            max_http_requests: self.http_max_requests,
            ..Limits::default()
        };
        SandboxConfig {
            limits,
            cache_dir: self
                .cache_dir
                .clone()
                .or_else(SandboxConfig::default_cache_dir),
            max_concurrent_calls: slots as u32,
            handlers: self.handler_settings(),
            fleet_secret_file: self.fleet_secret_file.clone(),
            ..SandboxConfig::default()
        }
    }

    /// The settings of the handlers of the --handlers directory, from
    /// `--namespace`, `--allow-host` and `--submit-to`, by task.
    fn handler_settings(&self) -> HashMap<String, HandlerSettings> {
        let mut settings: HashMap<String, HandlerSettings> = HashMap::new();
        for (task, namespace) in &self.namespaces {
            settings.entry(task.clone()).or_default().namespace = Some(namespace.clone());
        }
        for (task, pattern) in &self.allow_hosts {
            // Checked when parsed.
            if let Ok(list) = AllowList::parse(pattern) {
                settings
                    .entry(task.clone())
                    .or_default()
                    .allow_hosts
                    .extend(list);
            }
        }
        for (task, grants) in &self.submit_to {
            settings
                .entry(task.clone())
                .or_default()
                .submit_to
                .extend(grants);
        }
        settings
    }

    /// Check the values clap cannot.
    pub fn check(&self) -> Result<(), ConfigError> {
        at_least("--http-timeout-ms", 1, self.http_timeout_ms)
    }
}
