//! The sandbox against a real `redis-server` and real guest components:
//! the example handlers, every limit obeyed and violated, the adversarial
//! guest contained, cancellation, and the artifact cache.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use dtq_host::sandbox::{
    AllowList, Call, CallReport, CancelHandle, HandlerSettings, Limit, Limits, Outcome, Sandbox,
    SandboxConfig, SlotReset, TaskContext, Trap,
};
use dtq_tests::guests;
use dtq_tests::services::Service;
use dtq_tests::{RedisServer, TempDir};
use dtq_tests::{success, trap};
use serde_json::{Value, json};

/// Artifacts shared by the tests of this binary, so each module is compiled
/// once per engine configuration rather than once per test. Cache behaviour
/// itself is tested with private directories.
fn shared_cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("sandbox-artifacts")
}

async fn sandbox(redis: &RedisServer, limits: Limits) -> Result<Sandbox> {
    sandbox_in(redis, limits, Some(shared_cache())).await
}

async fn sandbox_in(
    redis: &RedisServer,
    limits: Limits,
    cache_dir: Option<PathBuf>,
) -> Result<Sandbox> {
    let config = SandboxConfig {
        limits,
        cache_dir,
        max_concurrent_calls: 64,
        ..SandboxConfig::default()
    };
    Ok(Sandbox::new(config, redis.manager().await?)?)
}

/// A sandbox with the `adversarial` guest loaded under its own name.
async fn adversarial(redis: &RedisServer, limits: Limits) -> Result<Sandbox> {
    let sandbox = sandbox(redis, limits).await?;
    load(&sandbox, "adversarial", guests::ADVERSARIAL)?;
    Ok(sandbox)
}

fn load(sandbox: &Sandbox, task: &str, path: &str) -> Result<()> {
    let wasm = std::fs::read(path).with_context(|| format!("read {path}"))?;
    sandbox.load(task, &wasm)?;
    Ok(())
}

fn call(task: &str, payload: Value) -> Call {
    Call {
        task: task.to_string(),
        ctx: TaskContext {
            task_id: uuid::Uuid::now_v7().to_string(),
            queue: "default".to_string(),
            task_name: task.to_string(),
            attempt: 1,
            max_attempts: 3,
            idempotency_key: None,
        },
        payload: payload.to_string(),
        deadline: None,
    }
}

async fn run(sandbox: &Sandbox, task: &str, payload: Value) -> CallReport {
    sandbox
        .call(call(task, payload), &CancelHandle::new())
        .await
}

/// `{"ok": true}` from the adversarial guest: the sandbox still works.
async fn still_ok(sandbox: &Sandbox) -> Result<()> {
    let report = run(sandbox, "adversarial", json!({"op": "ok"})).await;
    assert_eq!(success(&report)?, json!({"ok": true}));
    Ok(())
}

/// Every key in Redis but the namespaces' budgets (`dtq:quota:{ns}` and
/// its indexes), the host's bookkeeping of the guests' writes.
async fn guest_keys(redis: &RedisServer) -> Result<Vec<String>> {
    let mut keys = redis.keys().await?;
    keys.retain(|k| !k.starts_with("dtq:quota"));
    Ok(keys)
}

async fn get(redis: &RedisServer, key: &str) -> Result<Option<String>> {
    let mut conn = redis.conn().await?;
    Ok(redis::cmd("GET").arg(key).query_async(&mut conn).await?)
}

// ---------------------------------------------------------------- examples

#[tokio::test(flavor = "multi_thread")]
async fn load_dir_loads_every_example() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    let report = sandbox.load_dir(Path::new(guests::EXAMPLES_DIR))?;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    let mut loaded = report.loaded;
    loaded.sort();
    let mut expected: Vec<String> = [
        "counter",
        "echo",
        "fan_out",
        "flaky",
        "order_total",
        "send_receipt",
        "sleep",
        "square",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    expected.sort();
    assert_eq!(loaded, expected);
    assert_eq!(sandbox.handlers(), expected);
    assert!(sandbox.has_handler("echo"));
    assert!(!sandbox.has_handler("nope"));

    let report = run(&sandbox, "nope", json!({})).await;
    assert_eq!(trap(&report)?, Trap::UnknownHandler("nope".to_string()));
    assert!(!report.outcome.is_retryable());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_file_in_the_handlers_directory_is_skipped_and_the_rest_load() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    let dir = TempDir::new("handlers")?;
    std::fs::copy(guests::ECHO, dir.path.join("echo.wasm"))?;
    std::fs::write(dir.path.join("broken.wasm"), b"not wasm at all")?;
    std::fs::copy(guests::COUNTER, dir.path.join("counter.wasm"))?;
    let report = sandbox.load_dir(&dir.path)?;
    assert_eq!(report.loaded, ["counter", "echo"]);
    match report.failed.as_slice() {
        [(file, error)] => {
            assert!(file.ends_with("broken.wasm"), "{}", file.display());
            let error = error.to_string();
            assert!(error.contains("broken"), "{error}");
            assert!(!error.contains('\n'), "one line: {error}");
        }
        other => bail!("expected one failure, got {other:?}"),
    }
    let report = run(&sandbox, "echo", json!({"x": 1})).await;
    assert_eq!(success(&report)?, json!({"x": 1}));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn counter_increments_in_its_namespace() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    load(&sandbox, "counter", guests::COUNTER)?;

    let first = run(&sandbox, "counter", json!({"name": "visits"})).await;
    assert_eq!(success(&first)?, json!({"name": "visits", "value": 1}));
    assert_eq!(first.host_calls, 1);
    let second = run(&sandbox, "counter", json!({"name": "visits", "by": 5})).await;
    assert_eq!(success(&second)?, json!({"name": "visits", "value": 6}));

    assert_eq!(
        get(&redis, "dtq:guest:{counter}:counter:visits")
            .await?
            .as_deref(),
        Some("6")
    );
    assert_eq!(
        guest_keys(&redis).await?,
        vec!["dtq:guest:{counter}:counter:visits"]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn echo_returns_the_payload_byte_for_byte() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    load(&sandbox, "echo", guests::ECHO)?;

    let payload = r#"{"b": [1, 2.50, "x"],   "a": null}"#;
    let mut request = call("echo", json!(null));
    request.payload = payload.to_string();
    let report = sandbox.call(request, &CancelHandle::new()).await;
    assert_eq!(report.outcome, Outcome::Success(payload.to_string()));
    assert_eq!(report.host_calls, 0);
    Ok(())
}

/// The waiting guests of the in-flight bench wait what they are asked to
/// (on a host timer) and say so; `waiter_raw` refuses a payload that is not
/// a number of milliseconds.
#[tokio::test(flavor = "multi_thread")]
async fn the_waiters_wait_as_asked() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    load(&sandbox, "waiter", guests::WAITER)?;
    load(&sandbox, "waiter_raw", guests::WAITER_RAW)?;

    for (task, payload, result) in [
        ("waiter", json!({"ms": 200}), json!({"waited_ms": 200})),
        ("waiter_raw", json!(200), json!(200)),
    ] {
        let started = Instant::now();
        let report = sandbox
            .call(call(task, payload), &CancelHandle::new())
            .await;
        assert_eq!(success(&report)?, result, "{task}");
        assert!(started.elapsed() >= Duration::from_millis(200), "{task}");
    }

    let report = sandbox
        .call(call("waiter_raw", json!({"ms": 200})), &CancelHandle::new())
        .await;
    assert!(
        matches!(&report.outcome, Outcome::Fatal(msg) if msg.contains("milliseconds")),
        "{:?}",
        report.outcome
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn flaky_is_retryable_until_its_attempt() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    load(&sandbox, "flaky", guests::FLAKY)?;

    for attempt in 1..=3 {
        let mut request = call("flaky", json!({"succeed_on_attempt": 3}));
        request.ctx.attempt = attempt;
        let report = sandbox.call(request, &CancelHandle::new()).await;
        if attempt < 3 {
            assert!(
                matches!(&report.outcome, Outcome::Retryable(msg) if msg.contains("fails on purpose")),
                "attempt {attempt}: {:?}",
                report.outcome
            );
            assert!(report.outcome.is_retryable());
        } else {
            assert_eq!(success(&report)?, json!({"attempt": 3}));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn sleep_spins_and_returns() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    load(&sandbox, "sleep", guests::SLEEP)?;

    let report = run(&sandbox, "sleep", json!({"ms": 100})).await;
    assert_eq!(success(&report)?, json!({"slept_ms": 100}));
    assert!(
        report.elapsed >= Duration::from_millis(100),
        "{:?}",
        report.elapsed
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn order_total_prices_an_order() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    load(&sandbox, "order_total", guests::ORDER_TOTAL)?;

    let order = json!({
        "lines": [
            {"sku": "TEA-1", "quantity": 3, "unit_price_cents": 450, "tax_rate_bp": 700},
            {"sku": "MUG-2", "quantity": 1, "unit_price_cents": 1299}
        ],
        "shipping_cents": 500
    });
    let totals = success(&run(&sandbox, "order_total", order).await)?;
    assert_eq!(totals["item_count"], 4);
    assert_eq!(totals["subtotal_cents"], 2649);
    assert_eq!(totals["tax_cents"], 95);
    assert_eq!(totals["total_cents"], 3244);
    assert_eq!(totals["lines"][0]["total_cents"], 1445);

    let report = run(&sandbox, "order_total", json!({"lines": []})).await;
    assert!(
        matches!(report.outcome, Outcome::Fatal(_)),
        "{:?}",
        report.outcome
    );
    Ok(())
}

/// A sandbox with `send_receipt` loaded and allowed to reach loopback, where
/// the tests' payment and email services listen.
async fn send_receipt(redis: &RedisServer) -> Result<Sandbox> {
    let sandbox = sandbox(redis, Limits::default()).await?;
    let settings = HandlerSettings {
        allow_hosts: AllowList::parse("http://127.0.0.1:*")?,
        ..HandlerSettings::default()
    };
    sandbox.load_with(
        "send_receipt",
        &std::fs::read(guests::SEND_RECEIPT)?,
        &settings,
    )?;
    Ok(sandbox)
}

/// A `send_receipt` payload for `order_id` that charges through `payments`
/// and emails through `emails`.
fn order(order_id: &str, amount_cents: u64, payments: &Service, emails: &Service) -> Value {
    json!({
        "order_id": order_id,
        "amount_cents": amount_cents,
        "payment_url": payments.url(),
        "email_url": emails.url(),
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn send_receipt_charges_once_then_dedupes() -> Result<()> {
    let redis = RedisServer::start()?;
    let (payments, emails) = (Service::start()?, Service::start()?);
    let sandbox = send_receipt(&redis).await?;

    let order = order("A-1", 1999, &payments, &emails);
    let first = run(&sandbox, "send_receipt", order.clone()).await;
    assert_eq!(
        success(&first)?,
        json!({"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true})
    );
    let second = run(&sandbox, "send_receipt", order).await;
    assert_eq!(
        success(&second)?,
        json!({"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true, "deduped": true})
    );

    assert_eq!(payments.charges_for("A-1"), 1, "{:?}", payments.charges());
    assert_eq!(payments.charges()[0].amount_cents, 1999);
    let sent = emails.emails();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].body["amount_cents"], 1999);
    assert_eq!(sent[0].body["charge_id"], "ch_1");
    assert_eq!(sent[0].body["to"], "customer-of-A-1@example.com");
    // Each effect was asked for once, with the key the host adds inside an
    // operation.
    let charge_requests = payments.requests_to("/charges");
    assert_eq!(charge_requests.len(), 1, "{charge_requests:?}");
    assert!(charge_requests[0].idempotency_key.is_some());
    assert_eq!(emails.requests_to("/emails").len(), 1);

    // The claim is done, holds the stored result (what the second run read
    // its charge from), and has the TTL the guest asked for.
    let claim = "dtq:claim:{send_receipt}:charge:A-1";
    let mut conn = redis.conn().await?;
    let (state, result): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(claim)
        .arg("state")
        .arg("result")
        .query_async(&mut conn)
        .await?;
    assert_eq!(state.as_deref(), Some("done"));
    assert_eq!(result.as_deref(), Some(r#"{"charge_id":"ch_1"}"#));
    let ttl: i64 = redis::cmd("TTL").arg(claim).query_async(&mut conn).await?;
    assert!(ttl > 86_000, "ttl {ttl}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn send_receipt_fifty_concurrent_duplicates_charge_once() -> Result<()> {
    let redis = RedisServer::start()?;
    let (payments, emails) = (Service::start()?, Service::start()?);
    let sandbox = send_receipt(&redis).await?;

    let order = order("race-7", 500, &payments, &emails);
    let calls = (0..50).map(|_| {
        let sandbox = sandbox.clone();
        let order = order.clone();
        tokio::spawn(async move { run(&sandbox, "send_receipt", order).await })
    });
    // One call charges. The others find the operations done, or still in
    // progress in another call: a retryable error, never a success that
    // claims the charge happened. The call that charged may itself find
    // the receipt in progress, taken by a call that found the charge done
    // between its commit and its next begin: then none reports the charge,
    // and the payment service's count below is what shows it was made once.
    let (mut charged, mut deduped, mut in_progress) = (0, 0, 0);
    for report in futures::future::join_all(calls).await {
        let report = report?;
        if let Outcome::Retryable(msg) = &report.outcome {
            assert!(msg.contains("in progress"), "{msg}");
            in_progress += 1;
            continue;
        }
        let result = success(&report)?;
        let mut receipt = json!({"order_id": "race-7", "charge_id": "ch_1", "receipt_sent": true});
        if result == receipt {
            charged += 1;
            continue;
        }
        receipt["deduped"] = json!(true);
        if result == receipt {
            deduped += 1;
        } else {
            bail!("unexpected result {result}");
        }
    }
    assert!(charged <= 1, "{charged} calls report the charge");
    assert!(charged + deduped >= 1, "no call sent the receipt");
    assert_eq!(charged + deduped + in_progress, 50);
    assert_eq!(
        payments.charges_for("race-7"),
        1,
        "{:?}",
        payments.charges()
    );
    assert_eq!(payments.requests_to("/charges").len(), 1);
    assert_eq!(emails.emails_for("race-7"), 1, "{:?}", emails.emails());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn namespaced_guest_writes_under_its_granted_namespace() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    let wasm = std::fs::read(guests::NAMESPACED)?;
    let granted = HandlerSettings {
        namespace: Some("shared-ns".into()),
        ..HandlerSettings::default()
    };
    let report = sandbox.load_with("billing-v2", &wasm, &granted)?;
    assert_eq!(report.namespace, "shared-ns");

    let result = run(&sandbox, "billing-v2", json!({"key": "k", "value": "v"})).await;
    assert_eq!(success(&result)?, json!({"ok": true}));
    assert_eq!(guest_keys(&redis).await?, vec!["dtq:guest:{shared-ns}:k"]);
    assert_eq!(
        get(&redis, "dtq:guest:{shared-ns}:k").await?.as_deref(),
        Some("v")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_modules_are_refused() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    assert!(sandbox.load("junk", b"not wasm at all").is_err());
    // A task name that is not a valid namespace needs a namespace section.
    let wasm = std::fs::read(guests::ECHO)?;
    assert!(sandbox.load("bad:name", &wasm).is_err());
    assert!(sandbox.load("", &wasm).is_err());
    assert!(sandbox.handlers().is_empty());
    Ok(())
}

// ------------------------------------------------------------ redis errors

#[tokio::test(flavor = "multi_thread")]
async fn wrong_type_and_unavailable_redis_reach_the_guest_as_host_errors() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    load(&sandbox, "counter", guests::COUNTER)?;

    let mut conn = redis.conn().await?;
    let () = redis::cmd("SET")
        .arg("dtq:guest:{counter}:counter:text")
        .arg("not a number")
        .query_async(&mut conn)
        .await?;
    let report = run(&sandbox, "counter", json!({"name": "text"})).await;
    assert!(
        matches!(&report.outcome, Outcome::Retryable(msg) if msg.contains("wrong type")),
        "{:?}",
        report.outcome
    );

    // Redis goes away. The increment in flight when the connection broke may
    // or may not have reached it: an unknown outcome, never "not applied".
    // Once the server refuses connections, nothing can have been written.
    drop(redis);
    let report = run(&sandbox, "counter", json!({"name": "visits"})).await;
    assert!(
        matches!(&report.outcome, Outcome::Retryable(msg)
            if msg.contains("outcome unknown") || msg.contains("unavailable")),
        "{:?}",
        report.outcome
    );
    let report = run(&sandbox, "counter", json!({"name": "visits"})).await;
    assert!(
        matches!(&report.outcome, Outcome::Retryable(msg) if msg.contains("unavailable")),
        "{:?}",
        report.outcome
    );
    Ok(())
}

// ------------------------------------------------------------------ limits

#[tokio::test(flavor = "multi_thread")]
async fn deadline_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;

    let mut short = call("adversarial", json!({"op": "sleep", "ms": 50}));
    short.deadline = Some(Duration::from_secs(5));
    let report = sandbox.call(short, &CancelHandle::new()).await;
    assert_eq!(success(&report)?, json!({"slept_ms": 50}));

    let mut endless = call("adversarial", json!({"op": "loop"}));
    endless.deadline = Some(Duration::from_millis(300));
    let report = sandbox.call(endless, &CancelHandle::new()).await;
    assert_eq!(trap(&report)?, Trap::DeadlineExceeded);
    assert!(report.outcome.is_retryable());
    assert!(
        report.elapsed >= Duration::from_millis(300),
        "{:?}",
        report.elapsed
    );
    assert!(
        report.elapsed < Duration::from_secs(3),
        "{:?}",
        report.elapsed
    );
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn task_deadline_is_capped_by_the_limit() -> Result<()> {
    let redis = RedisServer::start()?;
    let limits = Limits {
        deadline: Duration::from_millis(300),
        ..Limits::default()
    };
    let sandbox = adversarial(&redis, limits).await?;
    let mut endless = call("adversarial", json!({"op": "loop"}));
    endless.deadline = Some(Duration::from_secs(3600));
    let report = sandbox.call(endless, &CancelHandle::new()).await;
    assert_eq!(trap(&report)?, Trap::DeadlineExceeded);
    assert!(
        report.elapsed < Duration::from_secs(3),
        "{:?}",
        report.elapsed
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn deadline_interrupts_a_guest_waiting_on_redis() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    load(&sandbox, "counter", guests::COUNTER)?;

    // Redis holds every write for 5 s: the guest sits in the `incr-by`
    // import, where no epoch check runs.
    let mut conn = redis.conn().await?;
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(5000)
        .arg("WRITE")
        .query_async(&mut conn)
        .await?;
    let mut request = call("counter", json!({"name": "paused"}));
    request.deadline = Some(Duration::from_millis(300));
    let report = sandbox.call(request, &CancelHandle::new()).await;
    assert_eq!(trap(&report)?, Trap::DeadlineExceeded);
    assert!(
        report.elapsed < Duration::from_secs(3),
        "{:?}",
        report.elapsed
    );
    let () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async(&mut conn)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;

    let report = run(&sandbox, "adversarial", json!({"op": "alloc", "mb": 16})).await;
    assert_eq!(success(&report)?, json!({"allocated_mb": 16}));

    let report = run(&sandbox, "adversarial", json!({"op": "alloc", "mb": 100})).await;
    assert_eq!(trap(&report)?, Trap::OutOfMemory);
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn fuel_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let limits = Limits {
        fuel: Some(50_000_000),
        ..Limits::default()
    };
    let sandbox = adversarial(&redis, limits).await?;

    still_ok(&sandbox).await?;
    let report = run(&sandbox, "adversarial", json!({"op": "loop"})).await;
    assert_eq!(trap(&report)?, Trap::LimitExceeded(Limit::Fuel));
    assert!(
        report.elapsed < Duration::from_secs(10),
        "{:?}",
        report.elapsed
    );
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn payload_size_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let limits = Limits {
        max_payload_bytes: 1024,
        ..Limits::default()
    };
    let sandbox = sandbox(&redis, limits).await?;
    load(&sandbox, "echo", guests::ECHO)?;

    let fits = json!("x".repeat(1000));
    let report = run(&sandbox, "echo", fits.clone()).await;
    assert_eq!(success(&report)?, fits);

    let report = run(&sandbox, "echo", json!("x".repeat(2000))).await;
    assert_eq!(trap(&report)?, Trap::LimitExceeded(Limit::Payload));
    assert!(!report.outcome.is_retryable());
    assert_eq!(report.host_calls, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn result_size_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let limits = Limits {
        max_result_bytes: 4096,
        ..Limits::default()
    };
    let sandbox = adversarial(&redis, limits).await?;

    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "big_result", "bytes": 1000}),
    )
    .await;
    assert_eq!(success(&report)?["data"].as_str().map(str::len), Some(1000));

    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "big_result", "bytes": 10_000}),
    )
    .await;
    assert_eq!(trap(&report)?, Trap::LimitExceeded(Limit::Result));
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn big_result_under_default_limits_is_contained() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "big_result", "bytes": 8 << 20}),
    )
    .await;
    // Past the host-call data cap the result is not even copied out.
    assert_eq!(trap(&report)?, Trap::LimitExceeded(Limit::HostCallData));
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "big_result", "bytes": 2 << 20}),
    )
    .await;
    assert_eq!(trap(&report)?, Trap::LimitExceeded(Limit::Result));
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn log_bytes_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let limits = Limits {
        max_log_bytes: 4096,
        ..Limits::default()
    };
    let sandbox = adversarial(&redis, limits).await?;

    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "log_spam", "bytes": 1000}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"written": 1000}));
    assert!(report.log.starts_with("INFO xxx"), "{}", report.log);
    assert!(!report.log.contains("truncated"), "{}", report.log);
    assert!(report.log.len() > 1000, "{}", report.log.len());

    // Over the cap: kept up to the cap, marked, and still a success.
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "log_spam", "bytes": 100_000}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"written": 100_000}));
    assert!(report.log.len() < 4096 + 200, "{}", report.log.len());
    assert!(
        report.log.trim_end().ends_with("more bytes dropped]"),
        "{}",
        &report.log[report.log.len().saturating_sub(200)..]
    );

    // stdout shares the cap; writes past it are dropped, not refused.
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "stdout", "bytes": 100_000}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"written": 100_000}));
    assert!(
        report.log.starts_with("[stdout] xxxx"),
        "{}",
        &report.log[..100]
    );
    assert!(report.log.len() < 4096 + 200);
    assert!(report.log.contains("log truncated"));

    // A flood of lines past the host-call limit is truncated too: log
    // writes do not count as host calls.
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "log_spam", "bytes": 100 * 25_000}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"written": 100 * 25_000}));
    assert!(report.log.contains("log truncated"));
    assert_eq!(report.host_calls, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_import_call_cannot_make_the_host_copy_more_than_its_data_cap() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;
    // Two fields naming one 1 MiB buffer: 2 MiB copied, under the 4 MiB cap,
    // and the line is cut at the log cap, not assembled.
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "log_fields", "mb": 1, "n": 2}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"fields": 2}));
    assert!(report.log.contains("log truncated"), "{}", report.log.len());
    assert!(report.log.len() < (64 << 10) + 200, "{}", report.log.len());
    // Three hundred of them would be 300 MiB of host memory: refused.
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "log_fields", "mb": 1, "n": 300}),
    )
    .await;
    assert_eq!(trap(&report)?, Trap::LimitExceeded(Limit::HostCallData));
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_result_that_is_not_json_fails_the_task() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "raw_result", "text": "{not json"}),
    )
    .await;
    assert!(
        matches!(&report.outcome, Outcome::Fatal(msg) if msg.starts_with("the handler's result is not JSON")),
        "{:?}",
        report.outcome
    );
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "raw_result", "text": "[1, 2]"}),
    )
    .await;
    assert_eq!(success(&report)?, json!([1, 2]));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unclassified_trap_says_its_cause_first_and_logs_the_backtrace() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;
    let report = run(&sandbox, "adversarial", json!({"op": "oob"})).await;
    match trap(&report)? {
        Trap::Other(cause) => {
            assert!(cause.contains("out of bounds memory access"), "{cause}");
            assert!(!cause.contains("backtrace"), "{cause}");
        }
        other => bail!("expected an unclassified trap, got {other:?}"),
    }
    assert!(report.log.contains("[dtq] trap: "), "{}", report.log);
    assert!(report.log.contains("wasm backtrace"), "{}", report.log);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn host_calls_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let limits = Limits {
        max_host_calls: 100,
        ..Limits::default()
    };
    let sandbox = adversarial(&redis, limits).await?;

    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "host_calls", "n": 100}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"calls": 100}));
    assert_eq!(report.host_calls, 100);

    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "host_calls", "n": 1000}),
    )
    .await;
    assert_eq!(trap(&report)?, Trap::LimitExceeded(Limit::HostCalls));
    assert_eq!(report.host_calls, 101);
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn key_size_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;

    let longest = "k".repeat(512);
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "keys", "keys": [longest], "value": "v"}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"written": 1}));

    for bad in ["k".repeat(513), String::new()] {
        let report = run(
            &sandbox,
            "adversarial",
            json!({"op": "keys", "keys": [bad], "value": "v"}),
        )
        .await;
        assert!(
            matches!(&report.outcome, Outcome::Fatal(msg) if msg.contains("invalid key")),
            "{:?}",
            report.outcome
        );
    }
    assert_eq!(
        guest_keys(&redis).await?,
        vec![format!("dtq:guest:{{adversarial}}:{}", "k".repeat(512))]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn value_size_obeyed_and_violated() -> Result<()> {
    let redis = RedisServer::start()?;
    let limits = Limits {
        max_value_bytes: 1000,
        ..Limits::default()
    };
    let sandbox = adversarial(&redis, limits).await?;

    let fits = "v".repeat(1000);
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "keys", "keys": ["a"], "value": fits}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"written": 1}));

    let too_big = "v".repeat(1001);
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "keys", "keys": ["b"], "value": too_big}),
    )
    .await;
    assert!(
        matches!(&report.outcome, Outcome::Fatal(msg) if msg.contains("1001 bytes")),
        "{:?}",
        report.outcome
    );
    assert_eq!(guest_keys(&redis).await?, vec!["dtq:guest:{adversarial}:a"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn stack_overflow_is_contained() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;
    // Modest recursion (serde, the handler macro) is part of every normal
    // call; `ok` proves it fits.
    still_ok(&sandbox).await?;
    let report = run(&sandbox, "adversarial", json!({"op": "stack"})).await;
    assert_eq!(trap(&report)?, Trap::StackOverflow);
    still_ok(&sandbox).await
}

// ------------------------------------------------------------- adversarial

#[tokio::test(flavor = "multi_thread")]
async fn adversarial_ops_are_contained_and_classified() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;

    let cases: Vec<(Value, Trap)> = vec![
        (json!({"op": "loop"}), Trap::DeadlineExceeded),
        (json!({"op": "alloc", "mb": 1024}), Trap::OutOfMemory),
        (json!({"op": "stack"}), Trap::StackOverflow),
        (
            json!({"op": "big_result", "bytes": 2 << 20}),
            Trap::LimitExceeded(Limit::Result),
        ),
    ];
    for (payload, expected) in cases {
        let mut request = call("adversarial", payload.clone());
        // Only the loop needs a short deadline; the others must reach their
        // own limit first, however loaded the machine is.
        request.deadline = Some(if payload["op"] == "loop" {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(20)
        });
        let report = sandbox.call(request, &CancelHandle::new()).await;
        assert_eq!(
            trap(&report)?,
            expected,
            "{payload} after {:?}, log:\n{}",
            report.elapsed,
            report.log
        );
        still_ok(&sandbox).await?;
    }

    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "panic", "message": "boom-42"}),
    )
    .await;
    match trap(&report)? {
        Trap::GuestPanic(msg) => assert!(msg.contains("boom-42"), "{msg}"),
        other => bail!("expected a guest panic, got {other:?}"),
    }
    assert!(report.log.contains("panicked at"), "{}", report.log);
    still_ok(&sandbox).await?;

    for op in ["fatal", "retry"] {
        let report = run(&sandbox, "adversarial", json!({"op": op, "message": "m"})).await;
        let expected = if op == "fatal" {
            Outcome::Fatal("m".into())
        } else {
            Outcome::Retryable("m".into())
        };
        assert_eq!(report.outcome, expected);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn wasi_is_locked_down() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;

    for path in ["/etc/passwd", "Cargo.toml", "."] {
        let report = run(
            &sandbox,
            "adversarial",
            json!({"op": "read_file", "path": path}),
        )
        .await;
        assert_eq!(success(&report)?["ok"], false, "{path}");
    }
    still_ok(&sandbox).await?;

    let report = run(&sandbox, "adversarial", json!({"op": "env"})).await;
    assert_eq!(success(&report)?, json!({"vars": [], "args": []}));

    // A listener that would accept: the connection must still be refused.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    for target in [
        addr.as_str(),
        redis
            .url()
            .trim_start_matches("redis://")
            .trim_end_matches('/'),
    ] {
        let report = run(
            &sandbox,
            "adversarial",
            json!({"op": "tcp", "addr": target}),
        )
        .await;
        let result = success(&report)?;
        assert_eq!(result["ok"], false, "{target}: {result}");
    }
    for host in ["localhost", "example.com"] {
        let report = run(&sandbox, "adversarial", json!({"op": "dns", "host": host})).await;
        let result = success(&report)?;
        assert_eq!(result["ok"], false, "{host}: {result}");
    }
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_cannot_leave_the_namespace() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;
    let keys = json!([
        "../../dtq:task:{q}:x",
        "dtq:idempotency:{q}:k",
        "dtq:task:{default}:victim",
        "\u{0}dtq:stream:{q}",
        "*",
        " dtq:guest:{other}:k",
    ]);
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "keys", "keys": keys, "value": "pwned"}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"written": 6}));
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "claim", "key": "dtq:idempotency:{q}:k"}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"executed": true}));

    let found = guest_keys(&redis).await?;
    assert_eq!(found.len(), 8, "{found:?}");
    for key in &found {
        assert!(
            key.starts_with("dtq:guest:{adversarial}:")
                || key.starts_with("dtq:claim:{adversarial}:"),
            "{key}"
        );
    }
    assert!(found.contains(&"dtq:guest:{adversarial}:../../dtq:task:{q}:x".to_string()));
    assert!(found.contains(&"dtq:claim:{adversarial}:dtq:idempotency:{q}:k".to_string()));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn no_state_survives_between_calls() -> Result<()> {
    let redis = RedisServer::start()?;
    // With this host's reset (PAGEMAP_SCAN where safe), with the `madvise`
    // reset a host falls back to, and with so many slots that each zeroes
    // its fiber stack and keeps one page of its memory (8,192) or none
    // (10,000).
    for (madvise_slot_reset, max_concurrent_calls) in
        [(false, 64), (true, 64), (false, 8_192), (false, 10_000)]
    {
        let config = SandboxConfig {
            madvise_slot_reset,
            max_concurrent_calls,
            ..SandboxConfig::default()
        };
        let sandbox = Sandbox::new(config, redis.manager().await?)?;
        load(&sandbox, "adversarial", guests::ADVERSARIAL)?;
        assert_eq!(
            sandbox.slot_reset() == SlotReset::Madvise,
            madvise_slot_reset
        );
        for _ in 0..5 {
            let report = run(&sandbox, "adversarial", json!({"op": "static_counter"})).await;
            assert_eq!(success(&report)?, json!({"count": 1}));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotent_operation_runs_once() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;
    let first = run(
        &sandbox,
        "adversarial",
        json!({"op": "claim", "key": "once"}),
    )
    .await;
    assert_eq!(success(&first)?, json!({"executed": true}));
    let second = run(
        &sandbox,
        "adversarial",
        json!({"op": "claim", "key": "once"}),
    )
    .await;
    assert_eq!(success(&second)?, json!({"executed": false}));
    assert_eq!(
        get(&redis, "dtq:guest:{adversarial}:claimed:once")
            .await?
            .as_deref(),
        Some("1")
    );
    Ok(())
}

// ------------------------------------------------------------ cancellation

#[tokio::test(flavor = "multi_thread")]
async fn cancel_stops_a_running_loop() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;

    let cancel = CancelHandle::new();
    let running = tokio::spawn({
        let sandbox = sandbox.clone();
        let cancel = cancel.clone();
        async move {
            sandbox
                .call(call("adversarial", json!({"op": "loop"})), &cancel)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let cancelled_at = Instant::now();
    cancel.cancel();
    let report = tokio::time::timeout(Duration::from_secs(2), running).await??;
    assert_eq!(trap(&report)?, Trap::Cancelled);
    assert!(!report.outcome.is_retryable());
    assert!(cancelled_at.elapsed() < Duration::from_secs(2));
    assert!(
        report.elapsed < Duration::from_secs(5),
        "{:?}",
        report.elapsed
    );
    still_ok(&sandbox).await
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_before_the_call_returns_at_once() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = adversarial(&redis, Limits::default()).await?;
    let cancel = CancelHandle::new();
    cancel.cancel();
    let report = sandbox
        .call(call("adversarial", json!({"op": "ok"})), &cancel)
        .await;
    assert_eq!(trap(&report)?, Trap::Cancelled);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_beyond_the_pool_wait_for_a_slot() -> Result<()> {
    let redis = RedisServer::start()?;
    let config = SandboxConfig {
        cache_dir: Some(shared_cache()),
        max_concurrent_calls: 2,
        ..SandboxConfig::default()
    };
    let sandbox = Sandbox::new(config, redis.manager().await?)?;
    load(&sandbox, "adversarial", guests::ADVERSARIAL)?;

    // Six 100 ms calls through two slots take at least three rounds.
    let started = Instant::now();
    let calls = (0..6).map(|_| {
        let sandbox = sandbox.clone();
        tokio::spawn(async move {
            run(&sandbox, "adversarial", json!({"op": "sleep", "ms": 100})).await
        })
    });
    for report in futures::future::join_all(calls).await {
        assert_eq!(success(&report?)?, json!({"slept_ms": 100}));
    }
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );

    // A call waiting for a slot can be cancelled while it waits. The two
    // calls holding the slots loop until cancelled, so nothing here depends
    // on timing.
    let hold = CancelHandle::new();
    let busy: Vec<_> = (0..2)
        .map(|_| {
            let sandbox = sandbox.clone();
            let hold = hold.clone();
            tokio::spawn(async move {
                sandbox
                    .call(call("adversarial", json!({"op": "loop"})), &hold)
                    .await
            })
        })
        .collect();
    let started = Instant::now();
    while sandbox.calls_in_flight() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the busy calls never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let cancel = CancelHandle::new();
    let waiting = tokio::spawn({
        let sandbox = sandbox.clone();
        let cancel = cancel.clone();
        async move {
            sandbox
                .call(call("adversarial", json!({"op": "ok"})), &cancel)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    cancel.cancel();
    let report = tokio::time::timeout(Duration::from_secs(5), waiting).await??;
    assert_eq!(trap(&report)?, Trap::Cancelled);
    assert_eq!(sandbox.calls_in_flight(), 2);

    hold.cancel();
    for report in futures::future::join_all(busy).await {
        assert_eq!(trap(&report?)?, Trap::Cancelled);
    }
    assert_eq!(sandbox.calls_in_flight(), 0);
    still_ok(&sandbox).await
}

// ------------------------------------------------------------------- cache

#[tokio::test(flavor = "multi_thread")]
async fn the_cache_directory_is_private_and_a_writable_one_is_refused() -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;

    let redis = RedisServer::start()?;
    let tmp = TempDir::new("cache-trust")?;
    let fresh = tmp.path.join("fresh");
    sandbox_in(&redis, Limits::default(), Some(fresh.clone())).await?;
    let mode = std::fs::metadata(&fresh)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{mode:o}");

    let shared = tmp.path.join("shared");
    std::fs::create_dir(&shared)?;
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777))?;
    let refused = sandbox_in(&redis, Limits::default(), Some(shared))
        .await
        .map(drop)
        .unwrap_err()
        .to_string();
    assert!(refused.contains("refusing the artifact cache"), "{refused}");
    assert!(refused.contains("others can write it"), "{refused}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cache_makes_the_second_load_a_deserialize() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("artifacts")?;
    let wasm = std::fs::read(guests::ECHO)?;

    let first = sandbox_in(&redis, Limits::default(), Some(dir.path.clone())).await?;
    let report = first.load("echo", &wasm)?;
    assert!(!report.from_cache);
    assert!(report.compile_time.is_some());
    let path = first.artifact_path(&wasm).context("no artifact path")?;
    assert!(path.is_file(), "{}", path.display());
    drop(first);

    let second = sandbox_in(&redis, Limits::default(), Some(dir.path.clone())).await?;
    let report = second.load("echo", &wasm)?;
    assert!(report.from_cache);
    assert_eq!(report.compile_time, None);
    assert_eq!(
        run(&second, "echo", json!([1])).await.outcome,
        Outcome::Success("[1]".into())
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cache_rejects_an_artifact_of_another_engine_config() -> Result<()> {
    let redis = RedisServer::start()?;
    let ours = TempDir::new("artifacts-ours")?;
    let theirs = TempDir::new("artifacts-theirs")?;
    let wasm = std::fs::read(guests::ECHO)?;

    // An engine with fuel metering compiles different code.
    let fueled = Limits {
        fuel: Some(1_000_000),
        ..Limits::default()
    };
    let other = sandbox_in(&redis, fueled, Some(theirs.path.clone())).await?;
    other.load("echo", &wasm)?;
    let foreign = std::fs::read(other.artifact_path(&wasm).context("no path")?)?;

    let sandbox = sandbox_in(&redis, Limits::default(), Some(ours.path.clone())).await?;
    let path = sandbox.artifact_path(&wasm).context("no path")?;
    assert_ne!(Some(path.clone()), other.artifact_path(&wasm));
    std::fs::write(&path, &foreign)?;

    let report = sandbox.load("echo", &wasm)?;
    assert!(!report.from_cache, "a foreign artifact was loaded");
    let rebuilt = std::fs::read(&path)?;
    assert_ne!(rebuilt, foreign, "the foreign artifact was not replaced");
    assert_eq!(
        run(&sandbox, "echo", json!("hi")).await.outcome,
        Outcome::Success("\"hi\"".into())
    );

    // The rebuilt artifact is good: the next engine takes it.
    let next = sandbox_in(&redis, Limits::default(), Some(ours.path.clone())).await?;
    assert!(next.load("echo", &wasm)?.from_cache);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cache_rejects_a_corrupt_artifact() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("artifacts-corrupt")?;
    let wasm = std::fs::read(guests::ECHO)?;
    let sandbox = sandbox_in(&redis, Limits::default(), Some(dir.path.clone())).await?;
    sandbox.load("echo", &wasm)?;
    let path = sandbox.artifact_path(&wasm).context("no path")?;
    let good = std::fs::read(&path)?;

    // One flipped bit in the middle of the code, then a truncated file, then
    // garbage: each is rejected, deleted and rebuilt.
    let mut flipped = good.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x01;
    let truncated = good[..good.len() / 3].to_vec();
    let garbage = b"\x7fELF not really".to_vec();
    for bad in [flipped, truncated, garbage] {
        std::fs::write(&path, &bad)?;
        let report = sandbox.load("echo", &wasm)?;
        assert!(!report.from_cache, "a corrupt artifact was loaded");
        assert_ne!(
            std::fs::read(&path)?,
            bad,
            "the corrupt artifact was not replaced"
        );
        assert_eq!(
            run(&sandbox, "echo", json!(7)).await.outcome,
            Outcome::Success("7".into())
        );
    }
    Ok(())
}
