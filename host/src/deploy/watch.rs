//! Hot reload: every process follows the registry (and its handlers
//! directory, when it has one) without a restart.
//!
//! A [`Watcher`] runs one pass ([`Watcher::sync`]) whenever a change is
//! announced on the registry's channel and every poll interval besides, so
//! a missed message costs one interval. A pass:
//!
//! 1. reads the registry's active versions when its revision changed;
//! 2. lists the directory's `<task>.wasm` files (name, size, mtime, inode);
//! 3. decides what each task should run: its registry version, else its
//!    file (a deployed version wins over a file of the same name);
//! 4. updates the [`Catalog`], what the API accepts submissions for;
//! 5. in a worker, loads what changed (compiling off the async threads, and
//!    switching only once compiled), and unloads what is gone. Calls already
//!    running keep the instance they started with, so in-flight tasks finish
//!    on their version. A deployed version that fails to load here is logged
//!    once and reported, and the version loaded before is unloaded: a task
//!    never runs under settings other than its active version's, it waits
//!    (deferred) for a worker that can run them. A bad file of the
//!    directory is skipped, and the file loaded before keeps running. A
//!    failure is forgotten once the task's handler changes again (a
//!    rollback, say);
//! 6. in a worker that is serving, reports what it runs (with the
//!    fingerprint of each deployed version, and what its sandbox can
//!    honour) to the registry's fleet hash, which `dtq handlers`, the
//!    deploy route's check and `dtq deploy`'s rollout wait read. A process
//!    still starting (or one that failed to bind its port) reports nothing,
//!    so it never shows as a live worker.
//!
//! A directory that cannot be listed (a permission change, a moment while
//! it is replaced) keeps the last good listing, with a warning: a failed
//! listing must not unload every handler of the directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::registry::{CHANNEL, Entry, FleetReport, Registry, RegistryError, Version};
use super::settings::Capacity;
use super::signing::TrustedKeys;
use crate::sandbox::Sandbox;
use crate::store::Backend;

/// How often a worker re-sends its fleet report when nothing changed.
pub const REPORT_EVERY: Duration = Duration::from_secs(5);

/// A report older than this (ms) counts as a process that stopped.
pub const REPORT_LIVE_MS: u64 = 3 * REPORT_EVERY.as_millis() as u64;

/// Reports older than this (ms) are removed from the fleet hash.
const REPORT_FORGET_MS: u64 = 60_000;

/// The tasks a process knows a handler for: the registry's active versions
/// and its directory's files. The API refuses submissions of other tasks.
/// Cheap to clone; clones share one table.
#[derive(Debug, Clone, Default)]
pub struct Catalog(Arc<RwLock<BTreeMap<String, Known>>>);

/// What the catalog knows of a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    /// The digest of the deployed version; `None` for a file.
    pub digest: Option<String>,
    /// The operator's default of attempts for the task, if set.
    pub max_attempts: Option<u32>,
}

impl Catalog {
    /// Whether `task` has a handler.
    pub fn has(&self, task: &str) -> bool {
        self.read().contains_key(task)
    }

    /// The default attempts of `task` set at deploy, if any.
    pub fn max_attempts(&self, task: &str) -> Option<u32> {
        self.read().get(task).and_then(|k| k.max_attempts)
    }

    /// Record what a registry change made active for `task` (`None`:
    /// undeployed), so that the process that made it knows at once, before
    /// its next pass reads the registry.
    pub fn note(&self, task: &str, version: Option<&Version>) {
        let mut known = self.0.write().unwrap_or_else(|p| p.into_inner());
        match version {
            Some(v) => {
                known.insert(
                    task.to_owned(),
                    Known {
                        digest: Some(v.digest.clone()),
                        max_attempts: v.settings.max_attempts,
                    },
                );
            }
            None => {
                known.remove(task);
            }
        }
    }

    /// The known tasks, sorted.
    pub fn tasks(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Known>> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    fn replace(&self, known: BTreeMap<String, Known>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = known;
    }
}

/// A handler file as listed: enough to see that it changed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    path: PathBuf,
    len: u64,
    modified: Option<std::time::SystemTime>,
    inode: u64,
}

/// Where a task's handler comes from, precisely enough that a change of
/// version, settings or file is a different value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// A registry version, by its fingerprint.
    Registry(String),
    /// A file.
    File(FileStamp),
}

/// What a task should run.
enum Want {
    Registry(Version),
    /// A registry entry this build cannot read.
    Unreadable(String),
    File(FileStamp),
}

impl Want {
    fn source(&self) -> Source {
        match self {
            Want::Registry(v) => Source::Registry(v.fingerprint.clone()),
            Want::Unreadable(e) => Source::Registry(format!("unreadable: {e}")),
            Want::File(stamp) => Source::File(stamp.clone()),
        }
    }
}

/// Follows the registry and a directory; see the module documentation.
pub struct Watcher {
    registry: Registry,
    backend: Backend,
    catalog: Catalog,
    /// A worker's sandbox; `None` in an API-only process.
    sandbox: Option<Sandbox>,
    dir: Option<PathBuf>,
    interval: Duration,
    id: String,
    queues: Vec<String>,
    revision: Option<u64>,
    active: BTreeMap<String, Result<Entry, String>>,
    loaded: BTreeMap<String, Source>,
    failed: BTreeMap<String, (Source, String)>,
    /// The directory's last good listing.
    files: BTreeMap<String, FileStamp>,
    /// Set once the process serves ([`Watcher::run`]); before, no report
    /// is written.
    serving: bool,
    reported: Option<(FleetReport, Instant)>,
    /// `--trusted-keys`: a registry version loads only when one of them
    /// signed it ([`Watcher::with_trusted_keys`]).
    trusted: Option<TrustedKeys>,
}

impl Watcher {
    /// A watcher of `registry` (announcements come through `backend`) and of
    /// `dir`, keeping `catalog` and, in a worker, `sandbox` up to date.
    /// `queues` are the worker's, for its fleet report.
    pub fn new(
        registry: Registry,
        backend: Backend,
        catalog: Catalog,
        sandbox: Option<Sandbox>,
        dir: Option<PathBuf>,
        interval: Duration,
        queues: Vec<String>,
    ) -> Watcher {
        let id = format!(
            "{}-{}",
            std::process::id(),
            &crate::base::unique_token()[20..]
        );
        Watcher {
            registry,
            backend,
            catalog,
            sandbox,
            dir,
            interval,
            id,
            queues,
            revision: None,
            active: BTreeMap::new(),
            loaded: BTreeMap::new(),
            failed: BTreeMap::new(),
            files: BTreeMap::new(),
            serving: false,
            reported: None,
            trusted: None,
        }
    }

    /// Load a registry version only when one of `keys` signed its task,
    /// module and settings, and its module's bytes hash to its digest:
    /// checked before it is compiled, so a version written into Redis
    /// around the API never runs here; it is a load failure, reported.
    pub fn with_trusted_keys(mut self, keys: Option<TrustedKeys>) -> Watcher {
        self.trusted = keys;
        self
    }

    /// The catalog this watcher keeps.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// The tasks that failed to load here, and why (one line each).
    pub fn failed(&self) -> BTreeMap<String, String> {
        self.failed
            .iter()
            .map(|(task, (_, e))| (task.clone(), e.clone()))
            .collect()
    }

    /// One pass (see the module documentation). Only reading the registry
    /// can fail; a handler that fails to load is logged and reported.
    pub async fn sync(&mut self) -> Result<(), RegistryError> {
        let revision = self.registry.revision().await?;
        if self.revision != Some(revision) {
            let (revision, active) = self.registry.active().await?;
            self.active = active
                .into_iter()
                .map(|(task, entry)| (task, entry.map_err(|e| e.to_string())))
                .collect();
            self.revision = Some(revision);
        }
        if let Some(dir) = &self.dir
            && let Some(files) = list_dir(dir)
        {
            self.files = files;
        }
        let files = self.files.clone();
        let mut wants = BTreeMap::new();
        for (task, entry) in &self.active {
            let want = match entry {
                Ok(Entry {
                    version: Some(v), ..
                }) => Want::Registry(v.clone()),
                Ok(_) => continue,
                Err(e) => Want::Unreadable(e.clone()),
            };
            wants.insert(task.clone(), want);
        }
        for (task, stamp) in files {
            wants.entry(task).or_insert(Want::File(stamp));
        }

        if let Some(sandbox) = self.sandbox.clone() {
            self.load_changes(&sandbox, &wants).await;
        }
        self.update_catalog(&wants);
        if self.sandbox.is_some() && self.serving {
            self.report().await;
        }
        Ok(())
    }

    /// Load what changed, unload what is gone.
    async fn load_changes(&mut self, sandbox: &Sandbox, wants: &BTreeMap<String, Want>) {
        for (task, want) in wants {
            let source = want.source();
            if self.loaded.get(task) == Some(&source)
                || self.failed.get(task).is_some_and(|(s, _)| *s == source)
            {
                continue;
            }
            match self.load(sandbox, task, want).await {
                Ok(Some(digest)) => {
                    info!(task, %digest, "handler switched");
                    self.loaded.insert(task.clone(), source);
                    self.failed.remove(task);
                }
                // Nothing to load right now (Redis failed): try next pass.
                Ok(None) => {}
                Err(e) => {
                    let e = one_line(&e);
                    match want {
                        Want::File(stamp) => {
                            error!("handler skipped: {}: {e}", stamp.path.display())
                        }
                        _ => {
                            error!(task, "deployed handler not loaded here: {e}");
                            // The version loaded before is not the active
                            // one: its tasks wait for a worker that can run
                            // the active one, never run under old settings.
                            if self.loaded.remove(task).is_some() {
                                sandbox.unload(task);
                                info!(
                                    task,
                                    "handler unloaded: its active version cannot load here"
                                );
                            }
                        }
                    }
                    self.failed.insert(task.clone(), (source, e));
                }
            }
        }
        let gone: Vec<String> = self
            .loaded
            .keys()
            .filter(|task| !wants.contains_key(*task))
            .cloned()
            .collect();
        for task in gone {
            sandbox.unload(&task);
            self.loaded.remove(&task);
            info!(task, "handler unloaded");
        }
        // A failure is of one version: once the task wants another (a
        // rollback, a new deploy) it no longer says anything.
        self.failed
            .retain(|task, (source, _)| wants.get(task).is_some_and(|w| w.source() == *source));
    }

    /// Load `want` as `task`'s handler: its digest, `None` to retry later,
    /// or why it cannot load.
    async fn load(
        &self,
        sandbox: &Sandbox,
        task: &str,
        want: &Want,
    ) -> Result<Option<String>, String> {
        let (wasm, settings) = match want {
            Want::Unreadable(e) => return Err(e.clone()),
            Want::Registry(version) => match self.registry.module(&version.digest).await {
                Ok(Some(wasm)) => {
                    self.check_signature(task, &wasm, version)?;
                    (wasm, Some(version.settings.handler_settings()))
                }
                Ok(None) => return Err(format!("module {} is not stored", version.digest)),
                Err(e) => {
                    warn!(task, error = %e, "cannot read the module; retrying");
                    return Ok(None);
                }
            },
            Want::File(stamp) => match std::fs::read(&stamp.path) {
                Ok(wasm) => (wasm, None),
                Err(e) => return Err(e.to_string()),
            },
        };
        let sandbox = sandbox.clone();
        let task = task.to_owned();
        let loaded = tokio::task::spawn_blocking(move || match settings {
            Some(settings) => sandbox.load_with(&task, &wasm, &settings),
            None => sandbox.load(&task, &wasm),
        })
        .await
        .map_err(|e| format!("the load panicked: {e}"))?;
        loaded
            .map(|report| Some(report.sha256))
            .map_err(|e| e.to_string())
    }

    /// With trusted keys, why `version` of `task` may not load (see
    /// [`Watcher::with_trusted_keys`]).
    fn check_signature(&self, task: &str, wasm: &[u8], version: &Version) -> Result<(), String> {
        let Some(keys) = &self.trusted else {
            return Ok(());
        };
        let signature = version.signature.as_deref();
        keys.verify_module(task, wasm, &version.digest, &version.settings, signature)
            .map(|_| ())
            .map_err(|e| format!("signature refused (--trusted-keys): {e}"))
    }

    fn update_catalog(&self, wants: &BTreeMap<String, Want>) {
        let mut known = BTreeMap::new();
        for (task, want) in wants {
            let entry = match want {
                Want::Registry(v) => Known {
                    digest: Some(v.digest.clone()),
                    max_attempts: v.settings.max_attempts,
                },
                Want::Unreadable(_) => Known {
                    digest: None,
                    max_attempts: None,
                },
                // A worker accepts a file's task once it loaded; an API
                // alone, once the file is there.
                Want::File(_) if self.sandbox.is_some() && !self.loaded.contains_key(task) => {
                    continue;
                }
                Want::File(_) => Known {
                    digest: None,
                    max_attempts: None,
                },
            };
            known.insert(task.clone(), entry);
        }
        self.catalog.replace(known);
    }

    /// Write the fleet report when it changed, or every [`REPORT_EVERY`].
    async fn report(&mut self) {
        let Some(sandbox) = &self.sandbox else { return };
        let fingerprints = self
            .loaded
            .iter()
            .filter_map(|(task, source)| match source {
                Source::Registry(fingerprint) => Some((task.clone(), fingerprint.clone())),
                Source::File(_) => None,
            })
            .collect();
        let report = FleetReport {
            id: self.id.clone(),
            queues: self.queues.clone(),
            loaded: sandbox.loaded(),
            failed: self.failed(),
            fingerprints,
            capacity: Some(Capacity::of(sandbox.limits())),
            seen_at: 0,
        };
        let fresh = self
            .reported
            .as_ref()
            .is_some_and(|(last, at)| *last == report && at.elapsed() < REPORT_EVERY);
        if fresh {
            return;
        }
        match self
            .registry
            .report(&self.id, Some(&report), REPORT_FORGET_MS)
            .await
        {
            Ok(()) => self.reported = Some((report, Instant::now())),
            Err(e) => warn!(error = %e, "cannot write the fleet report"),
        }
    }

    /// Pass after pass until `stop`: on each announcement, and every
    /// interval (and every [`REPORT_EVERY`] at least, for the report).
    /// Called once the process serves: from then on a worker reports.
    pub async fn run(&mut self, stop: CancellationToken) {
        self.serving = true;
        let announced = Arc::new(Notify::new());
        let listener = tokio::spawn(listen(
            self.backend.clone(),
            announced.clone(),
            stop.clone(),
        ));
        let tick = self.interval.min(REPORT_EVERY);
        loop {
            if let Err(e) = self.sync().await {
                warn!(error = %e, "cannot read the handler registry; retrying");
            }
            tokio::select! {
                () = stop.cancelled() => break,
                () = announced.notified() => {}
                () = tokio::time::sleep(tick) => {}
            }
        }
        listener.abort();
        if self.sandbox.is_some()
            && let Err(e) = self.registry.report(&self.id, None, REPORT_FORGET_MS).await
        {
            warn!(error = %e, "cannot remove the fleet report");
        }
    }
}

/// Wake `announced` on every message of the registry's channel,
/// resubscribing (every second) when the connection drops.
async fn listen(backend: Backend, announced: Arc<Notify>, stop: CancellationToken) {
    while !stop.is_cancelled() {
        match backend.subscribe(&[CHANNEL.to_owned()]).await {
            Ok(mut subscription) => {
                // A change made while unsubscribed is caught by this pass.
                announced.notify_one();
                while subscription.next_payload().await.is_some() {
                    announced.notify_one();
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot subscribe to registry changes"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The `<task>.wasm` files of `dir`, by task; `None` (and a warning) when
/// the directory cannot be read, so the caller keeps its last listing.
fn list_dir(dir: &Path) -> Option<BTreeMap<String, FileStamp>> {
    use std::os::unix::fs::MetadataExt as _;

    let mut files = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            warn!(dir = %dir.display(), error = %e,
                "cannot list the handlers directory; keeping its last listing");
            return None;
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|ext| ext != "wasm") {
            continue;
        }
        let Some(task) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        // Follows symlinks, as loading does.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        files.insert(
            task.to_owned(),
            FileStamp {
                len: meta.len(),
                modified: meta.modified().ok(),
                inode: meta.ino(),
                path,
            },
        );
    }
    Some(files)
}

/// An error as one line: its chain, whitespace collapsed.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
