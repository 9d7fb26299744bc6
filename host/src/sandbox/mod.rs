//! The sandbox: runs task handlers, WebAssembly components built against
//! `wit/` (world `dtq:handler/handler`), in fresh, resource-limited
//! instances.
//!
//! # Lifecycle
//!
//! - **Once per process** ([`Sandbox::new`]): one wasmtime [`Engine`]
//!   (component model, async, pooling allocator sized from
//!   [`SandboxConfig`], epoch interruption, Cranelift at `speed`), the
//!   thread that advances its epoch every [`SandboxConfig::epoch_tick`], and
//!   one `Linker` holding WASI p2 and our imports.
//! - **Once per handler** ([`Sandbox::load`], [`Sandbox::load_dir`]): the
//!   module is compiled, or deserialized from the artifact cache
//!   (`cache.rs`), its namespace is decided (`namespace.rs`), and it is
//!   pre-instantiated (`InstancePre`): imports resolved and type-checked
//!   once.
//! - **Once per call** ([`Sandbox::call`]): a new `Store` and a new
//!   instance from a pool slot; nothing survives to the next call. Memory is
//!   reset copy-on-write from the module image, so instantiation costs
//!   microseconds.
//!
//! # Threat model
//!
//! A handler is untrusted code. Inside the sandbox it can reach only what the
//! WIT imports give it; each limit below stops one way of hurting the host,
//! Redis or other tasks (defaults in [`Limits`]):
//!
//! | threat | stopped by | outcome |
//! |---|---|---|
//! | infinite loop, slow code | [`Limits::deadline`]: epoch callback (in wasm) and a timer (in host imports) | [`Trap::DeadlineExceeded`] |
//! | allocation bomb | [`Limits::memory_bytes`] via a `ResourceLimiter` with our own error, pool slot size | [`Trap::OutOfMemory`] |
//! | `table.grow` bomb | [`Limits::table_elements`] | [`Limit::TableElements`] |
//! | unbounded recursion | [`Limits::stack_bytes`] (wasmtime's stack limit) | [`Trap::StackOverflow`] |
//! | instruction budget (deterministic) | [`Limits::fuel`], off by default | [`Limit::Fuel`] |
//! | huge payload / result | [`Limits::max_payload_bytes`] (checked before instantiating) / [`Limits::max_result_bytes`] | [`Limit::Payload`] / [`Limit::Result`] |
//! | log flooding | [`Limits::max_log_bytes`] | truncated with a marker, not a failure |
//! | progress flooding (a report in a tight loop, a huge message) | the call's latest report written at most every [`PROGRESS_WRITE_EVERY`], its message cut at [`MAX_PROGRESS_MESSAGE_BYTES`] (`progress.rs`) | coalesced and cut, not a failure |
//! | Redis flooding | [`Limits::max_host_calls`], [`Limits::max_key_bytes`], [`Limits::max_value_bytes`] | [`Limit::HostCalls`] trap; `invalid-key` / `value-too-large` WIT errors |
//! | reaching other keys | every key is a suffix of `dtq:guest:<namespace>:` | — |
//! | filling Redis through kv or claims | [`Limits::kv_quota_bytes`] charging keys, claims and kept results with their per-key overhead, [`Limits::max_live_claims`] (`quota.rs`) | `quota-exceeded`; nothing written |
//! | sending another namespace's downstream `Idempotency-Key` first | keys are HMAC-SHA256 under the fleet secret, and a guest's own key may not start with `dtq-` (`fleet_secret.rs`) | `HTTP-request-denied` |
//! | files, environment, raw network | WASI with no preopens, no env, no args, no sockets or name lookup | the WASI call fails |
//! | reaching hosts it should not (SSRF, cloud metadata) | outbound HTTP only through `wasi:http`, to the operator's [`AllowList`]; host names reach public addresses only, no redirects followed (`http.rs`) | `HTTP-request-denied`, `destination-IP-prohibited` |
//! | slow or huge responses, request floods | [`Limits::http_timeout`] (and the deadline), [`Limits::max_http_response_bytes`], [`Limits::max_http_requests`]; a handler's own smaller timeouts (`timeouts.rs`) | the request fails with its wasi:http error code |
//! | a task that must stop now | [`CancelHandle`] (epoch callback + the same wait as the deadline) | [`Trap::Cancelled`] |
//!
//! Epochs cannot be avoided by wasm code, but (see wasmtime's `Config`
//! docs, "Limitations with malicious guests") a bulk instruction such as
//! `memory.copy` checks the epoch only once; bounding linear memory bounds
//! that instruction's length too. Fuel is deterministic where epochs are
//! not, at a run-time cost of up to 2-3x; it is off unless configured.
//!
//! # Layout
//!
//! - `settings.rs`: [`SandboxConfig`] and the operator's [`HandlerSettings`].
//! - `error.rs`: [`SandboxError`].
//! - `engine.rs`: the engine configuration and the epoch ticker.
//! - `cache.rs`: the on-disk artifact cache.
//! - `namespace.rs`: namespaces and guest key names.
//! - `limits.rs`: [`Limits`] and the store's resource limiter.
//! - `imports.rs`: the WIT bindings and the host side of `kv`,
//!   `idempotency` and `log`.
//! - `progress.rs`: the host side of `progress`: a call's reports,
//!   coalesced and written to its task by a writer of its own.
//! - `allow.rs`: the allow-list of outbound HTTP, and which addresses are
//!   public.
//! - `http.rs`: outbound HTTP (`wasi:http/outgoing-handler`): the
//!   allow-list applied, the host's client, limits and `Idempotency-Key`.
//! - `timeouts.rs`: a handler's own timeouts for a request (wasi:http
//!   `request-options`), honoured under the operator's.
//! - `quota.rs`: what a namespace's Redis budget charges, and the
//!   scripts that keep the count.
//! - `fleet_secret.rs`: the fleet's secret and the downstream
//!   `Idempotency-Key`s derived with it.
//! - `log.rs`: the capped task log and the stdout/stderr streams feeding it.
//! - `call.rs`: one call, its store, deadline and cancellation.
//! - `outcome.rs`: [`Outcome`], [`Trap`] and the classification of errors.

mod allow;
#[doc(hidden)]
pub mod baseline;
mod cache;
mod call;
mod engine;
mod error;
mod fleet_secret;
mod http;
mod imports;
mod limits;
mod log;
mod namespace;
mod operation;
mod outcome;
mod progress;
mod quota;
mod settings;
mod tasks;
mod timeouts;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tracing::Instrument as _;
use wasmtime::Engine;
use wasmtime::component::{HasSelf, Linker};

pub use allow::{AllowList, PatternError};
pub use call::{Call, CancelHandle, TaskContext};
pub use engine::SlotReset;
pub use error::SandboxError;
pub use fleet_secret::{FLEET_SECRET_KEY, HOST_KEY_PREFIX};
pub use http::IDEMPOTENCY_KEY;
pub use limits::{Limit, Limits};
pub use namespace::{CLAIM_KEY_PREFIX, GUEST_KEY_PREFIX, MAX_NAMESPACE_BYTES, NAMESPACE_SECTION};
pub use outcome::{CallReport, FlowReport, Outcome, Trap};
pub use progress::{MAX_PROGRESS_MESSAGE_BYTES, WRITE_EVERY as PROGRESS_WRITE_EVERY};
pub use quota::{CLAIM_OVERHEAD_BYTES, KEY_OVERHEAD_BYTES};
pub use settings::{HandlerSettings, SandboxConfig};
pub use tasks::{SubmitGrant, SubmitGrants};

use cache::ArtifactCache;
use call::{LoadedHandler, TaskState};
use engine::EpochTicker;
use imports::HostCtx;
use imports::bindings::{Handler, HandlerPre};
use outcome::{error_chain, error_line};

/// Check that `namespace` can name a handler namespace.
pub fn validate_namespace(namespace: &str) -> Result<(), SandboxError> {
    namespace::validate(namespace)
}

/// What [`Sandbox::load_dir`] did.
#[derive(Debug, Default)]
pub struct DirLoad {
    /// The task names loaded, sorted.
    pub loaded: Vec<String>,
    /// The files that were skipped, and why.
    pub failed: Vec<(PathBuf, SandboxError)>,
}

/// What [`Sandbox::load`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadReport {
    /// The task name.
    pub task: String,
    /// The handler's kv/idempotency namespace.
    pub namespace: String,
    /// SHA-256 of the module, lowercase hex.
    pub sha256: String,
    /// Whether the compiled artifact came from the cache.
    pub from_cache: bool,
    /// Time spent compiling (`None` when loaded from the cache).
    pub compile_time: Option<Duration>,
    /// Total time of the load: parse, compile or deserialize, pre-instantiate.
    pub load_time: Duration,
}

/// Runs task handlers in fresh, limited instances. Cheap to clone; all
/// clones share one engine, one handler table and one epoch thread, which
/// stops when the last clone is dropped.
#[derive(Clone)]
pub struct Sandbox {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Engine,
    linker: Linker<TaskState>,
    limits: Arc<Limits>,
    settings: HashMap<String, HandlerSettings>,
    /// See [`SandboxConfig::progress_events_max_len`].
    progress_events_max_len: u64,
    cache: ArtifactCache,
    redis: crate::store::Conn,
    http: http::Clients,
    /// By task name; foldhash, as the names are the operator's and the
    /// map is read once per call.
    handlers: RwLock<HashMap<String, Arc<LoadedHandler>, foldhash::fast::RandomState>>,
    slots: tokio::sync::Semaphore,
    max_calls: usize,
    /// How the pool resets a slot between calls.
    slot_reset: SlotReset,
    _ticker: EpochTicker,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("limits", &self.inner.limits)
            .field("handlers", &self.handlers())
            .finish_non_exhaustive()
    }
}

impl Sandbox {
    /// Create the engine, the linker and the epoch thread.
    ///
    /// `redis` is the connection every guest's `kv` and `idempotency` calls
    /// go through; a call takes a handle on it with its first such call,
    /// and it reconnects by itself.
    pub fn new(config: SandboxConfig, redis: crate::store::Conn) -> Result<Sandbox, SandboxError> {
        let reset = engine::slot_reset(config.madvise_slot_reset);
        match reset {
            SlotReset::PagemapScan => {
                tracing::debug!("pool slots are reset by their dirty pages (PAGEMAP_SCAN)")
            }
            SlotReset::Madvise => tracing::debug!("pool slots are reset with madvise, as asked"),
            SlotReset::MadviseNoPagemapScan => tracing::info!(
                "the kernel has no PAGEMAP_SCAN (Linux 6.7+): pool slots are reset with \
                 madvise, about 3x the cost per handler call"
            ),
            SlotReset::MadviseSwapOn => tracing::warn!(
                "swap is on and no cgroup of this process sets memory.swap.max to 0: pool \
                 slots are reset with madvise, about 3x the cost per handler call, since the \
                 faster reset would miss a page swapped out; turn swap off or set the \
                 worker's cgroup memory.swap.max to 0"
            ),
        }
        let engine = engine::build(&config, reset)?;
        let mut linker = Linker::<TaskState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| SandboxError::Engine(error_chain(&e)))?;
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker)
            .map_err(|e| SandboxError::Engine(error_chain(&e)))?;
        Handler::add_to_linker::<TaskState, HasSelf<HostCtx>>(&mut linker, |state| &mut state.host)
            .map_err(|e| SandboxError::Engine(error_chain(&e)))?;
        let secret = fleet_secret::FleetSecret::new(config.fleet_secret_file.as_deref())?;
        let http = http::Clients::new(secret)
            .map_err(|e| SandboxError::Engine(format!("cannot set up the HTTP client: {e}")))?;
        let cache = ArtifactCache::new(config.cache_dir.clone(), &engine)?;
        let ticker = EpochTicker::start(engine.clone(), config.epoch_tick)?;
        let slots = usize::try_from(config.max_concurrent_calls.max(1)).unwrap_or(usize::MAX);
        Ok(Sandbox {
            inner: Arc::new(Inner {
                engine,
                linker,
                limits: Arc::new(config.limits),
                settings: config.handlers,
                progress_events_max_len: config.progress_events_max_len,
                cache,
                redis,
                http,
                handlers: RwLock::new(HashMap::default()),
                slots: tokio::sync::Semaphore::new(slots),
                max_calls: slots,
                slot_reset: reset,
                _ticker: ticker,
            }),
        })
    }

    /// How the pool resets a slot between calls, as decided at start.
    pub fn slot_reset(&self) -> SlotReset {
        self.inner.slot_reset
    }

    /// The limits calls run under.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Load every `<task>.wasm` in `dir` (not recursively).
    ///
    /// A module that fails to load is skipped and reported in
    /// [`DirLoad::failed`]; the others load. Only a directory that cannot be
    /// read is an error.
    pub fn load_dir(&self, dir: &Path) -> Result<DirLoad, SandboxError> {
        let io = |source| SandboxError::Io {
            path: dir.to_path_buf(),
            source,
        };
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|ext| ext == "wasm") && path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        let mut report = DirLoad::default();
        for path in files {
            let Some(task) = path.file_stem().and_then(|s| s.to_str()) else {
                let error = SandboxError::InvalidTaskName(path.display().to_string());
                report.failed.push((path, error));
                continue;
            };
            let loaded = std::fs::read(&path)
                .map_err(|source| SandboxError::Io {
                    path: path.clone(),
                    source,
                })
                .and_then(|wasm| self.load(task, &wasm));
            match loaded {
                Ok(_) => report.loaded.push(task.to_string()),
                Err(error) => report.failed.push((path, error)),
            }
        }
        Ok(report)
    }

    /// Load (or replace) the handler of `task` from a component's bytes.
    ///
    /// Compiles it (or takes it from the artifact cache), decides its
    /// namespace and pre-instantiates it. Blocking and CPU-heavy when it
    /// compiles: call it from a blocking context.
    ///
    /// The handler runs with the operator's settings of `task` from
    /// [`SandboxConfig::handlers`].
    pub fn load(&self, task: &str, wasm: &[u8]) -> Result<LoadReport, SandboxError> {
        let settings = self.inner.settings.get(task).cloned().unwrap_or_default();
        self.load_with(task, wasm, &settings)
    }

    /// [`Sandbox::load`] with the given settings.
    pub fn load_with(
        &self,
        task: &str,
        wasm: &[u8],
        settings: &HandlerSettings,
    ) -> Result<LoadReport, SandboxError> {
        self.load_inner(task, wasm, settings)
            .map_err(|source| SandboxError::Handler {
                task: task.to_string(),
                source: Box::new(source),
            })
    }

    /// Check that `wasm` would load as the handler of `task` with
    /// `settings`, without loading it: it is a component that fits the
    /// handler world, every import is provided, its namespace is granted
    /// and the settings can be honoured here. Compiles it (or finds it in
    /// the artifact cache, which it fills), so a load that follows is fast.
    /// The memory and fuel settings are not checked: they depend on the
    /// worker that loads the handler.
    /// Blocking and CPU-heavy: call it from a blocking context.
    pub fn check(
        &self,
        task: &str,
        wasm: &[u8],
        settings: &HandlerSettings,
    ) -> Result<LoadReport, SandboxError> {
        // Memory and fuel depend on each worker's pool and engine, not on
        // the module: each worker checks them when it loads the handler.
        let settings = HandlerSettings {
            memory_bytes: None,
            fuel: None,
            ..settings.clone()
        };
        self.prepare(task, wasm, &settings)
            .map(|(_, report)| report)
            .map_err(|source| SandboxError::Handler {
                task: task.to_string(),
                source: Box::new(source),
            })
    }

    fn load_inner(
        &self,
        task: &str,
        wasm: &[u8],
        settings: &HandlerSettings,
    ) -> Result<LoadReport, SandboxError> {
        let (handler, report) = self.prepare(task, wasm, settings)?;
        let replaced = self
            .inner
            .handlers
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(task.to_string(), handler);
        tracing::info!(
            task,
            namespace = %report.namespace,
            digest = %report.sha256,
            replaced = replaced.is_some(),
            from_cache = report.from_cache,
            load_ms = report.load_time.as_secs_f64() * 1e3,
            "handler loaded"
        );
        Ok(report)
    }

    /// Compile and pre-instantiate `wasm` as the handler of `task`.
    fn prepare(
        &self,
        task: &str,
        wasm: &[u8],
        settings: &HandlerSettings,
    ) -> Result<(Arc<LoadedHandler>, LoadReport), SandboxError> {
        let started = Instant::now();
        if task.is_empty() || task.chars().any(|c| c.is_control()) {
            return Err(SandboxError::InvalidTaskName(task.to_string()));
        }
        let limits = settings.limits(&self.inner.limits)?;
        let namespace = namespace::namespace_of(task, wasm, settings.namespace.as_deref())?;
        let sha256 = cache::sha256_hex(wasm);
        let compiled = self
            .inner
            .cache
            .load_or_compile(&self.inner.engine, wasm, &sha256)?;
        let pre = self
            .inner
            .linker
            .instantiate_pre(&compiled.component)
            .and_then(HandlerPre::new)
            .map_err(|e| SandboxError::Link(error_line(&e)))?;
        let handler = Arc::new(LoadedHandler {
            pre,
            kv_prefix: namespace::kv_prefix(&namespace),
            claim_prefix: namespace::claim_prefix(&namespace),
            quota_keys: quota::keys(&namespace),
            kv_quota_bytes: limits.kv_quota_bytes,
            digest: sha256.as_str().into(),
            limits,
            allow: settings.allow_hosts.clone(),
            submit_to: settings.submit_to.clone(),
            namespace: namespace.clone(),
            task: task.into(),
            redis: self.inner.redis.clone(),
            http: self.inner.http.clone(),
            progress_events_max_len: self.inner.progress_events_max_len,
        });
        let report = LoadReport {
            task: task.to_string(),
            namespace,
            sha256,
            from_cache: compiled.from_cache,
            compile_time: compiled.compile_time,
            load_time: started.elapsed(),
        };
        Ok((handler, report))
    }

    /// Remove the handler of `task`; returns whether there was one. Calls
    /// already running keep their instance until they finish.
    pub fn unload(&self, task: &str) -> bool {
        self.inner
            .handlers
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(task)
            .is_some()
    }

    /// Whether a handler is loaded for `task`.
    pub fn has_handler(&self, task: &str) -> bool {
        self.handler(task).is_some()
    }

    /// The task names with a loaded handler, sorted.
    pub fn handlers(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .inner
            .handlers
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// The module digest (SHA-256, lowercase hex) of each loaded handler,
    /// by task name.
    pub fn loaded(&self) -> std::collections::BTreeMap<String, String> {
        self.inner
            .handlers
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .map(|(task, handler)| (task.clone(), handler.digest.to_string()))
            .collect()
    }

    /// Calls holding a pool slot right now (running, or instantiating).
    pub fn calls_in_flight(&self) -> usize {
        self.inner
            .max_calls
            .saturating_sub(self.inner.slots.available_permits())
    }

    /// Where the artifact cache keeps (or would keep) this engine's compiled
    /// form of `wasm`; `None` without a cache directory.
    pub fn artifact_path(&self, wasm: &[u8]) -> Option<PathBuf> {
        self.inner.cache.path_for(&cache::sha256_hex(wasm))
    }

    fn handler(&self, task: &str) -> Option<Arc<LoadedHandler>> {
        self.inner
            .handlers
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(task)
            .cloned()
    }

    /// Run the handler of `call.task` once, in a fresh instance, under the
    /// limits. Never fails: everything that can go wrong is an [`Outcome`].
    pub async fn call(&self, call: Call, cancel: &CancelHandle) -> CallReport {
        let span = tracing::debug_span!(
            "sandbox_call",
            task_id = %call.ctx.task_id,
            queue = %call.ctx.queue,
            task = %call.task,
        );
        self.call_inner(call, cancel).instrument(span).await
    }

    async fn call_inner(&self, call: Call, cancel: &CancelHandle) -> CallReport {
        let started = Instant::now();
        let Some(handler) = self.handler(&call.task) else {
            return CallReport {
                outcome: Outcome::Trapped(Trap::UnknownHandler(call.task.clone())),
                log: String::new(),
                host_calls: 0,
                elapsed: started.elapsed(),
                digest: None,
                task: None,
                flow: None,
            };
        };
        let limits = &handler.limits;
        let report = |outcome: Outcome, log: String, host_calls: u64, flow| {
            tracing::debug!(
                outcome = %outcome,
                host_calls,
                elapsed_us = started.elapsed().as_micros() as u64,
                "handler call finished"
            );
            CallReport {
                outcome,
                log,
                host_calls,
                elapsed: started.elapsed(),
                digest: Some(handler.digest.clone()),
                task: Some(handler.task.clone()),
                flow: FlowReport::of(flow),
            }
        };

        if call.payload.len() > limits.max_payload_bytes {
            return report(
                Outcome::Trapped(Trap::LimitExceeded(Limit::Payload)),
                String::new(),
                0,
                None,
            );
        }
        let cancelled = || report(Outcome::Trapped(Trap::Cancelled), String::new(), 0, None);
        if cancel.is_cancelled() {
            return cancelled();
        }
        // A free slot is the common case; only a full pool waits (and can be
        // cancelled while waiting).
        let _slot = match self.inner.slots.try_acquire() {
            Ok(permit) => permit,
            Err(_) => tokio::select! {
                biased;
                () = cancel.cancelled() => return cancelled(),
                permit = self.inner.slots.acquire() => match permit {
                    Ok(permit) => permit,
                    // The semaphore is never closed.
                    Err(_) => return report(
                        Outcome::Trapped(Trap::LimitExceeded(Limit::Concurrency)),
                        String::new(),
                        0,
                        None,
                    ),
                },
            },
        };

        let budget = call
            .deadline
            .map_or(limits.deadline, |d| d.min(limits.deadline));
        let result = call::run(&self.inner.engine, &handler, call, budget, cancel).await;
        report(result.outcome, result.log, result.host_calls, result.flow)
    }
}
