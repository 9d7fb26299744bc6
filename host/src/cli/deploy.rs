//! `dtq deploy` (one module, or every handler of a manifest) and its
//! rollout across the fleet; `handlers`, `rollback`, `undeploy`; `keygen`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dtq_host::client::{Client, Deployed};
use dtq_host::deploy::{DeploySettings, FleetReport, SigningKeyFile};
use serde::Serialize;
use serde_json::json;

use super::args::DeployArgs;
use super::print::show;
use super::table::View;
use super::{Failure, client, fail};

/// One handler to deploy: its task, module file and settings.
struct Deployment {
    task: String,
    file: PathBuf,
    settings: DeploySettings,
}

/// A deploy's answer with its rollout, as printed.
#[derive(Serialize)]
struct RolledOut {
    #[serde(flatten)]
    deployed: Deployed,
    rollout: Rollout,
}

/// How far a deployed version reached the live workers.
#[derive(Serialize)]
struct Rollout {
    /// Live workers.
    workers: usize,
    /// Those that run the version.
    running: usize,
    /// Why each that failed to load it could not, by worker id.
    failed: BTreeMap<String, String>,
    /// How long the rollout was waited for.
    waited_ms: u64,
}

/// `dtq deploy`: every module stored in order (a refused one stops
/// there), then each one's rollout waited for, and all printed.
pub(crate) async fn deploy(args: DeployArgs) -> Result<(), Failure> {
    let deployments = match (&args.manifest, args.file) {
        (Some(manifest), _) => read_manifest(manifest)?,
        (None, Some(file)) => vec![Deployment {
            task: match args.task {
                Some(task) => task,
                None => task_of(&file)?,
            },
            file,
            settings: args.settings,
        }],
        (None, None) => return Err(fail(2, anyhow::anyhow!("name a module or --manifest"))),
    };
    let sign_key = match &args.sign_key {
        Some(path) => Some(SigningKeyFile::load(path).map_err(|e| fail(2, e))?),
        None => None,
    };
    let api = client(args.client)?;
    let mut results = Vec::new();
    for d in &deployments {
        let wasm = std::fs::read(&d.file)
            .map_err(|e| fail(2, anyhow::anyhow!("cannot read {}: {e}", d.file.display())))?;
        let signature = sign_key
            .as_ref()
            .map(|k| k.sign(&d.task, &wasm, &d.settings));
        let deployed = api
            .deploy(&d.task, wasm, &d.settings, args.force, signature.as_deref())
            .await?;
        if let Some(warning) = &deployed.warning {
            eprintln!("warning: {}: {warning}", d.task);
        }
        results.push(deployed);
    }
    let stored = Instant::now();
    let wait = Duration::from_secs(args.wait_s);
    let mut rolled = Vec::new();
    for deployed in results {
        let rollout = rollout(&api, &deployed, stored, wait).await?;
        rolled.push(RolledOut { deployed, rollout });
    }
    match rolled.as_slice() {
        [one] if args.manifest.is_none() => show(View::Record, one),
        all => show(View::Record, &all),
    }
}

/// The default task name of a module file: its stem, `-` read as `_`.
fn task_of(file: &Path) -> Result<String, Failure> {
    file.file_stem()
        .and_then(|s| s.to_str())
        .map(|s| s.replace('-', "_"))
        .ok_or_else(|| {
            fail(
                2,
                anyhow::anyhow!("cannot name a task after {}", file.display()),
            )
        })
}

/// The handlers of a manifest: `[handlers.<task>]` tables, each with a
/// `file` (relative to the manifest) and settings.
fn read_manifest(path: &Path) -> Result<Vec<Deployment>, Failure> {
    let bad = |e: String| fail(2, anyhow::anyhow!("{}: {e}", path.display()));
    let text = std::fs::read_to_string(path)
        .map_err(|e| fail(2, anyhow::anyhow!("cannot read {}: {e}", path.display())))?;
    let mut doc: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| bad(e.to_string()))?;
    let Some(toml::Value::Table(handlers)) = doc.remove("handlers") else {
        return Err(bad("no [handlers.<task>] table".into()));
    };
    if let Some(other) = doc.keys().next() {
        return Err(bad(format!(
            "unknown key {other:?} (only [handlers.<task>] tables)"
        )));
    }
    let base = path.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for (task, table) in handlers {
        let toml::Value::Table(mut table) = table else {
            return Err(bad(format!("handlers.{task} is not a table")));
        };
        let Some(toml::Value::String(file)) = table.remove("file") else {
            return Err(bad(format!("handlers.{task} has no `file`")));
        };
        let settings = table
            .try_into()
            .map_err(|e: toml::de::Error| bad(format!("handlers.{task}: {e}")))?;
        out.push(Deployment {
            file: base.join(file),
            task,
            settings,
        });
    }
    Ok(out)
}

/// Wait (up to `wait` from `stored`) until every live worker runs the
/// version `deployed` made active (its module with its settings: the
/// fingerprint, as a settings-only change keeps the digest), or failed to
/// load it; report how many did, which failed and why, and when.
async fn rollout(
    api: &Client,
    deployed: &Deployed,
    stored: Instant,
    wait: Duration,
) -> Result<Rollout, Failure> {
    let task = deployed.task.as_str();
    // A worker too old to report fingerprints (or capacity) is judged by
    // the digest alone.
    let runs = |w: &FleetReport| match w.fingerprints.get(task) {
        Some(f) => deployed.fingerprint.as_ref() == Some(f),
        None if w.capacity.is_some() => false,
        None => w.loaded.get(task) == Some(&deployed.digest),
    };
    loop {
        let workers = api.handlers().await?.workers;
        let running = workers.iter().filter(|w| runs(w)).count();
        let failed: BTreeMap<String, String> = workers
            .iter()
            .filter(|w| !runs(w))
            .filter_map(|w| Some((w.id.clone(), w.failed.get(task)?.clone())))
            .collect();
        let settled = running + failed.len() == workers.len();
        if settled || stored.elapsed() >= wait {
            if !failed.is_empty() {
                eprintln!(
                    "warning: {} worker(s) cannot run {task}: see rollout.failed",
                    failed.len()
                );
            } else if !settled {
                eprintln!(
                    "warning: {running} of {} workers run {task}'s new version after {}s",
                    workers.len(),
                    wait.as_secs()
                );
            }
            return Ok(Rollout {
                workers: workers.len(),
                running,
                failed,
                waited_ms: stored.elapsed().as_millis() as u64,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `dtq handlers [history TASK]`.
pub(crate) async fn handlers(api: Client, history_of: Option<&str>) -> Result<(), Failure> {
    match history_of {
        Some(task) => show(View::History, &api.handler_history(task).await?),
        None => show(View::Handlers, &api.handlers().await?),
    }
}

/// `dtq rollback`.
pub(crate) async fn rollback(api: Client, task: &str, to: Option<String>) -> Result<(), Failure> {
    show(View::Record, &api.rollback(task, to).await?)
}

/// `dtq undeploy`.
pub(crate) async fn undeploy(api: Client, task: &str) -> Result<(), Failure> {
    show(View::Record, &api.undeploy(task).await?)
}

/// `dtq keygen NAME`: write the pair, print where and the public line.
pub(crate) fn keygen(path: &Path) -> Result<(), Failure> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty() && !n.contains(char::is_whitespace))
        .ok_or_else(|| {
            fail(
                2,
                anyhow::anyhow!("name the key file (no spaces in its name)"),
            )
        })?;
    let key = SigningKeyFile::generate(name);
    let public = key.write(path).map_err(|e| fail(2, e))?;
    show(
        View::Record,
        &json!({
            "private": path.display().to_string(),
            "public": public.display().to_string(),
            "key": key.public_line(),
        }),
    )
}
