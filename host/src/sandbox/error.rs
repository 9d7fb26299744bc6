//! Why a sandbox or a handler could not be set up.

use std::path::PathBuf;

#[cfg(doc)]
use super::{Limits, Outcome};

/// Why the sandbox could not be set up or a handler could not be loaded.
///
/// A failing *call* is not an error: it is an [`Outcome`].
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The engine (or its epoch thread) could not be created.
    #[error("cannot set up the wasm engine: {0}")]
    Engine(String),
    /// A file or directory could not be read or created.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: std::io::Error,
    },
    /// The artifact cache directory could be written by someone else, who
    /// could then make the worker run native code of theirs.
    #[error(
        "refusing the artifact cache {}: {reason} (its files are native code the worker runs)",
        path.display()
    )]
    UntrustedCache {
        /// The directory.
        path: PathBuf,
        /// Why it is not trusted.
        reason: String,
    },
    /// The task name cannot name a handler.
    #[error("invalid task name {0:?}")]
    InvalidTaskName(String),
    /// The bytes are not a valid component, or it does not fit the limits
    /// (e.g. more memories than [`Limits::memories`]).
    #[error("invalid component: {0}")]
    InvalidModule(String),
    /// The component does not fit the `handler` world: it imports something
    /// the host does not provide, or does not export `handle`.
    #[error("component does not fit the handler world: {0}")]
    Link(String),
    /// The component asks for a namespace the operator did not give its
    /// task.
    #[error(
        "the component asks for namespace {asked:?}, but task {task:?} runs in {granted:?}; \
         to let it share {asked:?}, start dtq with --namespace {task}={asked}"
    )]
    NamespaceNotGranted {
        /// The task name.
        task: String,
        /// The namespace the component's `dtq-namespace` section names.
        asked: String,
        /// The namespace the operator gave the task (by default its name).
        granted: String,
    },
    /// The handler's settings ask for what this sandbox cannot give (more
    /// memory than its pool slots hold, fuel without metering). Another
    /// worker may run it.
    #[error("this worker cannot run it: {0}")]
    Unsupported(String),
    /// The operator's fleet secret is too short to key anything.
    #[error(
        "the fleet secret in {} is {len} bytes; it must have at least 32",
        path.display()
    )]
    FleetSecret {
        /// The file.
        path: PathBuf,
        /// Its bytes, trailing whitespace trimmed.
        len: usize,
    },
    /// The handler's namespace is not acceptable.
    #[error("invalid namespace {namespace:?}: {reason}")]
    InvalidNamespace {
        /// The namespace asked for.
        namespace: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// Loading one handler failed.
    #[error("cannot load handler {task:?}: {source}")]
    Handler {
        /// The task name.
        task: String,
        /// Why.
        #[source]
        source: Box<SandboxError>,
    },
}
