//! The handler registry in Redis: modules by digest, each task's active
//! version and history, and what each process of the fleet runs.
//!
//! Every key carries the hash tag `{registry}`, so the scripts that change
//! several of them run in one slot.
//!
//! | key | type | holds |
//! |---|---|---|
//! | `dtq:module:{registry}:<sha256>` | string | a module's bytes |
//! | `dtq:handlers:{registry}` | hash | task → its active entry |
//! | `dtq:history:{registry}:<task>` | list | the task's entries, newest first, at most [`HISTORY_LIMIT`] |
//! | `dtq:module-refs:{registry}` | hash | digest → history entries referencing it; a module nobody references is deleted |
//! | `dtq:revision:{registry}` | integer | counts changes; processes poll it |
//! | `dtq:fleet:{registry}` | hash | process id → `<ms> <report JSON>`: what it runs |
//!
//! An entry is `<action> <at ms> <version JSON>` (see
//! `lua/include/registry.lua`). Every change is published on
//! [`CHANNEL`] too; processes poll the revision as well, so a missed
//! message costs one poll interval, nothing more.

use std::collections::BTreeMap;

use redis::Value;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::scripts::{
    DEPLOY, DEPLOY_ARGV, GC, GC_ARGV, REPORT, REPORT_ARGV, ROLLBACK, ROLLBACK_ARGV, UNDEPLOY,
    UNDEPLOY_ARGV,
};
use super::settings::{Capacity, DeploySettings};
use crate::store::Conn;
use crate::store::scripts::Argv;

/// Entries kept in each task's history; the modules of older ones are
/// deleted unless another entry references them.
pub const HISTORY_LIMIT: usize = 10;

/// The pub/sub channel on which registry changes are announced (message:
/// the new revision). Its hash tag is the registry's: on a cluster it is
/// a sharded channel on the registry's shard.
pub const CHANNEL: &str = "dtq:changes:{registry}";

const ACTIVE: &str = "dtq:handlers:{registry}";
const REFS: &str = "dtq:module-refs:{registry}";
const REVISION: &str = "dtq:revision:{registry}";
const FLEET: &str = "dtq:fleet:{registry}";

fn history_key(task: &str) -> String {
    format!("dtq:history:{{registry}}:{task}")
}

fn module_key(digest: &str) -> String {
    format!("dtq:module:{{registry}}:{digest}")
}

/// What made a version active, or took it away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// `dtq deploy`.
    Deploy,
    /// `dtq rollback`.
    Rollback,
    /// `dtq undeploy`: no version active.
    Undeploy,
}

impl Action {
    fn as_str(self) -> &'static str {
        match self {
            Action::Deploy => "deploy",
            Action::Rollback => "rollback",
            Action::Undeploy => "undeploy",
        }
    }
}

/// One deployed version: a module and the settings it runs with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    /// SHA-256 of the module, lowercase hex.
    pub digest: String,
    /// The module's size, bytes.
    pub size: u64,
    /// The operator's settings.
    pub settings: DeploySettings,
    /// Identifies module and settings (and signature) together: deploying
    /// the same again changes nothing.
    pub fingerprint: String,
    /// A trusted key's signature over task, digest and settings
    /// (`signing.rs`), base64; what `--trusted-keys` fleets require.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

impl Version {
    /// The version of module `wasm` with `settings`.
    pub fn new(wasm: &[u8], settings: DeploySettings) -> Version {
        Version::signed(wasm, settings, None)
    }

    /// The version of module `wasm` with `settings` and `signature`.
    pub fn signed(wasm: &[u8], settings: DeploySettings, signature: Option<String>) -> Version {
        let digest = hex::encode(Sha256::digest(wasm));
        let fingerprint = fingerprint(&digest, &settings, signature.as_deref());
        Version {
            digest,
            size: wasm.len() as u64,
            settings,
            fingerprint,
            signature,
        }
    }
}

/// A signed version's fingerprint covers its signature too, so that
/// signing an active unsigned version is a change (an unsigned one's is
/// what it always was).
fn fingerprint(digest: &str, settings: &DeploySettings, signature: Option<&str>) -> String {
    let settings = serde_json::to_string(settings).unwrap_or_default();
    let mut hash = Sha256::new();
    hash.update(digest.as_bytes());
    hash.update(b"\n");
    hash.update(settings.as_bytes());
    if let Some(signature) = signature {
        hash.update(b"\n");
        hash.update(signature.as_bytes());
    }
    hex::encode(&hash.finalize()[..8])
}

/// One entry of a task's history, or its active one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// What happened.
    pub action: Action,
    /// When (ms since epoch).
    pub at: u64,
    /// The version made active; `None` for an undeploy.
    pub version: Option<Version>,
}

impl Entry {
    fn encode(&self) -> String {
        let version = match &self.version {
            Some(v) => serde_json::to_string(v).unwrap_or_default(),
            None => "{}".to_owned(),
        };
        format!("{} {} {version}", self.action.as_str(), self.at)
    }

    fn decode(text: &str) -> Result<Entry, RegistryError> {
        let corrupt = || RegistryError::Corrupt(format!("registry entry {text:?}"));
        let mut parts = text.splitn(3, ' ');
        let (Some(action), Some(at), Some(version)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(corrupt());
        };
        let action = match action {
            "deploy" => Action::Deploy,
            "rollback" => Action::Rollback,
            "undeploy" => Action::Undeploy,
            _ => return Err(corrupt()),
        };
        let at = at.parse().map_err(|_| corrupt())?;
        let version =
            match action {
                Action::Undeploy => None,
                // Settings this build does not know make the version one it
                // cannot honour: an error, never a silent default.
                _ => Some(serde_json::from_str(version).map_err(|e| {
                    RegistryError::Corrupt(format!("registry entry {version:?}: {e}"))
                })?),
            };
        Ok(Entry {
            action,
            at,
            version,
        })
    }
}

/// What a deploy did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deployed {
    /// The active entry now.
    pub active: Entry,
    /// The entry it replaced, if any.
    pub previous: Option<Entry>,
    /// The same module and settings were active already; nothing changed.
    pub unchanged: bool,
}

/// What one process reports it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetReport {
    /// The process (unique per start).
    pub id: String,
    /// The queues it consumes; empty for an API-only process.
    pub queues: Vec<String>,
    /// Digest of each loaded handler, by task.
    pub loaded: BTreeMap<String, String>,
    /// Why each task it should run could not be loaded here.
    pub failed: BTreeMap<String, String>,
    /// The fingerprint (module and settings, see [`Version`]) of each
    /// loaded deployed version, by task: a settings-only change keeps the
    /// digest, so a rollout compares these. Absent for a file's handler,
    /// and in reports of older workers.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fingerprints: BTreeMap<String, String>,
    /// What its sandbox can honour, so a deploy can be checked against
    /// every live worker before any loads it; `None` from an older worker
    /// (then nothing is assumed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,
    /// When the report was written (ms, Redis's clock); set on reading.
    #[serde(default)]
    pub seen_at: u64,
}

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Redis failed.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// Rollback or undeploy of a task never deployed.
    #[error("task {0:?} was never deployed")]
    UnknownTask(String),
    /// Rollback to a digest not in the task's history.
    #[error("task {task:?} has no version {digest} in its history")]
    UnknownVersion {
        /// The task.
        task: String,
        /// The digest asked for.
        digest: String,
    },
    /// Rollback with nothing earlier to return to.
    #[error("task {0:?} has no earlier version to roll back to")]
    NoEarlierVersion(String),
    /// The registry holds something this build cannot read.
    #[error("unreadable {0}")]
    Corrupt(String),
}

/// The registry. Cheap to clone.
#[derive(Clone)]
pub struct Registry {
    conn: Conn,
}

impl Registry {
    /// The registry on `conn`'s Redis.
    pub fn new(conn: Conn) -> Registry {
        Registry { conn }
    }

    /// Make `wasm` with `settings` the active version of `task` (checked
    /// already: see `Sandbox::check`), at `now` (ms).
    pub async fn deploy(
        &self,
        task: &str,
        wasm: &[u8],
        settings: DeploySettings,
        now: u64,
    ) -> Result<Deployed, RegistryError> {
        self.deploy_version(task, wasm, Version::new(wasm, settings), now)
            .await
    }

    /// [`Registry::deploy`] of `version` (of module `wasm`), which may
    /// carry a signature ([`Version::signed`]).
    pub async fn deploy_version(
        &self,
        task: &str,
        wasm: &[u8],
        version: Version,
        now: u64,
    ) -> Result<Deployed, RegistryError> {
        let entry = Entry {
            action: Action::Deploy,
            at: now,
            version: Some(version.clone()),
        };
        let module = module_key(&version.digest);
        let mut conn = self.conn.clone();
        // An 18 MB module is sent only when Redis lacks it.
        let stored: bool = redis::cmd("EXISTS")
            .arg(&module)
            .query_async(&mut conn)
            .await?;
        let mut send_module = !stored;
        loop {
            let mut inv = DEPLOY.prepare_invoke();
            inv.key(ACTIVE)
                .key(history_key(task))
                .key(&module)
                .key(REFS)
                .key(REVISION);
            let module_arg: &[u8] = if send_module { wasm } else { b"" };
            Argv::new(&mut inv, &DEPLOY_ARGV)
                .put("TASK", task)
                .put("DIGEST", &version.digest)
                .put("FINGERPRINT", &version.fingerprint)
                .put("ENTRY", entry.encode())
                .put("MODULE", module_arg)
                .put("BOUND", HISTORY_LIMIT)
                .put("CHANNEL", CHANNEL)
                .put("PUBLISH", conn.publish_command())
                .done();
            let reply: Vec<Value> = inv.invoke_async(&mut conn).await?;
            let mut reply = reply.into_iter();
            match int(reply.next())? {
                1 => {
                    let previous = optional_text(reply.next())?
                        .map(|e| Entry::decode(&e))
                        .transpose()?;
                    self.collect(reply).await?;
                    return Ok(Deployed {
                        active: entry,
                        previous,
                        unchanged: false,
                    });
                }
                2 => {
                    let active = Entry::decode(&text(reply.next())?)?;
                    return Ok(Deployed {
                        previous: Some(active.clone()),
                        active,
                        unchanged: true,
                    });
                }
                // Collected between our EXISTS and the script: send it.
                3 if !send_module => send_module = true,
                code => return Err(RegistryError::Corrupt(format!("deploy answered {code}"))),
            }
        }
    }

    /// Make an earlier version of `task` active again: `to`, or the newest
    /// in its history that differs from the active one.
    pub async fn rollback(
        &self,
        task: &str,
        to: Option<&str>,
        now: u64,
    ) -> Result<Entry, RegistryError> {
        let mut inv = ROLLBACK.prepare_invoke();
        inv.key(ACTIVE)
            .key(history_key(task))
            .key(REFS)
            .key(REVISION);
        Argv::new(&mut inv, &ROLLBACK_ARGV)
            .put("TASK", task)
            .put("TO", to.unwrap_or(""))
            .put("NOW", now)
            .put("BOUND", HISTORY_LIMIT)
            .put("CHANNEL", CHANNEL)
            .put("PUBLISH", self.conn.publish_command())
            .done();
        let reply: Vec<Value> = inv.invoke_async(&mut self.conn.clone()).await?;
        let mut reply = reply.into_iter();
        match int(reply.next())? {
            1 => {
                let entry = Entry::decode(&text(reply.next())?)?;
                self.collect(reply).await?;
                Ok(entry)
            }
            -21 => Err(RegistryError::UnknownTask(task.to_owned())),
            -22 => Err(RegistryError::UnknownVersion {
                task: task.to_owned(),
                digest: to.unwrap_or_default().to_owned(),
            }),
            -23 => Err(RegistryError::NoEarlierVersion(task.to_owned())),
            code => Err(RegistryError::Corrupt(format!("rollback answered {code}"))),
        }
    }

    /// Take `task`'s active version away; `false` when it had none.
    pub async fn undeploy(&self, task: &str, now: u64) -> Result<bool, RegistryError> {
        let mut inv = UNDEPLOY.prepare_invoke();
        inv.key(ACTIVE)
            .key(history_key(task))
            .key(REFS)
            .key(REVISION);
        Argv::new(&mut inv, &UNDEPLOY_ARGV)
            .put("TASK", task)
            .put("NOW", now)
            .put("BOUND", HISTORY_LIMIT)
            .put("CHANNEL", CHANNEL)
            .put("PUBLISH", self.conn.publish_command())
            .done();
        let reply: Vec<Value> = inv.invoke_async(&mut self.conn.clone()).await?;
        let mut reply = reply.into_iter();
        match int(reply.next())? {
            1 => {
                self.collect(reply).await?;
                Ok(true)
            }
            0 => Ok(false),
            -21 => Err(RegistryError::UnknownTask(task.to_owned())),
            code => Err(RegistryError::Corrupt(format!("undeploy answered {code}"))),
        }
    }

    /// Delete the modules of the orphaned digests in `reply`.
    async fn collect(&self, reply: impl Iterator<Item = Value>) -> Result<(), RegistryError> {
        let digests: Vec<String> = reply.map(|v| text(Some(v))).collect::<Result<_, _>>()?;
        if digests.is_empty() {
            return Ok(());
        }
        let mut inv = GC.prepare_invoke();
        inv.key(REFS);
        Argv::new(&mut inv, &GC_ARGV).done();
        for digest in &digests {
            inv.key(module_key(digest)).arg(digest);
        }
        let deleted: u64 = inv.invoke_async(&mut self.conn.clone()).await?;
        tracing::info!(deleted, "old handler modules collected");
        Ok(())
    }

    /// The registry's revision: it changes with every deploy, rollback and
    /// undeploy.
    pub async fn revision(&self) -> Result<u64, RegistryError> {
        let rev: Option<u64> = redis::cmd("GET")
            .arg(REVISION)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(rev.unwrap_or(0))
    }

    /// The active entry of every deployed task, and the revision they are
    /// of. An entry this build cannot read is returned as its error, so the
    /// others still load.
    pub async fn active(
        &self,
    ) -> Result<(u64, BTreeMap<String, Result<Entry, RegistryError>>), RegistryError> {
        let (rev, all): (Option<u64>, BTreeMap<String, String>) = redis::pipe()
            .atomic()
            .cmd("GET")
            .arg(REVISION)
            .cmd("HGETALL")
            .arg(ACTIVE)
            .query_async(&mut self.conn.clone())
            .await?;
        let entries = all
            .into_iter()
            .map(|(task, entry)| (task, Entry::decode(&entry)))
            .collect();
        Ok((rev.unwrap_or(0), entries))
    }

    /// `task`'s active entry, if it is deployed.
    pub async fn active_entry(&self, task: &str) -> Result<Option<Entry>, RegistryError> {
        let entry: Option<String> = redis::cmd("HGET")
            .arg(ACTIVE)
            .arg(task)
            .query_async(&mut self.conn.clone())
            .await?;
        entry.map(|e| Entry::decode(&e)).transpose()
    }

    /// `task`'s active entry (if deployed) and its history, newest first.
    pub async fn history(&self, task: &str) -> Result<(Option<Entry>, Vec<Entry>), RegistryError> {
        let (active, history): (Option<String>, Vec<String>) = redis::pipe()
            .atomic()
            .cmd("HGET")
            .arg(ACTIVE)
            .arg(task)
            .cmd("LRANGE")
            .arg(history_key(task))
            .arg(0)
            .arg(-1)
            .query_async(&mut self.conn.clone())
            .await?;
        let active = active.map(|e| Entry::decode(&e)).transpose()?;
        let history = history
            .iter()
            .map(|e| Entry::decode(e))
            .collect::<Result<_, _>>()?;
        Ok((active, history))
    }

    /// The bytes of module `digest`, if stored.
    pub async fn module(&self, digest: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        Ok(redis::cmd("GET")
            .arg(module_key(digest))
            .query_async(&mut self.conn.clone())
            .await?)
    }

    /// Record `report` as what its process runs now; `None` removes the
    /// process (it is stopping). Reports older than `forget_ms` are
    /// dropped.
    pub async fn report(
        &self,
        id: &str,
        report: Option<&FleetReport>,
        forget_ms: u64,
    ) -> Result<(), RegistryError> {
        let json = match report {
            Some(r) => serde_json::to_string(r).unwrap_or_default(),
            None => String::new(),
        };
        let mut inv = REPORT.prepare_invoke();
        inv.key(FLEET);
        Argv::new(&mut inv, &REPORT_ARGV)
            .put("ID", id)
            .put("REPORT", json)
            .put("FORGET_MS", forget_ms)
            .done();
        let _: u64 = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// The reports written within `live_ms` (by Redis's clock), by process
    /// id.
    pub async fn fleet(&self, live_ms: u64) -> Result<Vec<FleetReport>, RegistryError> {
        let ((secs, micros), all): ((u64, u64), BTreeMap<String, String>) = redis::pipe()
            .cmd("TIME")
            .cmd("HGETALL")
            .arg(FLEET)
            .query_async(&mut self.conn.clone())
            .await?;
        let now = secs * 1000 + micros / 1000;
        let mut out = Vec::new();
        for (id, value) in all {
            let Some((seen, json)) = value.split_once(' ') else {
                continue;
            };
            let Ok(seen) = seen.parse::<u64>() else {
                continue;
            };
            if now.saturating_sub(seen) > live_ms {
                continue;
            }
            let mut report: FleetReport = serde_json::from_str(json)
                .map_err(|e| RegistryError::Corrupt(format!("fleet report of {id}: {e}")))?;
            report.seen_at = seen;
            out.push(report);
        }
        Ok(out)
    }
}

fn int(value: Option<Value>) -> Result<i64, RegistryError> {
    match value {
        Some(Value::Int(n)) => Ok(n),
        other => Err(RegistryError::Corrupt(format!("a code, not {other:?}"))),
    }
}

fn text(value: Option<Value>) -> Result<String, RegistryError> {
    optional_text(value)?.ok_or_else(|| RegistryError::Corrupt("a missing value".into()))
}

fn optional_text(value: Option<Value>) -> Result<Option<String>, RegistryError> {
    match value {
        Some(Value::BulkString(bytes)) => String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| RegistryError::Corrupt("a value that is not UTF-8".into())),
        Some(Value::Nil) | None => Ok(None),
        other => Err(RegistryError::Corrupt(format!("a string, not {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip() {
        let entry = Entry {
            action: Action::Rollback,
            at: 1_700_000_000_123,
            version: Some(Version::new(b"\0asm", DeploySettings::default())),
        };
        assert_eq!(Entry::decode(&entry.encode()).expect("decodes"), entry);
        let undeploy = Entry {
            action: Action::Undeploy,
            at: 5,
            version: None,
        };
        assert_eq!(undeploy.encode(), "undeploy 5 {}");
        assert_eq!(Entry::decode("undeploy 5 {}").expect("decodes"), undeploy);
        assert!(Entry::decode("nonsense").is_err());
    }

    #[test]
    fn the_fingerprint_covers_module_and_settings() {
        let a = Version::new(b"one", DeploySettings::default());
        let b = Version::new(b"two", DeploySettings::default());
        let c = Version::new(
            b"one",
            DeploySettings {
                memory_mib: Some(8),
                ..DeploySettings::default()
            },
        );
        assert_ne!(a.fingerprint, b.fingerprint);
        assert_ne!(a.fingerprint, c.fingerprint);
        assert_eq!(
            a.fingerprint,
            Version::new(b"one", DeploySettings::default()).fingerprint
        );
        // The digest is the module's SHA-256.
        assert_eq!(
            Version::new(b"", DeploySettings::default()).digest,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
