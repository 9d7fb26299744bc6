//! The operator's settings of one deployed handler, as `dtq deploy` takes
//! them (flags, a manifest, or the query of `PUT /v1/handlers/{task}`) and
//! as the registry stores them (JSON in each version).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ingest::MAX_ATTEMPTS_LIMIT;
use crate::sandbox::{AllowList, HandlerSettings, SubmitGrants, validate_namespace};

/// Largest `memory_mib` a handler may be given (4 GiB: a wasm32 memory's
/// size).
pub const MAX_MEMORY_MIB: u64 = 4096;

/// What the operator decides for a handler at deploy; every field unset
/// takes the worker's flag (`--memory-mib`, `--task-timeout-ms`, ...).
///
/// Unknown fields are refused, in a request and in the registry alike: a
/// worker older than the settings it reads (one that does not know a
/// network allow-list, say) cannot honour them, so it does not load the
/// version and leaves its tasks to workers that can.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct DeploySettings {
    /// The namespace of its kv keys and idempotency claims (default: the
    /// task name). A component that asks for a namespace is deployed only
    /// when given exactly that one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub namespace: Option<String>,
    /// Linear memory one call may use, MiB; at most the worker's
    /// `--memory-mib`, which sizes its pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub memory_mib: Option<u64>,
    /// Deadline of one attempt, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// Fuel per call (workers must meter fuel: `--fuel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub fuel: Option<u64>,
    /// Attempts of a task whose submission does not set `max_attempts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub max_attempts: Option<u32>,
    /// kv bytes its namespace may hold in Redis, MiB (0: no budget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub kv_quota_mib: Option<u64>,
    /// Hosts it may send HTTP requests to, comma-separated
    /// `scheme://host[:port]` patterns (`https://api.example.com`,
    /// `https://*.example.com`, `http://127.0.0.1:*`); none by default.
    /// Loopback and private addresses only when a pattern names them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub allow_hosts: Option<String>,
    /// Queues it may submit tasks to (flows), comma-separated
    /// `QUEUE[:TASK...]`: `orders:pick:charge` grants tasks `pick` and
    /// `charge` of queue `orders`, `mail` any task of queue `mail`; none
    /// by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub submit_to: Option<String>,
}

/// A setting that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct SettingsError {
    /// The setting's name.
    pub setting: &'static str,
    /// Why it is refused.
    pub reason: String,
}

/// What one worker's sandbox can honour, as its fleet report publishes
/// it: the settings a deploy may give a handler are bounded by each
/// worker's flags, which no module check on the API can see.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// Its pool slots' linear memory, MiB (`--memory-mib`).
    pub memory_mib: u64,
    /// Whether it meters fuel (`--fuel`).
    pub fuel: bool,
}

impl Capacity {
    /// The capacity of a sandbox with `limits`.
    pub fn of(limits: &crate::sandbox::Limits) -> Capacity {
        Capacity {
            memory_mib: (limits.memory_bytes >> 20) as u64,
            fuel: limits.fuel.is_some(),
        }
    }
}

impl DeploySettings {
    /// Why a worker of `capacity` cannot run a handler with these
    /// settings; `None` when it can. The reasons are the worker's own at
    /// load (`HandlerSettings` in the sandbox), said before it loads.
    pub fn unrunnable_on(&self, capacity: &Capacity) -> Option<String> {
        if let Some(mib) = self.memory_mib
            && mib > capacity.memory_mib
        {
            return Some(format!(
                "the handler may use {mib} MiB of memory, but this worker's pool slots hold {} MiB \
                 (start it with --memory-mib {mib} or more)",
                capacity.memory_mib
            ));
        }
        if self.fuel.is_some() && !capacity.fuel {
            return Some(
                "the handler has a fuel budget, but this worker does not meter fuel \
                 (start it with --fuel)"
                    .into(),
            );
        }
        None
    }

    /// Check every value against its range.
    pub fn check(&self) -> Result<(), SettingsError> {
        let error = |setting, reason: String| Err(SettingsError { setting, reason });
        if let Some(ns) = &self.namespace
            && let Err(e) = validate_namespace(ns)
        {
            return error("namespace", e.to_string());
        }
        if let Some(mib) = self.memory_mib
            && !(1..=MAX_MEMORY_MIB).contains(&mib)
        {
            return error("memory_mib", format!("must be 1 to {MAX_MEMORY_MIB}"));
        }
        if self.timeout_ms == Some(0) {
            return error("timeout_ms", "must be at least 1".into());
        }
        if self.fuel == Some(0) {
            return error("fuel", "must be at least 1".into());
        }
        if let Some(n) = self.max_attempts
            && !(1..=MAX_ATTEMPTS_LIMIT).contains(&n)
        {
            return error("max_attempts", format!("must be 1 to {MAX_ATTEMPTS_LIMIT}"));
        }
        if let Some(mib) = self.kv_quota_mib
            && mib > u64::MAX >> 20
        {
            return error("kv_quota_mib", "is too large".into());
        }
        if let Some(hosts) = &self.allow_hosts
            && let Err(e) = AllowList::parse(hosts)
        {
            return error("allow_hosts", e.to_string());
        }
        if let Some(grants) = &self.submit_to
            && let Err(e) = SubmitGrants::parse(grants)
        {
            return error("submit_to", e);
        }
        Ok(())
    }

    /// What the sandbox takes.
    pub fn handler_settings(&self) -> HandlerSettings {
        let mib = |n: u64| usize::try_from(n << 20).unwrap_or(usize::MAX);
        HandlerSettings {
            namespace: self.namespace.clone(),
            kv_quota_bytes: self.kv_quota_mib.map(|n| n << 20),
            memory_bytes: self.memory_mib.map(mib),
            deadline: self.timeout_ms.map(Duration::from_millis),
            fuel: self.fuel,
            // Checked at deploy; a list that does not parse allows nothing.
            allow_hosts: self
                .allow_hosts
                .as_deref()
                .and_then(|hosts| AllowList::parse(hosts).ok())
                .unwrap_or_default(),
            // Checked at deploy too; a grant that does not parse grants
            // nothing.
            submit_to: self
                .submit_to
                .as_deref()
                .and_then(|grants| SubmitGrants::parse(grants).ok())
                .unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_round_trip_and_refuse_unknown_fields() {
        let settings = DeploySettings {
            namespace: Some("billing".into()),
            memory_mib: Some(32),
            max_attempts: Some(5),
            ..DeploySettings::default()
        };
        let json = serde_json::to_string(&settings).expect("serializes");
        assert_eq!(
            json,
            r#"{"namespace":"billing","memory_mib":32,"max_attempts":5}"#
        );
        assert_eq!(
            serde_json::from_str::<DeploySettings>(&json).expect("parses"),
            settings
        );
        let newer = r#"{"memory_mib":32,"allow_hosts":["api.example.com"]}"#;
        assert!(serde_json::from_str::<DeploySettings>(newer).is_err());
    }

    #[test]
    fn out_of_range_values_name_their_setting() {
        let bad = [
            DeploySettings {
                memory_mib: Some(0),
                ..DeploySettings::default()
            },
            DeploySettings {
                max_attempts: Some(MAX_ATTEMPTS_LIMIT + 1),
                ..DeploySettings::default()
            },
            DeploySettings {
                namespace: Some("a{b".into()),
                ..DeploySettings::default()
            },
            DeploySettings {
                timeout_ms: Some(0),
                ..DeploySettings::default()
            },
            DeploySettings {
                submit_to: Some("orders:bad task".into()),
                ..DeploySettings::default()
            },
        ];
        let names: Vec<&str> = bad
            .iter()
            .map(|s| s.check().expect_err("refused").setting)
            .collect();
        assert_eq!(
            names,
            [
                "memory_mib",
                "max_attempts",
                "namespace",
                "timeout_ms",
                "submit_to"
            ]
        );
        let granted = DeploySettings {
            submit_to: Some("orders:pick:charge,mail".into()),
            ..DeploySettings::default()
        };
        assert!(granted.check().is_ok());
        let sandbox = granted.handler_settings().submit_to;
        assert!(sandbox.allows("orders", "pick") && sandbox.allows("mail", "any"));
        assert!(!sandbox.allows("orders", "refund"));
        assert!(DeploySettings::default().check().is_ok());
    }

    #[test]
    fn a_worker_too_small_for_the_settings_says_why() {
        let worker = Capacity {
            memory_mib: 64,
            fuel: false,
        };
        let fits = DeploySettings {
            memory_mib: Some(64),
            ..DeploySettings::default()
        };
        assert_eq!(fits.unrunnable_on(&worker), None);
        let big = DeploySettings {
            memory_mib: Some(1000),
            ..DeploySettings::default()
        };
        let reason = big.unrunnable_on(&worker).expect("refused");
        assert!(reason.contains("--memory-mib 1000"), "{reason}");
        let metered = DeploySettings {
            fuel: Some(1_000),
            ..DeploySettings::default()
        };
        assert!(metered.unrunnable_on(&worker).is_some());
        let metering = Capacity {
            fuel: true,
            ..worker
        };
        assert_eq!(metered.unrunnable_on(&metering), None);
    }

    #[test]
    fn units_become_the_sandboxs() {
        let settings = DeploySettings {
            memory_mib: Some(3),
            timeout_ms: Some(1500),
            kv_quota_mib: Some(2),
            ..DeploySettings::default()
        }
        .handler_settings();
        assert_eq!(settings.memory_bytes, Some(3 << 20));
        assert_eq!(settings.deadline, Some(Duration::from_millis(1500)));
        assert_eq!(settings.kv_quota_bytes, Some(2 << 20));
        assert_eq!(settings.namespace, None);
    }
}
