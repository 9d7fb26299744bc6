//! The example handlers and test guests in every language with an SDK
//! (Rust, Python, and JavaScript where built), run through the same host
//! with the same assertions: each test is one function over
//! [`LANGS`], so "the same results in every language" holds by
//! construction. Non-Rust components are built from source at test time
//! and cached by input hash (`dtq_tests::polyglot`).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use dtq_host::sandbox::{
    AllowList, Call, CallReport, CancelHandle, HandlerSettings, Limits, Outcome, Sandbox,
    SandboxConfig, TaskContext, Trap,
};
use dtq_tests::polyglot::{self, LANGS, Lang, example_wasm, test_guest_wasm};
use dtq_tests::services::Service;
use dtq_tests::{Dtq, RedisServer};
use dtq_tests::{success, trap};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

async fn sandbox(redis: &RedisServer, limits: Limits) -> Result<Sandbox> {
    let config = SandboxConfig {
        limits,
        cache_dir: Some(polyglot::artifact_dir()),
        ..SandboxConfig::default()
    };
    Ok(Sandbox::new(config, redis.manager().await?)?)
}

fn call(task: &str, task_id: &str, attempt: u32, payload: &str) -> Call {
    Call {
        task: task.to_string(),
        ctx: TaskContext {
            task_id: task_id.to_string(),
            queue: "default".to_string(),
            task_name: task.to_string(),
            attempt,
            max_attempts: 10,
            idempotency_key: None,
        },
        payload: payload.to_string(),
        deadline: None,
    }
}

async fn run(sandbox: &Sandbox, task: &str, payload: Value) -> CallReport {
    let id = uuid::Uuid::now_v7().to_string();
    run_as(sandbox, task, &id, 1, payload).await
}

async fn run_as(
    sandbox: &Sandbox,
    task: &str,
    task_id: &str,
    attempt: u32,
    payload: Value,
) -> CallReport {
    let request = call(task, task_id, attempt, &payload.to_string());
    sandbox.call(request, &CancelHandle::new()).await
}

/// A call's outcome in a form every language must agree on: the result as
/// JSON, the error's kind and message, or the trap.
fn observed(report: &CallReport) -> Value {
    match &report.outcome {
        Outcome::Success(text) => match serde_json::from_str::<Value>(text) {
            Ok(value) => json!({"ok": value}),
            Err(_) => json!({"not_json": text}),
        },
        Outcome::Retryable(message) => json!({"retryable": message}),
        Outcome::Fatal(message) => json!({"fatal": message}),
        Outcome::Trapped(trap) => json!({"trap": trap.to_string()}),
    }
}

async fn get(redis: &RedisServer, key: &str) -> Result<Option<String>> {
    let mut conn = redis.conn().await?;
    Ok(redis::cmd("GET").arg(key).query_async(&mut conn).await?)
}

/// Every key but the namespaces' byte counts.
async fn guest_keys(redis: &RedisServer) -> Result<Vec<String>> {
    let mut keys = redis.keys().await?;
    keys.retain(|k| !k.starts_with("dtq:quota"));
    Ok(keys)
}

/// Run `case` for every language and check that each gives what Rust
/// gives: the first language's observations are the reference.
macro_rules! same_in_every_language {
    ($case:ident) => {{
        let mut reference: Option<(Lang, Vec<Value>)> = None;
        for &lang in LANGS {
            let seen = $case(lang)
                .await
                .with_context(|| format!("{} in {lang}", stringify!($case)))?;
            match &reference {
                None => reference = Some((lang, seen)),
                Some((first, expected)) => assert_eq!(
                    &seen,
                    expected,
                    "{} in {lang} differs from {first}",
                    stringify!($case)
                ),
            }
        }
        Ok(())
    }};
}

// ---------------------------------------------------------------- examples

async fn counter(lang: Lang) -> Result<Vec<Value>> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    sandbox.load("counter", &example_wasm(lang, "counter")?)?;

    let first = run(&sandbox, "counter", json!({"name": "visits"})).await;
    assert_eq!(success(&first)?, json!({"name": "visits", "value": 1}));
    assert_eq!(first.host_calls, 1, "{lang}: one kv call");
    let second = run(&sandbox, "counter", json!({"name": "visits", "by": 5})).await;
    let down = run(&sandbox, "counter", json!({"name": "visits", "by": -2})).await;
    assert_eq!(success(&down)?, json!({"name": "visits", "value": 4}));
    let missing = run(&sandbox, "counter", json!({"by": 5})).await;
    match &missing.outcome {
        Outcome::Fatal(m) => assert!(m.starts_with("payload does not match"), "{lang}: {m}"),
        other => bail!("{lang}: a payload without a name is fatal, got {other:?}"),
    }
    assert_eq!(
        get(&redis, "dtq:guest:{counter}:counter:visits")
            .await?
            .as_deref(),
        Some("4")
    );
    assert_eq!(
        guest_keys(&redis).await?,
        vec!["dtq:guest:{counter}:counter:visits"]
    );
    // The result text too: both write compact JSON in field order.
    let Outcome::Success(text) = &second.outcome else {
        bail!("{lang}: {:?}", second.outcome);
    };
    assert_eq!(text, r#"{"name":"visits","value":6}"#, "{lang}");
    Ok(vec![
        observed(&first),
        observed(&second),
        observed(&down),
        json!(matches!(missing.outcome, Outcome::Fatal(_))),
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn counter_gives_the_same_results_in_every_language() -> Result<()> {
    same_in_every_language!(counter)
}

async fn echo(lang: Lang) -> Result<Vec<Value>> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    sandbox.load("echo", &example_wasm(lang, "echo")?)?;
    let mut seen = Vec::new();
    for payload in [
        r#"{"b": [1, 2.50, "x"],   "a": null}"#,
        r#""héllo ✓""#,
        "12345678901234567890",
        "[]",
    ] {
        let report = sandbox
            .call(call("echo", "t", 1, payload), &CancelHandle::new())
            .await;
        assert_eq!(
            report.outcome,
            Outcome::Success(payload.to_string()),
            "{lang}: byte for byte\nlog:\n{}",
            report.log
        );
        assert_eq!(report.host_calls, 0, "{lang}");
        seen.push(observed(&report));
    }
    Ok(seen)
}

#[tokio::test(flavor = "multi_thread")]
async fn echo_returns_the_payload_byte_for_byte_in_every_language() -> Result<()> {
    same_in_every_language!(echo)
}

async fn send_receipt(lang: Lang) -> Result<Vec<Value>> {
    let redis = RedisServer::start()?;
    let (payments, emails) = (Service::start()?, Service::start()?);
    let sandbox = sandbox(&redis, Limits::default()).await?;
    let settings = HandlerSettings {
        allow_hosts: AllowList::parse("http://127.0.0.1:*")?,
        ..HandlerSettings::default()
    };
    sandbox.load_with(
        "send_receipt",
        &example_wasm(lang, "send_receipt")?,
        &settings,
    )?;
    let order = json!({
        "order_id": "A-1",
        "amount_cents": 1999,
        "payment_url": payments.url(),
        "email_url": emails.url(),
    });
    let first = run(&sandbox, "send_receipt", order.clone()).await;
    assert_eq!(
        success(&first)?,
        json!({"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true})
    );
    // A redelivery of the same task, and another task with the same order.
    let again = run_as(&sandbox, "send_receipt", "same-task", 2, order.clone()).await;
    let other = run(&sandbox, "send_receipt", order).await;
    for report in [&again, &other] {
        assert_eq!(
            success(report)?,
            json!({"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true, "deduped": true})
        );
    }
    assert_eq!(payments.charges_for("A-1"), 1, "{:?}", payments.charges());
    let sent = emails.emails();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].body["to"], "customer-of-A-1@example.com");
    assert_eq!(sent[0].body["subject"], "Your receipt for order A-1");
    assert_eq!(sent[0].body["charge_id"], "ch_1");
    assert_eq!(sent[0].body["amount_cents"], 1999);
    let charges = payments.requests_to("/charges");
    assert_eq!(charges.len(), 1, "{charges:?}");
    assert!(charges[0].idempotency_key.is_some(), "{lang}");

    // The claim stores the same result text in every language.
    let mut conn = redis.conn().await?;
    let stored: Option<String> = redis::cmd("HGET")
        .arg("dtq:claim:{send_receipt}:charge:A-1")
        .arg("result")
        .query_async(&mut conn)
        .await?;
    assert_eq!(stored.as_deref(), Some(r#"{"charge_id":"ch_1"}"#), "{lang}");

    // A service the operator did not allow is refused, and since a retry
    // would be refused again, the call fails fatally whatever the guest
    // made of the refusal: an error (Rust, Python), or a trap (the JS
    // engine's `fetch` aborts the call when the host refuses the request
    // outright).
    let denied = json!({
        "order_id": "B-2", "amount_cents": 5,
        "payment_url": "http://evil.example", "email_url": emails.url(),
    });
    let report = run(&sandbox, "send_receipt", denied).await;
    match &report.outcome {
        Outcome::Fatal(m) => assert!(
            m.starts_with("outbound request POST http://evil.example:80 denied"),
            "{lang}: {m}"
        ),
        other => bail!("{lang}: expected a fatal denied request, got {other:?}"),
    }
    assert_eq!(
        payments.requests_to("/charges").len(),
        1,
        "{lang}: nothing sent"
    );
    Ok(vec![
        observed(&first),
        observed(&again),
        observed(&other),
        json!(stored),
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn send_receipt_charges_once_then_dedupes_in_every_language() -> Result<()> {
    same_in_every_language!(send_receipt)
}

// ------------------------------------------------------- retries, queue

/// Through the whole queue: a retryable error retries until the attempts
/// run out, a fatal one fails at once, an uncaught error retries.
async fn outcomes_through_the_queue(lang: Lang) -> Result<Vec<Value>> {
    let dtq = Dtq::start(true, &[]).await?;
    let task = format!("adversarial-{lang}");
    dtq.sandbox
        .load(&task, &test_guest_wasm(lang, "adversarial")?)?;
    let submit = |payload: Value, attempts: u32| {
        let body = json!({"task": task, "payload": payload, "max_attempts": attempts});
        dtq.submit_new("default", body, None)
    };
    let ok = submit(json!({"op": "ok"}), 3).await?;
    let retry = submit(json!({"op": "retry", "message": "gateway busy"}), 3).await?;
    let fatal = submit(json!({"op": "fatal", "message": "bad card"}), 3).await?;
    let terminal = ["SUCCEEDED", "FAILED", "DEAD_LETTERED"];
    let mut seen = Vec::new();
    for (id, status, attempts, error) in [
        (&ok, "SUCCEEDED", 1, None),
        (&retry, "DEAD_LETTERED", 3, Some("gateway busy")),
        (&fatal, "FAILED", 1, Some("bad card")),
    ] {
        let t = dtq.wait_for("default", id, &terminal, WAIT).await?;
        assert_eq!(
            (t["status"].as_str(), t["attempts"].as_u64()),
            (Some(status), Some(attempts)),
            "{lang}: {t}"
        );
        match error {
            None => assert!(t["error"].is_null(), "{lang}: {t}"),
            Some(e) => assert!(
                t["error"].as_str().is_some_and(|m| m.contains(e)),
                "{lang}: {t}"
            ),
        }
        seen.push(json!([t["status"], t["attempts"], t["result"], t["error"]]));
    }
    Ok(seen)
}

#[tokio::test(flavor = "multi_thread")]
async fn retries_and_failures_through_the_queue_in_every_language() -> Result<()> {
    same_in_every_language!(outcomes_through_the_queue)
}

async fn errors_and_state(lang: Lang) -> Result<Vec<Value>> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    sandbox.load("adversarial", &test_guest_wasm(lang, "adversarial")?)?;
    let mut seen = Vec::new();
    for op in ["fatal", "retry"] {
        let report = run(&sandbox, "adversarial", json!({"op": op, "message": "m"})).await;
        let expected = if op == "fatal" {
            Outcome::Fatal("m".into())
        } else {
            Outcome::Retryable("m".into())
        };
        assert_eq!(report.outcome, expected, "{lang}");
        seen.push(observed(&report));
    }
    // No state survives between calls: a module-level counter starts over.
    for _ in 0..3 {
        let report = run(&sandbox, "adversarial", json!({"op": "static_counter"})).await;
        assert_eq!(success(&report)?, json!({"count": 1}), "{lang}");
    }
    // An error the handler did not mean (a Rust panic, an uncaught Python
    // exception) is retried, with its message kept.
    let report = run(
        &sandbox,
        "adversarial",
        json!({"op": "panic", "message": "boom-42"}),
    )
    .await;
    assert!(
        report.outcome.is_retryable(),
        "{lang}: {:?}",
        report.outcome
    );
    let message = match &report.outcome {
        Outcome::Retryable(m) | Outcome::Trapped(Trap::GuestPanic(m)) => m,
        other => bail!("{lang}: {other:?}"),
    };
    assert!(message.contains("boom-42"), "{lang}: {message}");
    Ok(seen)
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_map_to_outcomes_and_no_state_survives_in_every_language() -> Result<()> {
    same_in_every_language!(errors_and_state)
}

// ---------------------------------------------------- idempotent operations

/// A charge-like operation: increment `charges`, set `email`, spin.
fn charge(key: &str, spin_ms: u64) -> Value {
    json!({"op": "run", "key": key, "incr": ["charges"], "set": [["email", "sent"]],
        "spin_ms": spin_ms})
}

/// Wait until the claim of operation `key` is in `state`.
async fn wait_claim(redis: &RedisServer, key: &str, state: &str) -> Result<()> {
    let claim = format!("dtq:claim:{{operations}}:{key}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut conn = redis.conn().await?;
    loop {
        let now: Option<String> = redis::cmd("HGET")
            .arg(&claim)
            .arg("state")
            .query_async(&mut conn)
            .await?;
        if now.as_deref() == Some(state) {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("claim {key} never became {state}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An attempt interrupted mid-operation (as a killed worker or a deadline
/// would) applies nothing; the task's redelivery takes the claim over and
/// applies the effect once; every later call finds it done.
async fn operation_under_redelivery(lang: Lang) -> Result<Vec<Value>> {
    let redis = RedisServer::start()?;
    let limits = Limits {
        claim_lease: Duration::from_secs(1),
        ..Limits::default()
    };
    let sandbox = sandbox(&redis, limits).await?;
    sandbox.load("operations", &test_guest_wasm(lang, "operations")?)?;
    let kv = |key: &str| format!("dtq:guest:{{operations}}:{key}");

    let cancel = CancelHandle::new();
    let interrupted = {
        let sandbox = sandbox.clone();
        let cancel = cancel.clone();
        let request = call("operations", "t1", 1, &charge("C", 60_000).to_string());
        tokio::spawn(async move { sandbox.call(request, &cancel).await })
    };
    wait_claim(&redis, "C", "running").await?;
    cancel.cancel();
    let report = interrupted.await?;
    assert_eq!(trap(&report)?, Trap::Cancelled, "{lang}");
    assert_eq!(get(&redis, &kv("charges")).await?, None, "{lang}");
    assert_eq!(get(&redis, &kv("email")).await?, None, "{lang}");

    // Another task meanwhile: in progress, a retryable error, never
    // "(false, None)".
    let early = run_as(
        &sandbox,
        "operations",
        "t2",
        1,
        json!({"op": "seed", "key": "C", "incr": "charges"}),
    )
    .await;
    match &early.outcome {
        Outcome::Retryable(m) => assert!(m.contains("in progress"), "{lang}: {m}"),
        other => bail!("{lang}: expected in progress, got {other:?}"),
    }

    // The redelivery takes it over at once and applies it once.
    let taken_over = run_as(&sandbox, "operations", "t1", 2, charge("C", 0)).await;
    assert_eq!(
        success(&taken_over)?,
        json!({"outcome": "executed", "value": [1]})
    );
    assert!(
        taken_over.log.contains("taken over"),
        "{lang}: {}",
        taken_over.log
    );
    let done = run_as(&sandbox, "operations", "t9", 1, charge("C", 0)).await;
    assert_eq!(success(&done)?, json!({"outcome": "done", "value": [1]}));
    let seed = run_as(
        &sandbox,
        "operations",
        "t3",
        1,
        json!({"op": "seed", "key": "C", "incr": "charges"}),
    )
    .await;
    assert_eq!(success(&seed)?, json!({"executed": false}));
    assert_eq!(get(&redis, &kv("charges")).await?.as_deref(), Some("1"));
    assert_eq!(get(&redis, &kv("email")).await?.as_deref(), Some("sent"));

    // A failing effect applies nothing and releases the claim for a retry.
    let failing = json!({"op": "run", "key": "E", "incr": ["charges"], "then": "fail"});
    let failed = run_as(&sandbox, "operations", "t4", 1, failing).await;
    assert_eq!(
        failed.outcome,
        Outcome::Retryable("the effect failed".into()),
        "{lang}"
    );
    let retried = run_as(&sandbox, "operations", "t4", 2, charge("E", 0)).await;
    assert_eq!(
        success(&retried)?,
        json!({"outcome": "executed", "value": [2]})
    );
    Ok(vec![
        observed(&early),
        observed(&taken_over),
        observed(&done),
        observed(&seed),
        observed(&failed),
        observed(&retried),
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotent_operation_under_redelivery_in_every_language() -> Result<()> {
    same_in_every_language!(operation_under_redelivery)
}

// ------------------------------------------------------------------ limits

/// A busy loop is stopped by the deadline, and the handler still runs.
async fn busy_loop(lang: Lang) -> Result<Vec<Value>> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    sandbox.load("adversarial", &test_guest_wasm(lang, "adversarial")?)?;
    let mut endless = call("adversarial", "t", 1, r#"{"op": "loop"}"#);
    endless.deadline = Some(Duration::from_millis(500));
    let report = sandbox.call(endless, &CancelHandle::new()).await;
    assert_eq!(trap(&report)?, Trap::DeadlineExceeded, "{lang}");
    assert!(report.outcome.is_retryable());
    let ok = run(&sandbox, "adversarial", json!({"op": "ok"})).await;
    assert_eq!(success(&ok)?, json!({"ok": true}));
    Ok(vec![observed(&report), observed(&ok)])
}

#[tokio::test(flavor = "multi_thread")]
async fn a_busy_loop_is_stopped_by_the_deadline_in_every_language() -> Result<()> {
    same_in_every_language!(busy_loop)
}

/// An allocation within the memory cap succeeds; an allocation bomb is
/// stopped by it, and the handler still runs.
async fn allocation_bomb(lang: Lang) -> Result<Vec<Value>> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    sandbox.load("adversarial", &test_guest_wasm(lang, "adversarial")?)?;
    let small = run(&sandbox, "adversarial", json!({"op": "alloc", "mb": 16})).await;
    assert_eq!(success(&small)?, json!({"allocated_mb": 16}), "{lang}");
    let mut bomb = call("adversarial", "t", 1, r#"{"op": "alloc", "mb": 1024}"#);
    bomb.deadline = Some(Duration::from_secs(20));
    let report = sandbox.call(bomb, &CancelHandle::new()).await;
    assert_eq!(trap(&report)?, Trap::OutOfMemory, "{lang}");
    let ok = run(&sandbox, "adversarial", json!({"op": "ok"})).await;
    assert_eq!(success(&ok)?, json!({"ok": true}));
    Ok(vec![observed(&small), observed(&report), observed(&ok)])
}

#[tokio::test(flavor = "multi_thread")]
async fn an_allocation_bomb_is_stopped_by_the_memory_cap_in_every_language() -> Result<()> {
    same_in_every_language!(allocation_bomb)
}

// --------------------------------------------------------------- namespace

/// A handler that asks for a namespace runs in it where the operator
/// granted it, and is refused where not.
async fn namespace(lang: Lang) -> Result<Vec<Value>> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, Limits::default()).await?;
    let wasm = test_guest_wasm(lang, "namespaced")?;
    let refused = sandbox
        .load("billing-v2", &wasm)
        .expect_err("loaded without the grant");
    assert!(
        refused.to_string().contains("shared-ns"),
        "{lang}: {refused}"
    );
    let granted = HandlerSettings {
        namespace: Some("shared-ns".into()),
        ..HandlerSettings::default()
    };
    let report = sandbox.load_with("billing-v2", &wasm, &granted)?;
    assert_eq!(report.namespace, "shared-ns");
    let result = run(&sandbox, "billing-v2", json!({"key": "k", "value": "v"})).await;
    assert_eq!(success(&result)?, json!({"ok": true}));
    assert_eq!(guest_keys(&redis).await?, vec!["dtq:guest:{shared-ns}:k"]);
    Ok(vec![observed(&result)])
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handler_asks_for_a_namespace_in_every_language() -> Result<()> {
    same_in_every_language!(namespace)
}

// ---------------------------------------------------------------- progress

/// Through the whole queue: the `progress` test guest reports, with a NaN
/// and an out-of-range fraction and a message past the cap among its
/// reports, and the task keeps its last report, made safe, after it ended.
async fn progress_through_the_queue(lang: Lang) -> Result<Vec<Value>> {
    let dtq = Dtq::start(true, &[]).await?;
    let task = format!("progress-{lang}");
    dtq.sandbox
        .load(&task, &test_guest_wasm(lang, "progress")?)?;
    let reports = json!([[0.25, "a quarter"], ["nan", "not a number"], [7, "é", 600]]);
    let body = json!({"task": task, "payload": {"reports": reports}});
    let id = dtq.submit_new("default", body, None).await?;
    let t = dtq
        .wait_for(
            "default",
            &id,
            &["SUCCEEDED", "FAILED", "DEAD_LETTERED"],
            WAIT,
        )
        .await?;
    assert_eq!(t["status"], "SUCCEEDED", "{lang}: {t}");
    let progress = &t["progress"];
    assert_eq!(progress["fraction"].as_f64(), Some(1.0), "{lang}: {t}");
    assert_eq!(
        progress["message"].as_str().map(str::len),
        Some(dtq_host::sandbox::MAX_PROGRESS_MESSAGE_BYTES),
        "{lang}: {t}"
    );
    Ok(vec![
        t["result"].clone(),
        progress["fraction"].clone(),
        progress["message"].clone(),
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn progress_reports_reach_the_task_in_every_language() -> Result<()> {
    same_in_every_language!(progress_through_the_queue)
}

/// `scripts/build-python-handler` and `scripts/build-js-handler`, run from
/// a directory outside the checkout, take the handler directory and a
/// relative `--out-dir` from where they were run, and by default write
/// `target/<lang>/<name>.wasm` there, never into the checkout. (The two
/// scripts are one wrapper in two spellings: one builds with the default,
/// the other with a relative `--out-dir`, to keep the test short.)
#[test]
fn the_build_scripts_write_where_they_are_run() -> Result<()> {
    let root = dtq_tests::polyglot::repo_root();
    for (script, lang, out_dir) in [
        ("build-python-handler", "python", None),
        ("build-js-handler", "js", Some("out")),
    ] {
        let cwd = dtq_tests::TempDir::new(&format!("build-{lang}"))?;
        copy_dir(
            &root.join("examples").join(lang).join("echo"),
            &cwd.path.join("echo"),
        )?;
        let checkout_out = root.join("target").join(lang).join("echo.wasm");
        let before = std::fs::metadata(&checkout_out)
            .and_then(|m| m.modified())
            .ok();
        let mut cmd = std::process::Command::new(root.join("scripts").join(script));
        cmd.current_dir(&cwd.path);
        if let Some(dir) = out_dir {
            cmd.args(["--out-dir", dir]);
        }
        let status = cmd.arg("echo").status().context(script)?;
        assert!(status.success(), "{script}: {status}");
        let wrote = match out_dir {
            Some(dir) => cwd.path.join(dir).join("echo.wasm"),
            None => cwd.path.join("target").join(lang).join("echo.wasm"),
        };
        let bytes =
            std::fs::read(&wrote).with_context(|| format!("{script}: {}", wrote.display()))?;
        assert!(bytes.starts_with(b"\0asm"), "{script}: not wasm");
        let after = std::fs::metadata(&checkout_out)
            .and_then(|m| m.modified())
            .ok();
        assert_eq!(before, after, "{script} wrote into the checkout");
    }
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &to.join(entry.file_name()))?;
        } else {
            std::fs::copy(entry.path(), to.join(entry.file_name()))?;
        }
    }
    Ok(())
}

// ------------------------------------------------------------------ flows

/// Flows through the queue: a parent fans out to children (the Rust
/// `flows` guest, on queue `kids`), waits, and resumes with their results;
/// a failing attempt submits nothing; a submission not granted is refused
/// before the handler returns.
async fn flows_through_the_queue(lang: Lang) -> Result<Vec<Value>> {
    let task = format!("flows-{lang}");
    let grant = format!("{task}=kids:flows");
    let dtq = Dtq::start(true, &["--queues", "default,kids", "--submit-to", &grant]).await?;
    dtq.sandbox.load(&task, &test_guest_wasm(lang, "flows")?)?;
    let submit = |payload: Value| {
        let body = json!({"task": task, "payload": payload, "max_attempts": 2});
        dtq.submit_new("default", body, None)
    };
    let terminal = ["SUCCEEDED", "FAILED", "DEAD_LETTERED"];
    let parent = submit(json!({"fan_out": 4, "queue": "kids", "task": "flows"})).await?;
    let failing = submit(json!({"submit_then_fail": {"queue": "kids", "task": "flows"}})).await?;
    let denied = submit(json!({"denied": {"queue": "kids", "task": "echo"}})).await?;
    let parent = dtq.wait_for("default", &parent, &terminal, WAIT).await?;
    assert_eq!(parent["status"], "SUCCEEDED", "{lang}: {parent:#}");
    assert_eq!(
        parent["attempts"], 1,
        "{lang}: the resumed run is the same attempt"
    );
    let result = &parent["result"];
    assert_eq!(
        (&result["sum"], &result["children"], &result["failed"]),
        (&json!(6), &json!(4), &json!(0)),
        "{lang}: {result}"
    );
    let failing = dtq.wait_for("default", &failing, &terminal, WAIT).await?;
    assert_eq!(failing["status"], "DEAD_LETTERED", "{lang}: {failing:#}");
    let denied = dtq.wait_for("default", &denied, &terminal, WAIT).await?;
    let refused = denied["result"]["refused"].as_str().unwrap_or_default();
    assert!(refused.contains("not granted"), "{lang}: {denied:#}");
    // The parent's four children, and nothing of the failed attempts.
    let kids: Vec<String> = dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.starts_with("dtq:task:{kids}:"))
        .collect();
    assert_eq!(kids.len(), 4, "{lang}: {kids:?}");
    Ok(vec![json!([
        result["sum"],
        result["children"],
        result["failed"]
    ])])
}

#[tokio::test(flavor = "multi_thread")]
async fn flows_fan_out_and_submit_once_in_every_language() -> Result<()> {
    same_in_every_language!(flows_through_the_queue)
}

/// The fan-out example of each language (`examples/*/fan_out`) against
/// the Rust `square` example: the sum of the squares of its numbers.
async fn fan_out_example(lang: Lang) -> Result<Vec<Value>> {
    let task = format!("fan_out-{lang}");
    let grant = format!("{task}=default:square");
    let dtq = Dtq::start(true, &["--submit-to", &grant]).await?;
    dtq.sandbox.load(&task, &example_wasm(lang, "fan_out")?)?;
    let body = json!({"task": task, "payload": {"numbers": [1, 2, 3, 4]}});
    let id = dtq.submit_new("default", body, None).await?;
    let t = dtq
        .wait_for(
            "default",
            &id,
            &["SUCCEEDED", "FAILED", "DEAD_LETTERED"],
            WAIT,
        )
        .await?;
    assert_eq!(t["status"], "SUCCEEDED", "{lang}: {t:#}");
    assert_eq!(t["result"], json!({"sum_of_squares": 30}), "{lang}: {t:#}");
    Ok(vec![t["result"].clone()])
}

#[tokio::test(flavor = "multi_thread")]
async fn the_fan_out_example_sums_its_childrens_squares_in_every_language() -> Result<()> {
    same_in_every_language!(fan_out_example)
}
