//! The handler registry's flags: the handlers directory, how often it and
//! the registry are checked, how large a module may be, whose signatures
//! are trusted.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{ConfigError, at_least};
use crate::deploy::{SigningError, TrustedKeys};

/// What the handler registry and its hot reload are configured by.
#[derive(Debug, Clone, Args)]
pub struct DeployConfig {
    /// Directory of handler modules, for development: `<task>.wasm` handles
    /// tasks named `<task>`. It is watched: a new or changed file is loaded
    /// without a restart, a bad one is logged and skipped. A handler
    /// deployed with `dtq deploy` wins over a file of the same name.
    /// Without it, the process runs what is deployed in Redis.
    #[arg(long = "handlers", env = "DTQ_HANDLERS")]
    pub handlers: Option<PathBuf>,

    /// How often the registry of deployed handlers and the handlers
    /// directory are checked for changes (ms), besides the notice every
    /// deploy publishes.
    #[arg(long, env = "DTQ_RELOAD_INTERVAL_MS", default_value_t = 1_000)]
    pub reload_interval_ms: u64,

    /// Largest module `dtq deploy` accepts, MiB.
    #[arg(long, env = "DTQ_MAX_MODULE_MIB", default_value_t = 64)]
    pub max_module_mib: u64,

    /// Run signed modules only: a file of public keys, one
    /// `dtq-ed25519 <base64> <name>` line each (`dtq keygen` writes them).
    /// The API refuses a deploy no key signed, and every worker refuses to
    /// load a version no key signed. Unset: nothing is checked.
    #[arg(long, env = "DTQ_TRUSTED_KEYS")]
    pub trusted_keys: Option<PathBuf>,
}

impl DeployConfig {
    /// The keys of `--trusted-keys`, read; `None` without the flag.
    pub fn trusted_keys(&self) -> Result<Option<TrustedKeys>, SigningError> {
        self.trusted_keys
            .as_deref()
            .map(TrustedKeys::load)
            .transpose()
    }

    /// The largest module a deploy accepts, bytes.
    pub fn max_module_bytes(&self) -> usize {
        usize::try_from(self.max_module_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX)
    }

    /// How often handlers are checked for changes.
    pub fn reload_interval(&self) -> Duration {
        Duration::from_millis(self.reload_interval_ms)
    }

    /// Check the values clap cannot.
    pub fn check(&self) -> Result<(), ConfigError> {
        at_least("--reload-interval-ms", 10, self.reload_interval_ms)?;
        at_least("--max-module-mib", 1, self.max_module_mib)
    }
}
