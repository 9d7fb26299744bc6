//! Deploying handlers to a fleet: modules stored in Redis by digest, one
//! active version per task with its operator settings, a bounded history to
//! roll back to, and hot reload in every process.
//!
//! - `registry.rs`: the Redis side ([`Registry`]): deploy, rollback,
//!   undeploy, history, modules, and the fleet's reports of what each
//!   worker runs.
//! - `settings.rs`: [`DeploySettings`], what the operator sets per handler.
//! - `signing.rs`: signed modules ([`TrustedKeys`], [`SigningKeyFile`]):
//!   what `--trusted-keys` fleets require of a deploy, checked by the API
//!   and again by every worker before it compiles.
//! - `watch.rs`: [`Watcher`], which keeps a process's handlers (and the
//!   API's [`Catalog`]) in step with the registry and its directory.
//!
//! A module is checked before it is stored (`Sandbox::check`: it compiles,
//! fits the handler world, its imports are provided, its namespace is
//! granted), so a refused module never reaches a worker; its settings are
//! checked against the [`Capacity`] every live worker reports, and refused
//! when none can honour them (unless forced). A worker that still cannot
//! run a version (its pool is too small for the memory setting, say)
//! reports why, unloads the version it ran before, and leaves the task to
//! workers that can: it defers a task it has no handler for, and the task
//! fails only once it has waited past the defer limit.

mod registry;
mod scripts;
mod settings;
mod signing;
mod watch;

pub use registry::{
    Action, CHANNEL, Deployed, Entry, FleetReport, HISTORY_LIMIT, Registry, RegistryError, Version,
};
pub use settings::{Capacity, DeploySettings, MAX_MEMORY_MIB, SettingsError};
pub use signing::{
    PUBLIC_TAG, SECRET_TAG, SIGNATURE_HEADER, SigningError, SigningKeyFile, TrustedKeys,
    signed_message,
};
pub use watch::{Catalog, Known, REPORT_EVERY, REPORT_LIVE_MS, Watcher};
