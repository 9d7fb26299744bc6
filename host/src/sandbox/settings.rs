//! How a sandbox is set up, and what the operator decides for each
//! handler.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use super::{AllowList, Limits, SandboxError};
#[cfg(doc)]
use super::{FLEET_SECRET_KEY, Sandbox, SlotReset};

/// How a [`Sandbox`] is set up.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// The limits every call runs under.
    pub limits: Limits,
    /// Where compiled artifacts are cached; `None` disables the cache (every
    /// load compiles). [`SandboxConfig::default_cache_dir`] gives the usual
    /// place.
    pub cache_dir: Option<PathBuf>,
    /// How often the epoch advances. Default 10 ms.
    ///
    /// Deadline and cancellation are noticed within about one tick of
    /// running wasm; a shorter tick reacts faster and costs a little more.
    pub epoch_tick: Duration,
    /// Calls that may run at once. Default 64.
    ///
    /// Sizes the pooling allocator (its slots are reserved up front); more
    /// concurrent calls wait for a free slot.
    pub max_concurrent_calls: u32,
    /// The operator's settings of each task's handler, by task name; a task
    /// without an entry gets [`HandlerSettings::default`].
    pub handlers: HashMap<String, HandlerSettings>,
    /// Reset pool slots between calls with `madvise` even where the faster
    /// `PAGEMAP_SCAN` reset would be used ([`SlotReset`]): about 3× the
    /// cost per call, and no memory kept resident between calls. Default
    /// false.
    pub madvise_slot_reset: bool,
    /// The operator's fleet secret, which keys the `Idempotency-Key`s
    /// handlers' requests carry downstream: a file of at least 32 bytes,
    /// the same for every process of the fleet. Default `None`: the
    /// fleet's own, made once in Redis ([`FLEET_SECRET_KEY`]).
    pub fleet_secret_file: Option<PathBuf>,
    /// The cap of each queue's events stream where a handler's progress
    /// reports are also written as `PROGRESS` events; 0 (the default)
    /// writes none, the reports still reach the task's record. A server
    /// sets it from `--events` (`all` only).
    pub progress_events_max_len: u64,
}

/// What the operator decides for one task's handler, whatever its component
/// asks for. Each `None` takes the sandbox's [`Limits`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerSettings {
    /// The namespace its kv keys and idempotency claims live in; `None`:
    /// the task name. A component whose `dtq-namespace` section asks for
    /// another is refused at load.
    pub namespace: Option<String>,
    /// The namespace's kv budget in bytes; `None`:
    /// [`Limits::kv_quota_bytes`]. Handlers sharing a namespace share its
    /// budget; the value of the handler loaded last applies to its calls.
    pub kv_quota_bytes: Option<u64>,
    /// Linear memory one call may hold; at most [`Limits::memory_bytes`],
    /// which sizes the pool's slots: a handler asking for more cannot be
    /// loaded by this sandbox ([`SandboxError::Unsupported`]).
    pub memory_bytes: Option<usize>,
    /// Wall-clock deadline of one call, in place of [`Limits::deadline`]
    /// (longer or shorter). A task may still ask for less.
    pub deadline: Option<Duration>,
    /// Fuel per call. Needs a sandbox that meters fuel ([`Limits::fuel`]
    /// set); another cannot load the handler
    /// ([`SandboxError::Unsupported`]).
    pub fuel: Option<u64>,
    /// The hosts it may send HTTP requests to; none by default.
    pub allow_hosts: AllowList,
    /// The queues and tasks it may submit to (flows); none by default.
    pub submit_to: super::SubmitGrants,
}

impl HandlerSettings {
    /// The limits a handler with these settings runs under, from the
    /// sandbox's; an error when this sandbox cannot honour them.
    pub(super) fn limits(&self, base: &Limits) -> Result<Limits, SandboxError> {
        let mut limits = base.clone();
        if let Some(bytes) = self.memory_bytes {
            if bytes > base.memory_bytes {
                return Err(SandboxError::Unsupported(format!(
                    "the handler may use {} MiB of memory, but this worker's pool slots hold {} MiB \
                     (start it with --memory-mib {} or more)",
                    bytes >> 20,
                    base.memory_bytes >> 20,
                    bytes.div_ceil(1 << 20)
                )));
            }
            limits.memory_bytes = bytes;
        }
        if let Some(fuel) = self.fuel {
            if base.fuel.is_none() {
                return Err(SandboxError::Unsupported(
                    "the handler has a fuel budget, but this worker does not meter fuel \
                     (start it with --fuel)"
                        .into(),
                ));
            }
            limits.fuel = Some(fuel);
        }
        if let Some(deadline) = self.deadline {
            limits.deadline = deadline;
        }
        if let Some(bytes) = self.kv_quota_bytes {
            limits.kv_quota_bytes = bytes;
        }
        Ok(limits)
    }
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            limits: Limits::default(),
            cache_dir: None,
            epoch_tick: Duration::from_millis(10),
            max_concurrent_calls: 64,
            handlers: HashMap::new(),
            madvise_slot_reset: false,
            fleet_secret_file: None,
            progress_events_max_len: 0,
        }
    }
}

impl SandboxConfig {
    /// The conventional artifact cache directory: `$DTQ_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/dtq`, else `$HOME/.cache/dtq`; `None` if none of
    /// those is set.
    pub fn default_cache_dir() -> Option<PathBuf> {
        let env = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(dir) = env("DTQ_CACHE_DIR") {
            return Some(PathBuf::from(dir));
        }
        if let Some(dir) = env("XDG_CACHE_HOME") {
            return Some(PathBuf::from(dir).join("dtq"));
        }
        env("HOME").map(|home| PathBuf::from(home).join(".cache").join("dtq"))
    }
}
