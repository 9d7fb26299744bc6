//! Idempotent operations against a real `redis-server`, through the sandbox
//! and the `operations` test guest: the claim state machine, kv writes staged
//! until they commit with the claim, and each crash point of an operation
//! (the attempt interrupted, the effect failing or panicking, the commit's
//! reply lost, the claim taken over), plus the namespaces claims live in.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use dtq_host::sandbox::{
    Call, CallReport, CancelHandle, HandlerSettings, Limits, Outcome, Sandbox, SandboxConfig,
    SandboxError, TaskContext, Trap,
};
use dtq_tests::{RedisServer, guests};
use serde_json::{Value, json};

/// The claim lease of every sandbox here: short, so that tests of a dead
/// owner wait about a second, not five.
const LEASE: Duration = Duration::from_millis(1_000);

fn shared_cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("operations-artifacts")
}

/// A sandbox with `operations` loaded under its own name, whose guests reach
/// Redis at `url` through a connection manager with the given response
/// timeout and whose claims have the given lease.
async fn sandbox_at(url: &str, response_timeout: Duration, lease: Duration) -> Result<Sandbox> {
    let config = SandboxConfig {
        limits: Limits {
            claim_lease: lease,
            ..Limits::default()
        },
        cache_dir: Some(shared_cache()),
        ..SandboxConfig::default()
    };
    let client = redis::Client::open(url)?;
    let manager_config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(response_timeout));
    let manager = client
        .get_connection_manager_with_config(manager_config)
        .await?;
    let sandbox = Sandbox::new(config, dtq_host::store::Conn::Single(manager))?;
    sandbox.load("operations", &std::fs::read(guests::OPERATIONS)?)?;
    Ok(sandbox)
}

async fn sandbox_with(redis: &RedisServer, response_timeout: Duration) -> Result<Sandbox> {
    sandbox_at(&redis.url(), response_timeout, LEASE).await
}

async fn sandbox(redis: &RedisServer) -> Result<Sandbox> {
    sandbox_with(redis, Duration::from_secs(5)).await
}

/// A call of the `operations` guest as attempt `attempt` of `task_id`.
fn call(task_id: &str, attempt: u32, payload: Value) -> Call {
    Call {
        task: "operations".to_string(),
        ctx: TaskContext {
            task_id: task_id.to_string(),
            queue: "default".to_string(),
            task_name: "operations".to_string(),
            attempt,
            max_attempts: 10,
            idempotency_key: None,
        },
        payload: payload.to_string(),
        deadline: None,
    }
}

async fn run(sandbox: &Sandbox, task_id: &str, attempt: u32, payload: Value) -> CallReport {
    sandbox
        .call(call(task_id, attempt, payload), &CancelHandle::new())
        .await
}

fn success(report: &CallReport) -> Result<Value> {
    match &report.outcome {
        Outcome::Success(json) => Ok(serde_json::from_str(json)?),
        other => bail!("expected success, got {other:?}\nlog:\n{}", report.log),
    }
}

/// The kv key `key` of the `operations` namespace, as stored.
fn kv(key: &str) -> String {
    format!("dtq:guest:{{operations}}:{key}")
}

/// The claim of operation `key`, as stored.
fn claim(key: &str) -> String {
    format!("dtq:claim:{{operations}}:{key}")
}

async fn get(redis: &RedisServer, key: &str) -> Result<Option<String>> {
    let mut conn = redis.conn().await?;
    Ok(redis::cmd("GET").arg(key).query_async(&mut conn).await?)
}

/// A field of the claim of operation `key`.
async fn claim_field(redis: &RedisServer, key: &str, field: &str) -> Result<Option<String>> {
    let mut conn = redis.conn().await?;
    Ok(redis::cmd("HGET")
        .arg(claim(key))
        .arg(field)
        .query_async(&mut conn)
        .await?)
}

/// Wait until the claim of `key` is in `state`.
async fn wait_claim(redis: &RedisServer, key: &str, state: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while claim_field(redis, key, "state").await?.as_deref() != Some(state) {
        if Instant::now() > deadline {
            bail!("claim {key} never became {state}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// A charge-like operation: increment `charges`, set `email`, spin.
fn charge(key: &str, spin_ms: u64) -> Value {
    json!({"op": "run", "key": key, "incr": ["charges"], "set": [["email", "sent"]],
        "spin_ms": spin_ms})
}

// ------------------------------------------------------------- staging

#[tokio::test(flavor = "multi_thread")]
async fn kv_writes_apply_only_with_the_commit_and_later_callers_see_done() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;

    let running = {
        let sandbox = sandbox.clone();
        tokio::spawn(async move { run(&sandbox, "t1", 1, charge("A", 1_500)).await })
    };
    wait_claim(&redis, "A", "running").await?;
    // The effect's writes are made and it is spinning: none reached Redis.
    assert_eq!(get(&redis, &kv("charges")).await?, None);
    assert_eq!(get(&redis, &kv("email")).await?, None);
    assert_eq!(
        claim_field(&redis, "A", "task_id").await?.as_deref(),
        Some("t1")
    );

    let first = running.await?;
    assert_eq!(
        success(&first)?,
        json!({"outcome": "executed", "value": [1]})
    );
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("1"));
    assert_eq!(get(&redis, &kv("email")).await?.as_deref(), Some("sent"));
    assert_eq!(
        claim_field(&redis, "A", "result").await?.as_deref(),
        Some("[1]")
    );

    let again = run(&sandbox, "t2", 1, charge("A", 0)).await;
    assert_eq!(success(&again)?, json!({"outcome": "done", "value": [1]}));
    let seed = run(
        &sandbox,
        "t3",
        1,
        json!({"op": "seed", "key": "A", "incr": "charges"}),
    )
    .await;
    assert_eq!(success(&seed)?, json!({"executed": false}));
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("1"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn reads_inside_an_operation_see_its_staged_writes() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let mut conn = redis.conn().await?;
    let _: () = redis::cmd("SET")
        .arg(kv("r:n"))
        .arg(10)
        .query_async(&mut conn)
        .await?;
    let _: () = redis::cmd("SET")
        .arg(kv("r:text"))
        .arg("abc")
        .query_async(&mut conn)
        .await?;

    let report = run(&sandbox, "t1", 1, json!({"op": "reads"})).await;
    let seen = success(&report)?["seen"].clone();
    assert_eq!(seen["get_a"], "1");
    assert_eq!(seen["incr_n"], 15);
    assert_eq!(seen["incr_n_again"], 16);
    assert_eq!(seen["exists_a"], true);
    assert_eq!(seen["del_a"], true);
    assert_eq!(seen["get_a_deleted"], Value::Null);
    assert_eq!(seen["exists_a_deleted"], false);
    assert_eq!(seen["set_nx_b"], true);
    assert_eq!(seen["set_nx_b_again"], false);
    let incr_text = seen["incr_text"]
        .as_str()
        .context("incr of text did not fail")?;
    assert!(incr_text.contains("wrong type"), "{incr_text}");

    assert_eq!(get(&redis, &kv("r:n")).await?.as_deref(), Some("16"));
    assert_eq!(get(&redis, &kv("r:a")).await?, None);
    assert_eq!(get(&redis, &kv("r:b")).await?.as_deref(), Some("first"));
    assert_eq!(get(&redis, &kv("r:text")).await?.as_deref(), Some("abc"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_staged_increment_adds_its_delta_to_what_others_added_meanwhile() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let running = {
        let sandbox = sandbox.clone();
        tokio::spawn(async move { run(&sandbox, "t1", 1, charge("B", 800)).await })
    };
    wait_claim(&redis, "B", "running").await?;
    // Wait until the guest has read the counter (the only GET on this
    // server), then add to it behind the operation's back.
    let mut conn = redis.conn().await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await?;
        if stats.contains("cmdstat_get:") {
            break;
        }
        if Instant::now() > deadline {
            bail!("the guest never read the counter");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _: i64 = redis::cmd("INCRBY")
        .arg(kv("charges"))
        .arg(100)
        .query_async(&mut conn)
        .await?;
    // The guest was told 1 (what it read plus its delta); the commit adds
    // the delta to the 100 added meanwhile.
    assert_eq!(
        success(&running.await?)?,
        json!({"outcome": "executed", "value": [1]})
    );
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("101"));
    Ok(())
}

// ------------------------------------------------------- crash points

#[tokio::test(flavor = "multi_thread")]
async fn an_attempt_interrupted_mid_operation_applies_nothing_and_the_next_applies_once()
-> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;

    // Attempt 1 is interrupted (as a kill or a deadline would) after its
    // writes were staged.
    let cancel = CancelHandle::new();
    let interrupted = {
        let sandbox = sandbox.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            sandbox
                .call(call("t1", 1, charge("C", 60_000)), &cancel)
                .await
        })
    };
    wait_claim(&redis, "C", "running").await?;
    cancel.cancel();
    let report = interrupted.await?;
    assert!(
        matches!(report.outcome, Outcome::Trapped(Trap::Cancelled)),
        "{:?}",
        report.outcome
    );
    assert_eq!(get(&redis, &kv("charges")).await?, None);
    assert_eq!(get(&redis, &kv("email")).await?, None);

    // Until its lease ends the claim is in progress for other tasks: the
    // seed form gives a retryable error, never "(false, None)".
    let early = run(
        &sandbox,
        "t2",
        1,
        json!({"op": "seed", "key": "C", "incr": "charges"}),
    )
    .await;
    match &early.outcome {
        Outcome::Retryable(msg) => assert!(msg.contains("in progress"), "{msg}"),
        other => bail!("expected a retryable error, got {other:?}"),
    }

    // The task's next attempt takes it over at once and applies it once.
    let taken_over = run(&sandbox, "t1", 2, charge("C", 0)).await;
    assert_eq!(
        success(&taken_over)?,
        json!({"outcome": "executed", "value": [1]})
    );
    assert!(taken_over.log.contains("taken over"), "{}", taken_over.log);
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("1"));
    let done = run(&sandbox, "t9", 1, charge("C", 0)).await;
    assert_eq!(success(&done)?, json!({"outcome": "done", "value": [1]}));
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("1"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_owner_keeps_its_claim_past_the_lease() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let owner = {
        let sandbox = sandbox.clone();
        let spin = LEASE.as_millis() as u64 * 3;
        tokio::spawn(async move { run(&sandbox, "owner", 1, charge("D", spin)).await })
    };
    wait_claim(&redis, "D", "running").await?;
    // Past several leases, renewed: another task finds it in progress, a
    // retryable error, never "(false, None)".
    let mut checks = 0;
    while !owner.is_finished() {
        let report = run(
            &sandbox,
            "other",
            1,
            json!({"op": "seed", "key": "D", "incr": "charges"}),
        )
        .await;
        if claim_field(&redis, "D", "state").await?.as_deref() == Some("done") {
            break;
        }
        match &report.outcome {
            Outcome::Retryable(msg) => assert!(msg.contains("in progress"), "{msg}"),
            other => bail!("expected in progress, got {other:?}"),
        }
        checks += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(checks > 10, "only {checks} checks");
    assert_eq!(
        success(&owner.await?)?,
        json!({"outcome": "executed", "value": [1]})
    );
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("1"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_later_attempt_of_the_task_takes_over_and_the_stale_one_applies_nothing() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    // Attempt 1 still runs (its worker was presumed dead and the task
    // reclaimed, say), well within its lease.
    let stale = {
        let sandbox = sandbox.clone();
        tokio::spawn(async move { run(&sandbox, "t1", 1, charge("S", 800)).await })
    };
    wait_claim(&redis, "S", "running").await?;
    // Attempt 2 of the same task does not wait for the lease: the queue
    // started it only because attempt 1 counts as over.
    let next = run(&sandbox, "t1", 2, charge("S", 0)).await;
    assert_eq!(
        success(&next)?,
        json!({"outcome": "executed", "value": [1]})
    );
    assert!(next.log.contains("taken over"), "{}", next.log);
    // The stale attempt's commit is refused: the charge applied once.
    match &stale.await?.outcome {
        Outcome::Retryable(msg) => assert!(msg.contains("claim lost"), "{msg}"),
        other => bail!("expected a claim-lost error, got {other:?}"),
    }
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("1"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_effect_applies_nothing_and_releases_the_claim() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let failing = json!({"op": "run", "key": "E", "incr": ["charges"], "then": "fail"});
    let report = run(&sandbox, "t1", 1, failing).await;
    assert!(
        matches!(&report.outcome, Outcome::Retryable(m) if m == "the effect failed"),
        "{:?}",
        report.outcome
    );
    assert_eq!(get(&redis, &kv("charges")).await?, None);
    assert_eq!(claim_field(&redis, "E", "state").await?, None);

    let report = run(&sandbox, "t1", 2, charge("E", 0)).await;
    assert_eq!(
        success(&report)?,
        json!({"outcome": "executed", "value": [1]})
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_effect_applies_nothing_and_its_claim_waits_for_the_lease() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let panicking = json!({"op": "run", "key": "F", "incr": ["charges"], "then": "panic"});
    let report = run(&sandbox, "t1", 1, panicking).await;
    assert!(
        matches!(report.outcome, Outcome::Trapped(Trap::GuestPanic(_))),
        "{:?}",
        report.outcome
    );
    assert_eq!(get(&redis, &kv("charges")).await?, None);
    assert_eq!(
        claim_field(&redis, "F", "state").await?.as_deref(),
        Some("running")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_commit_after_the_claim_was_taken_over_applies_nothing() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let running = {
        let sandbox = sandbox.clone();
        tokio::spawn(async move { run(&sandbox, "t1", 1, charge("G", 600)).await })
    };
    wait_claim(&redis, "G", "running").await?;
    // Another owner takes the claim, as one would after this owner's lease
    // ran out during a partition.
    let mut conn = redis.conn().await?;
    let _: () = redis::cmd("HSET")
        .arg(claim("G"))
        .arg("owner")
        .arg("someone-else")
        .query_async(&mut conn)
        .await?;
    let report = running.await?;
    match &report.outcome {
        Outcome::Retryable(msg) => assert!(msg.contains("claim lost"), "{msg}"),
        other => bail!("expected a retryable claim-lost error, got {other:?}"),
    }
    assert_eq!(get(&redis, &kv("charges")).await?, None);
    assert_eq!(get(&redis, &kv("email")).await?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_commit_reply_is_resolved_without_a_second_apply() -> Result<()> {
    let redis = RedisServer::start()?;
    let proxy = ReplyEater::start(redis.port()).await?;
    // A lease long enough that no renewal is sent while the reply is eaten.
    let sandbox = sandbox_at(
        &proxy.url(),
        Duration::from_secs(5),
        Duration::from_secs(30),
    )
    .await?;
    // Every script is loaded, so the commit below runs at its first send.
    let warm = run(&sandbox, "t0", 1, charge("warm", 0)).await;
    assert_eq!(success(&warm)?["outcome"], "executed");

    let running = {
        let sandbox = sandbox.clone();
        tokio::spawn(async move { run(&sandbox, "t1", 1, charge("H", 300)).await })
    };
    wait_claim(&redis, "H", "running").await?;
    // The commit reaches Redis and applies; its reply is dropped and the
    // connection cut. The host cannot know whether it applied: it sends it
    // again, as the same owner.
    proxy.eat_commit_reply();
    let report = running.await?;
    assert_eq!(proxy.eaten(), 1, "no reply was lost");
    assert_eq!(
        success(&report)?,
        json!({"outcome": "executed", "value": [2]})
    );
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("2"));
    assert_eq!(
        claim_field(&redis, "H", "state").await?.as_deref(),
        Some("done")
    );
    Ok(())
}

/// A TCP proxy in front of Redis that can lose a commit's reply: once
/// [`ReplyEater::eat_commit_reply`] is called, the first chunk Redis sends
/// after a request with a staged `incrby` went up is dropped and every
/// connection through the proxy is cut, as a network fault between a
/// command's execution and its reply would.
struct ReplyEater {
    port: u16,
    state: std::sync::Arc<EaterState>,
    _accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct EaterState {
    /// Watching for the commit (a request naming a staged `incrby`).
    armed: std::sync::atomic::AtomicBool,
    /// The commit went up: eat the next reply.
    eat: std::sync::atomic::AtomicBool,
    eaten: std::sync::atomic::AtomicU64,
    /// Cut every connection when notified.
    cut: tokio::sync::Notify,
}

impl ReplyEater {
    async fn start(redis_port: u16) -> Result<Self> {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = std::sync::Arc::new(EaterState::default());
        let shared = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", redis_port)).await
                else {
                    continue;
                };
                let state = shared.clone();
                tokio::spawn(async move {
                    let (mut client_rx, mut client_tx) = client.into_split();
                    let (mut server_rx, mut server_tx) = server.into_split();
                    let up = async {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = client_rx.read(&mut buf).await?;
                            if n == 0 {
                                return Ok::<_, std::io::Error>(());
                            }
                            let commit = buf[..n].windows(6).any(|w| w == b"incrby");
                            if commit && state.armed.swap(false, Ordering::SeqCst) {
                                state.eat.store(true, Ordering::SeqCst);
                            }
                            server_tx.write_all(&buf[..n]).await?;
                        }
                    };
                    let down = async {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = server_rx.read(&mut buf).await?;
                            if n == 0 {
                                return Ok::<_, std::io::Error>(());
                            }
                            if state.eat.swap(false, Ordering::SeqCst) {
                                state.eaten.fetch_add(1, Ordering::SeqCst);
                                state.cut.notify_waiters();
                                return Ok(());
                            }
                            client_tx.write_all(&buf[..n]).await?;
                        }
                    };
                    // Dropping both halves closes both sockets.
                    tokio::select! {
                        _ = up => {}
                        _ = down => {}
                        () = state.cut.notified() => {}
                    }
                });
            }
        });
        Ok(ReplyEater {
            port,
            state,
            _accept: accept,
        })
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn eat_commit_reply(&self) {
        self.state
            .armed
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn eaten(&self) -> u64 {
        self.state.eaten.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_abandoned_operation_with_external_effects_is_not_run_again() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let cancel = CancelHandle::new();
    let external = json!({"op": "run", "key": "X", "incr": ["charges"], "spin_ms": 60_000,
        "external": true});
    let interrupted = {
        let sandbox = sandbox.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move { sandbox.call(call("t1", 1, external), &cancel).await })
    };
    wait_claim(&redis, "X", "running").await?;
    cancel.cancel();
    interrupted.await?;

    // Another task waits out the dead owner's lease, then finds the
    // operation abandoned.
    let deadline = Instant::now() + LEASE * 5;
    let mut waited = 0;
    loop {
        let report = run(&sandbox, "t2", 1, charge("X", 0)).await;
        let result = success(&report)?;
        if result["outcome"] == "abandoned" {
            break;
        }
        assert_eq!(result, json!({"outcome": "in_progress"}));
        waited += 1;
        if Instant::now() > deadline {
            bail!("the operation never showed as abandoned");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(waited > 0, "the lease of a dead owner was not waited for");
    // The task's own next attempt and the seed form treat it as done
    // elsewhere: at most once.
    let next = run(&sandbox, "t1", 2, charge("X", 0)).await;
    assert_eq!(success(&next)?, json!({"outcome": "abandoned"}));
    let seed = run(
        &sandbox,
        "t3",
        1,
        json!({"op": "seed", "key": "X", "incr": "charges"}),
    )
    .await;
    assert_eq!(success(&seed)?, json!({"executed": false}));
    assert_eq!(get(&redis, &kv("charges")).await?, None);
    Ok(())
}

// ------------------------------------------- Redis errors in host imports

#[tokio::test(flavor = "multi_thread")]
async fn a_write_without_a_reply_is_an_unknown_outcome_not_a_failure() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox_with(&redis, Duration::from_millis(300)).await?;
    // The write script is loaded first, so the paused write runs once Redis
    // takes writes again (rather than finding no script).
    let warm = run(&sandbox, "t0", 1, json!({"op": "incr", "key": "warm"})).await;
    assert_eq!(success(&warm)?, json!({"value": 1}));
    let mut conn = redis.conn().await?;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1_500)
        .arg("WRITE")
        .query_async(&mut conn)
        .await?;
    let report = run(&sandbox, "t1", 1, json!({"op": "incr", "key": "n"})).await;
    let result = success(&report)?;
    assert_eq!(result["refusal"], "OutcomeUnknown", "{result}");
    // And indeed it applied, once Redis took writes again.
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&redis, &kv("n")).await?.as_deref() != Some("1") {
        if Instant::now() > deadline {
            bail!("the increment never applied");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_read_is_tried_again_on_a_broken_connection() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let mut conn = redis.conn().await?;
    let _: () = redis::cmd("SET")
        .arg(kv("k"))
        .arg("v")
        .query_async(&mut conn)
        .await?;
    // The sandbox's connection is up (a first call used it); kill it.
    let warm = run(&sandbox, "t0", 1, json!({"op": "get", "key": "k"})).await;
    assert_eq!(success(&warm)?, json!({"value": "v"}));
    let my_id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut conn)
        .await?;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(sandbox_client_id(&mut conn, my_id).await?)
        .query_async(&mut conn)
        .await?;
    let report = run(&sandbox, "t1", 1, json!({"op": "get", "key": "k"})).await;
    assert_eq!(success(&report)?, json!({"value": "v"}));
    Ok(())
}

/// The id of the one client other than `mine`: the sandbox's connection.
async fn sandbox_client_id(conn: &mut redis::aio::MultiplexedConnection, mine: i64) -> Result<i64> {
    let list: String = redis::cmd("CLIENT").arg("LIST").query_async(conn).await?;
    let ids: Vec<i64> = list
        .lines()
        .filter_map(|line| line.strip_prefix("id=")?.split(' ').next()?.parse().ok())
        .filter(|id| *id != mine)
        .collect();
    match ids.as_slice() {
        [id] => Ok(*id),
        other => bail!("expected one other client, found {other:?}:\n{list}"),
    }
}

// ------------------------------------------------------- bad arguments

#[tokio::test(flavor = "multi_thread")]
async fn operations_cannot_nest_and_ttls_are_bounded() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let nest = success(&run(&sandbox, "t1", 1, json!({"op": "nest"})).await)?;
    assert_eq!(nest["fatal"], true, "{nest}");
    let message = nest["error"].as_str().context("nesting did not fail")?;
    assert!(message.contains("cannot nest"), "{message}");

    for seconds in [0u32, 31 * 86_400] {
        let ttl = success(&run(&sandbox, "t1", 1, json!({"op": "ttl", "seconds": seconds})).await)?;
        for what in ["set", "operation"] {
            let text = ttl[what].as_str().context("no message")?;
            assert!(
                text.contains("invalid argument"),
                "{seconds} s, {what}: {text}"
            );
        }
    }
    let ok = success(&run(&sandbox, "t1", 1, json!({"op": "ttl", "seconds": 60})).await)?;
    assert_eq!(ok, json!({"set": "ok", "operation": "ok"}));
    Ok(())
}

// ---------------------------------------------------------- namespaces

#[tokio::test(flavor = "multi_thread")]
async fn kv_keys_cannot_reach_claims() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let done = run(&sandbox, "t1", 1, charge("K", 0)).await;
    assert_eq!(
        success(&done)?,
        json!({"outcome": "executed", "value": [1]})
    );
    let forged = success(&run(&sandbox, "t2", 1, json!({"op": "forge", "key": "K"})).await)?;
    // The guest wrote and deleted every name it could think of; the claim
    // and its result are untouched.
    assert_eq!(forged["stored"], json!([1]), "{forged}");
    assert_eq!(
        claim_field(&redis, "K", "state").await?.as_deref(),
        Some("done")
    );
    for key in redis.keys().await? {
        assert!(
            key.starts_with("dtq:guest:{operations}:")
                || key == claim("K")
                || key == "dtq:quota:{operations}"
                || key == "dtq:quota-claims:{operations}",
            "{key}"
        );
    }
    let again = run(&sandbox, "t3", 1, charge("K", 0)).await;
    assert_eq!(success(&again)?, json!({"outcome": "done", "value": [1]}));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_component_gets_the_namespace_it_asks_for_only_when_the_operator_grants_it() -> Result<()>
{
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis).await?;
    let wasm = std::fs::read(guests::NAMESPACED)?;

    let refused = sandbox.load("billing-v2", &wasm).unwrap_err();
    let message = refused.to_string();
    assert!(
        matches!(&refused, SandboxError::Handler { source, .. }
            if matches!(**source, SandboxError::NamespaceNotGranted { .. })),
        "{message}"
    );
    assert!(
        message.contains("--namespace billing-v2=shared-ns"),
        "{message}"
    );
    let other = HandlerSettings {
        namespace: Some("send_receipt".into()),
        ..HandlerSettings::default()
    };
    assert!(sandbox.load_with("billing-v2", &wasm, &other).is_err());
    assert!(!sandbox.has_handler("billing-v2"));

    let granted = HandlerSettings {
        namespace: Some("shared-ns".into()),
        ..HandlerSettings::default()
    };
    let report = sandbox.load_with("billing-v2", &wasm, &granted)?;
    assert_eq!(report.namespace, "shared-ns");
    let mut call = call("t1", 1, json!({"key": "k", "value": "v"}));
    call.task = "billing-v2".into();
    let report = sandbox.call(call, &CancelHandle::new()).await;
    assert_eq!(success(&report)?, json!({"ok": true}));
    let mut keys = redis.keys().await?;
    keys.sort();
    assert_eq!(keys, ["dtq:guest:{shared-ns}:k", "dtq:quota:{shared-ns}"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_can_give_a_handler_another_namespace() -> Result<()> {
    let redis = RedisServer::start()?;
    let config = SandboxConfig {
        cache_dir: Some(shared_cache()),
        handlers: [(
            "operations".to_string(),
            HandlerSettings {
                namespace: Some("billing".into()),
                ..HandlerSettings::default()
            },
        )]
        .into(),
        ..SandboxConfig::default()
    };
    let sandbox = Sandbox::new(config, redis.manager().await?)?;
    let report = sandbox.load("operations", &std::fs::read(guests::OPERATIONS)?)?;
    assert_eq!(report.namespace, "billing");
    let done = run(&sandbox, "t1", 1, charge("N", 0)).await;
    assert_eq!(
        success(&done)?,
        json!({"outcome": "executed", "value": [1]})
    );
    let mut keys = redis.keys().await?;
    keys.sort();
    assert_eq!(
        keys,
        [
            "dtq:claim:{billing}:N",
            "dtq:guest:{billing}:charges",
            "dtq:guest:{billing}:email",
            "dtq:quota-claims:{billing}",
            "dtq:quota:{billing}"
        ]
    );
    Ok(())
}
