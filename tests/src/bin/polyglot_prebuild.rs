//! Build every Python and JavaScript handler the tests may use into the
//! components' cache, and compile each for the polyglot suite's sandbox
//! into its artifact cache (`dtq_tests::polyglot`), so that the suites
//! find both done. Each build and each compile takes seconds to tens of
//! seconds of CPU.
//!
//! `scripts/test` runs this in the background at the lowest CPU priority
//! while the other suites run, most of which wait on Redis and on the
//! processes under test more than they compute: the builds take the CPU
//! those leave idle. A suite that reaches a handler first builds or
//! compiles it itself, as it would without this; both caches write whole
//! files and rename them into place, so nobody sees half of one. A
//! failure here is reported and left for the suite to fail on.
//!
//! ```text
//! $ polyglot_prebuild
//! built python examples/python/counter in 14.2 s
//! ...
//! 20 handlers: 20 built and compiled, 0 failed, in 301.4 s
//! ```

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context as _, Result};
use dtq_host::sandbox::{HandlerSettings, Limits, Sandbox, SandboxConfig, SandboxError};
use dtq_tests::RedisServer;
use dtq_tests::polyglot::{self, Lang};

#[tokio::main]
async fn main() -> ExitCode {
    match prebuild().await {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("polyglot_prebuild: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Build and compile every handler; how many failed.
async fn prebuild() -> Result<usize> {
    let handlers = polyglot::every_handler()?;
    // The polyglot suite's sandbox (its engine settings are the cache's
    // key). No handler is called here, so the Redis a sandbox needs is only
    // connected to, then stopped before the builds: a prebuild killed
    // part-way leaves no redis-server behind.
    let conn = {
        let redis = RedisServer::start()?;
        redis.manager().await?
    };
    let config = SandboxConfig {
        limits: Limits::default(),
        cache_dir: Some(polyglot::artifact_dir()),
        ..SandboxConfig::default()
    };
    let sandbox = Sandbox::new(config, conn)?;
    let root = polyglot::repo_root();
    let started = Instant::now();
    let mut failed = 0;
    for (lang, dir) in &handlers {
        let shown = dir.strip_prefix(&root).unwrap_or(dir).display();
        let one = Instant::now();
        match prepare(&sandbox, *lang, dir) {
            Ok(()) => writeln!(
                std::io::stdout(),
                "built {lang} {shown} in {:.1} s",
                one.elapsed().as_secs_f64()
            )?,
            Err(e) => {
                failed += 1;
                eprintln!("preparing {lang} {shown} failed: {e:#}");
            }
        }
    }
    writeln!(
        std::io::stdout(),
        "{} handlers: {} built and compiled, {failed} failed, in {:.1} s",
        handlers.len(),
        handlers.len() - failed,
        started.elapsed().as_secs_f64()
    )?;
    Ok(failed)
}

/// Build the `lang` handler in `dir` and compile it into the artifact
/// cache, by loading it into `sandbox` (under its directory's name).
fn prepare(sandbox: &Sandbox, lang: Lang, dir: &Path) -> Result<()> {
    let component = polyglot::component(lang, dir)?;
    let wasm =
        std::fs::read(&component).with_context(|| format!("read {}", component.display()))?;
    let task = dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("a handler directory has a name")?;
    let refused = match sandbox.load(task, &wasm) {
        Ok(_) => return Ok(()),
        Err(SandboxError::Handler { source, .. }) => *source,
        Err(e) => return Err(e.into()),
    };
    // A handler that asks for a namespace of its own is granted it here:
    // only its compiled artifact matters.
    let SandboxError::NamespaceNotGranted { asked, .. } = refused else {
        return Err(refused.into());
    };
    let granted = HandlerSettings {
        namespace: Some(asked),
        ..HandlerSettings::default()
    };
    sandbox.load_with(task, &wasm, &granted)?;
    Ok(())
}
