//! Handlers' outbound HTTP through a whole dtq (API, worker, Redis), against
//! real HTTP services on loopback ([`dtq_tests::services`]): the operator's
//! allow-list, each limit obeyed and violated, cancellation of a request in
//! flight, the `Idempotency-Key` the host sends inside an operation, the
//! task log, and `send_receipt` charging once per order.
//!
//! The `http_client` test guest returns a failed request's message as
//! `{"error": …}` in a successful result, so a test reads it from the task.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use dtq_host::sandbox::{
    AllowList, Call, CancelHandle, HandlerSettings, Sandbox, SandboxConfig, TaskContext,
};
use dtq_tests::services::{Recorded, Service};
use dtq_tests::{Dtq, guests};
use reqwest::Method;
use serde_json::{Value, json};

/// How long anything that should happen may take.
const WAIT: Duration = Duration::from_secs(20);

/// Lets `http_client` reach every loopback port.
const ALLOW_LOOPBACK: [&str; 2] = ["--allow-host", "http_client=http://127.0.0.1:*"];

/// A dtq with a worker, `http_client` allowed to reach loopback, and
/// `flags` besides.
async fn dtq(flags: &[&str]) -> Result<Dtq> {
    let mut all = ALLOW_LOOPBACK.to_vec();
    all.extend_from_slice(flags);
    Dtq::start(true, &all).await
}

/// Submit an `http_client` task with `payload` and `max_attempts`; its id.
async fn submit(dtq: &Dtq, payload: Value, max_attempts: u32) -> Result<String> {
    let body = json!({"task": "http_client", "payload": payload, "max_attempts": max_attempts});
    dtq.submit_new("default", body, None).await
}

/// Run an `http_client` task to SUCCEEDED; the finished task.
async fn run(dtq: &Dtq, payload: Value) -> Result<Value> {
    let id = submit(dtq, payload, 1).await?;
    let task = dtq
        .wait_for(
            "default",
            &id,
            &["SUCCEEDED", "FAILED", "DEAD_LETTERED"],
            WAIT,
        )
        .await?;
    anyhow::ensure!(task["status"] == "SUCCEEDED", "{task:#}");
    Ok(task)
}

/// The error message an `http_client` task returned; fails the test when
/// its request succeeded.
fn error_of(task: &Value) -> Result<String> {
    task["result"]["error"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("expected a failed request: {task:#}"))
}

/// The host and port of `service`, as the host's errors and log name it.
fn origin(service: &Service) -> &str {
    service.url()
}

/// The idempotency keys `requests` carried.
fn keys(requests: &[Recorded]) -> Vec<Option<String>> {
    requests.iter().map(|r| r.idempotency_key.clone()).collect()
}

// ---------------------------------------------------------------- allow-list

#[tokio::test(flavor = "multi_thread")]
async fn an_allowed_request_succeeds_and_carries_no_key_outside_an_operation() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&[]).await?;

    let url = format!("{}/ok", service.url());
    let got = run(&dtq, json!({"op": "get", "url": url})).await?;
    assert_eq!(got["result"], json!({"status": 200, "body": "ok"}));
    let posted = run(&dtq, json!({"op": "post", "url": url, "json": {"n": 1}})).await?;
    assert_eq!(posted["result"], json!({"status": 200, "body": "ok"}));

    let seen = service.requests();
    let seen: Vec<(&str, &str, &str, Option<&str>)> = seen
        .iter()
        .map(|r| {
            let key = r.idempotency_key.as_deref();
            (r.method.as_str(), r.path.as_str(), r.body.as_str(), key)
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("GET", "/ok", "", None),
            ("POST", "/ok", r#"{"n":1}"#, None)
        ]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_host_outside_the_allow_list_is_denied_and_sees_nothing() -> Result<()> {
    let service = Service::start()?;
    let allowed = Service::start()?;
    // Loopback is allowed on `allowed`'s port only.
    let pattern = format!("http_client={}", allowed.url());
    let dtq = Dtq::start(true, &["--allow-host", &pattern]).await?;

    let url = format!("{}/ok", service.url());
    let denied = run(&dtq, json!({"op": "post", "url": url, "json": {}})).await?;
    let message = error_of(&denied)?;
    assert!(
        message.starts_with(&format!(
            "request to {} denied: the host is not in this handler's allow-list",
            origin(&service)
        )),
        "{message}"
    );
    assert!(message.contains("allow_hosts"), "{message}");

    let named = run(
        &dtq,
        json!({"op": "get", "url": "http://evil.example/steal"}),
    )
    .await?;
    let message = error_of(&named)?;
    assert!(
        message.starts_with("request to http://evil.example:80 denied"),
        "{message}"
    );
    assert!(message.contains("allow_hosts"), "{message}");

    // The same guest reaches the allowed port: the denial was the
    // allow-list's, not a broken client.
    let ok = run(
        &dtq,
        json!({"op": "get", "url": format!("{}/ok", allowed.url())}),
    )
    .await?;
    assert_eq!(ok["result"]["status"], 200, "{ok:#}");
    // Denied requests are refused before they are sent; the tasks above
    // finished, so anything sent would have arrived.
    assert_eq!(service.requests(), []);
    assert_eq!(allowed.requests().len(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handler_without_an_allow_list_reaches_nothing() -> Result<()> {
    let service = Service::start()?;
    let dtq = Dtq::start(true, &[]).await?;
    let url = format!("{}/ok", service.url());
    let denied = run(&dtq, json!({"op": "get", "url": url})).await?;
    let message = error_of(&denied)?;
    assert!(message.contains("denied"), "{message}");
    assert_eq!(service.requests(), []);
    Ok(())
}

// ---------------------------------------------------------------- limits

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_server_hits_the_request_timeout() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&["--http-timeout-ms", "300"]).await?;

    let quick = format!("{}/slow?ms=20", service.url());
    let answered = run(&dtq, json!({"op": "get", "url": quick})).await?;
    assert_eq!(answered["result"], json!({"status": 200, "body": "slow"}));

    let slow = format!("{}/slow?ms=10000", service.url());
    let start = Instant::now();
    let timed_out = run(&dtq, json!({"op": "get", "url": slow})).await?;
    let message = error_of(&timed_out)?;
    assert!(
        message.starts_with(&format!("request to {} timed out", origin(&service))),
        "{message}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the timeout took {:?}",
        start.elapsed()
    );
    // The server did get the request: the time ran out on the response.
    assert_eq!(service.requests_to("/slow?ms=10000").len(), 1);
    Ok(())
}

/// Against a cap of 1000 bytes: a body of 1000 bytes is read whole, one
/// of 5000 fails with an error naming the origin, the cap and its flag.
/// `chunked`: the body comes without a `Content-Length`, so the host finds
/// it too large while the guest reads it, not when the response arrives.
async fn response_size_cap(chunked: bool) -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&["--http-max-response-bytes", "1000"]).await?;
    let big = |bytes: u32| {
        let chunked = if chunked { "&chunked=1" } else { "" };
        json!({"op": "get", "url": format!("{}/big?bytes={bytes}{chunked}", service.url())})
    };

    let at_cap = run(&dtq, big(1000)).await?;
    let body = at_cap["result"]["body"].as_str().unwrap_or_default();
    assert_eq!(body.len(), 1000, "{at_cap:#}");

    let over = run(&dtq, big(5000)).await?;
    let message = error_of(&over)?;
    assert!(
        message.starts_with(&format!("response from {} cut off", origin(&service))),
        "{message}"
    );
    assert!(message.contains("limit of 1000 bytes"), "{message}");
    assert!(message.contains("--http-max-response-bytes"), "{message}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_response_announced_over_the_size_cap_is_refused_with_a_clear_error() -> Result<()> {
    response_size_cap(false).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_response_streaming_past_the_size_cap_is_cut_with_a_clear_error() -> Result<()> {
    response_size_cap(true).await
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_per_attempt_are_capped() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&["--http-max-requests", "3"]).await?;
    let url = format!("{}/ok", service.url());

    let within = run(&dtq, json!({"op": "many", "url": url, "n": 3})).await?;
    assert_eq!(within["result"], json!({"ok": 3}));
    let over = run(&dtq, json!({"op": "many", "url": url, "n": 5})).await?;
    assert_eq!(over["result"]["ok"], 3, "{over:#}");
    let message = error_of(&over)?;
    assert!(message.contains("--http-max-requests"), "{message}");
    // The cap is per attempt, and the fourth request of the second task
    // was never sent.
    assert_eq!(service.requests_to("/ok").len(), 6);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_stops_a_request_in_flight() -> Result<()> {
    let service = Service::start()?;
    // Neither the request timeout nor the task's deadline ends it first.
    let dtq = dtq(&["--http-timeout-ms", "60000", "--task-timeout-ms", "60000"]).await?;
    let url = format!("{}/slow?ms=30000", service.url());
    let id = submit(&dtq, json!({"op": "get", "url": url}), 3).await?;

    service.wait_for_request("/slow", WAIT).await?;
    let asked = Instant::now();
    let (status, resp) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/default/tasks/{id}/cancel"),
            None,
            &[],
        )
        .await?;
    assert_eq!(status, 202, "{resp}");
    let task = dtq
        .wait_for(
            "default",
            &id,
            &["CANCELLED", "SUCCEEDED", "FAILED", "DEAD_LETTERED"],
            WAIT,
        )
        .await?;
    assert_eq!(task["status"], "CANCELLED", "{task:#}");
    assert_eq!(task["attempts"], 1, "{task:#}");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "cancel took {:?} against a 30 s response",
        asked.elapsed()
    );
    Ok(())
}

// ---------------------------------------------------------------- idempotency keys

#[tokio::test(flavor = "multi_thread")]
async fn one_operation_sends_the_same_key_on_every_retry() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&[]).await?;
    let url = format!("{}/ok", service.url());

    // Attempt 1 posts inside the operation, then fails it; attempt 2 runs
    // the operation, and posts, again.
    let id = submit(
        &dtq,
        json!({"op": "fail_after_post", "url": url, "key": "charge:o-1"}),
        3,
    )
    .await?;
    let task = dtq
        .wait_for("default", &id, &["SUCCEEDED", "DEAD_LETTERED"], WAIT)
        .await?;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["result"], json!({"status": 200, "attempt": 2}));

    let posts = service.requests_to("/ok");
    let bodies: Vec<&str> = posts.iter().map(|r| r.body.as_str()).collect();
    assert_eq!(bodies, [r#"{"attempt":1}"#, r#"{"attempt":2}"#]);
    let key = posts[0]
        .idempotency_key
        .clone()
        .context("no Idempotency-Key")?;
    assert!(!key.is_empty());
    assert_eq!(keys(&posts), [Some(key.clone()), Some(key)]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_operation_sends_the_same_key_when_its_task_is_redelivered() -> Result<()> {
    let service = Service::start()?;
    // A worker that stops abandons what still runs after 100 ms: the
    // message stays pending and is reclaimed, as after a crash.
    let mut dtq = dtq(&["--shutdown-grace-ms", "100"]).await?;
    let url = format!("{}/slow?ms=1500", service.url());
    let payload = json!({"op": "post", "url": url, "json": {}, "in_operation": "charge:r-1"});
    let body = json!({"task": "http_client", "payload": payload, "max_attempts": 3});
    let id = dtq.submit_new("default", body, Some("order-r-1")).await?;

    // The first attempt's request is in flight when its worker goes away.
    service.wait_for_request("/slow", WAIT).await?;
    dtq.stop_worker().await?;
    dtq.start_worker();
    let task = dtq
        .wait_for("default", &id, &["SUCCEEDED", "DEAD_LETTERED"], WAIT)
        .await?;
    assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
    assert_eq!(task["attempts"], 2, "{task:#}");
    assert_eq!(task["result"]["outcome"], "executed", "{task:#}");

    let sent = service.requests_to("/slow");
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent[0].idempotency_key.is_some(), "{sent:?}");
    assert_eq!(sent[0].idempotency_key, sent[1].idempotency_key);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_differ_between_operations_and_follow_the_operation_across_tasks() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&[]).await?;
    let url = format!("{}/ok", service.url());

    let both = json!({"op": "operations", "url": url, "keys": ["a", "b"]});
    let first = run(&dtq, both).await?;
    assert_eq!(first["result"], json!({"statuses": [200, 200]}));

    // One operation key in two tasks: the first task posts inside `c` and
    // fails it on its only attempt, which releases the claim; the second
    // then runs `c` itself, and sends the same key: the key names the
    // operation, whichever task runs it, so a downstream service applies
    // its effect once even when a task dies mid-request and another takes
    // the operation over.
    let failing = json!({"op": "fail_after_post", "url": url, "key": "c"});
    let id = submit(&dtq, failing, 1).await?;
    let failed = dtq
        .wait_for("default", &id, &["DEAD_LETTERED", "SUCCEEDED"], WAIT)
        .await?;
    assert_eq!(failed["status"], "DEAD_LETTERED", "{failed:#}");
    let again = json!({"op": "post", "url": url, "json": {}, "in_operation": "c"});
    let second = run(&dtq, again).await?;
    assert_eq!(second["result"]["outcome"], "executed", "{second:#}");

    let sent: Vec<String> = keys(&service.requests_to("/ok"))
        .into_iter()
        .collect::<Option<_>>()
        .context("a request inside an operation carried no key")?;
    let [a, b, c_first_task, c_second_task] = sent.as_slice() else {
        panic!("expected four requests, got {sent:?}");
    };
    assert_ne!(a, b, "two operations of one task");
    assert_eq!(
        c_first_task, c_second_task,
        "one operation key in two tasks"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_the_guest_sets_is_sent_as_is() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&[]).await?;
    let url = format!("{}/ok", service.url());
    let own = run(
        &dtq,
        json!({"op": "own_key", "url": url, "key": "refund-A-1"}),
    )
    .await?;
    assert_eq!(own["result"], json!({"status": 200, "body": "ok"}));
    assert_eq!(
        keys(&service.requests_to("/ok")),
        [Some("refund-A-1".to_string())]
    );
    Ok(())
}

/// A sandbox on `redis` with `http_client` loaded as `attacker` and as
/// `victim`: two handlers in two namespaces, both allowed loopback.
fn two_tenants(redis: dtq_host::store::Conn) -> Result<Sandbox> {
    let config = SandboxConfig {
        cache_dir: Some(std::env::temp_dir().join("dtq-test-artifact-cache")),
        ..SandboxConfig::default()
    };
    let sandbox = Sandbox::new(config, redis)?;
    let settings = HandlerSettings {
        allow_hosts: AllowList::parse("http://127.0.0.1:*")?,
        ..HandlerSettings::default()
    };
    let wasm = std::fs::read(guests::HTTP_CLIENT)?;
    for task in ["attacker", "victim"] {
        sandbox.load_with(task, &wasm, &settings)?;
    }
    Ok(sandbox)
}

/// Run `task` of `sandbox` with `payload` to its result.
async fn call(sandbox: &Sandbox, task: &str, payload: Value) -> Result<Value> {
    let call = Call {
        task: task.into(),
        ctx: TaskContext {
            task_id: uuid::Uuid::now_v7().to_string(),
            queue: "default".into(),
            task_name: task.into(),
            attempt: 1,
            max_attempts: 1,
            idempotency_key: None,
        },
        payload: payload.to_string(),
        deadline: None,
    };
    dtq_tests::success(&sandbox.call(call, &CancelHandle::new()).await)
}

/// The key as a plain digest of namespace and operation key, as the host
/// once made it: what any handler can compute for any other.
fn unkeyed(namespace: &str, operation: &str) -> String {
    use sha2::{Digest as _, Sha256};
    let mut hash = Sha256::new();
    for part in [namespace, operation] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    format!("dtq-{}", hex::encode(&hash.finalize()[..16]))
}

/// Two handlers, one payment service: the attacker sends first, with what
/// it can compute or guess of the victim's key, and the victim's own charge
/// is still made. The host's key is keyed by the fleet secret, and a key of
/// the guest's own that looks like the host's is refused unsent.
#[tokio::test(flavor = "multi_thread")]
async fn no_handler_can_send_another_namespaces_idempotency_key_first() -> Result<()> {
    let service = Service::start()?;
    let redis = dtq_tests::RedisServer::start()?;
    let sandbox = two_tenants(redis.manager().await?)?;
    let url = format!("{}/charges", service.url());

    let computed = unkeyed("victim", "charge:o-1");
    for key in [
        computed.clone(),
        computed.to_uppercase(),
        "dtq-guess".into(),
    ] {
        let charge = json!({"order_id": "o-1", "amount_cents": 1});
        let attack = json!({"op": "own_key", "url": url, "key": key, "json": charge});
        let refused = call(&sandbox, "attacker", attack).await?;
        assert!(refused["error"].is_string(), "{refused}");
    }
    assert!(service.requests_to("/charges").is_empty());

    let charge = json!({"op": "post", "url": url, "in_operation": "charge:o-1",
        "json": {"order_id": "o-1", "amount_cents": 1999}});
    let charged = call(&sandbox, "victim", charge).await?;
    assert_eq!(charged["outcome"], "executed", "{charged}");
    let charges = service.charges();
    assert_eq!(charges.len(), 1, "{charges:?}");
    assert_eq!(
        (charges[0].order_id.as_str(), charges[0].amount_cents),
        ("o-1", 1999)
    );
    let key = charges[0].idempotency_key.clone().context("no key")?;
    assert_ne!(key, computed);

    // Another worker of the fleet (another sandbox on the same Redis)
    // derives the same key, so the service still applies the charge once.
    let mut conn = redis.conn().await?;
    let _: () = redis::cmd("DEL")
        .arg("dtq:claim:{victim}:charge:o-1")
        .query_async(&mut conn)
        .await?;
    let other = two_tenants(redis.manager().await?)?;
    let charge = json!({"op": "post", "url": url, "in_operation": "charge:o-1",
        "json": {"order_id": "o-1", "amount_cents": 1999}});
    call(&other, "victim", charge).await?;
    let sent = keys(&service.requests_to("/charges"));
    assert_eq!(sent, [Some(key.clone()), Some(key)]);
    assert_eq!(service.charges().len(), 1);
    Ok(())
}

// ---------------------------------------------------------------- task log

#[tokio::test(flavor = "multi_thread")]
async fn the_task_log_has_a_line_per_request_and_no_body() -> Result<()> {
    let service = Service::start()?;
    let dtq = dtq(&[]).await?;
    let url = format!("{}/ok", service.url());
    let marker = "body-marker-7f3a";

    let posted = run(
        &dtq,
        json!({"op": "post", "url": url, "json": {"secret": marker}}),
    )
    .await?;
    let log = posted["log"].as_str().context("no log")?;
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(origin(&service)))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    let line = lines[0];
    for part in ["POST", origin(&service), "200"] {
        assert!(line.contains(part), "{part:?} not in {line:?}");
    }
    assert!(
        !log.contains(marker),
        "the request body is in the log: {log}"
    );

    let missing = format!("{}/no-such-route", service.url());
    let not_found = run(&dtq, json!({"op": "get", "url": missing})).await?;
    let log = not_found["log"].as_str().context("no log")?;
    assert!(
        log.lines()
            .any(|l| l.contains("GET") && l.contains(origin(&service)) && l.contains("404")),
        "{log}"
    );
    Ok(())
}

// ---------------------------------------------------------------- send_receipt

#[tokio::test(flavor = "multi_thread")]
async fn send_receipt_charges_once_per_order_across_tasks() -> Result<()> {
    let payments = Service::start()?;
    let emails = Service::start()?;
    let dtq = Dtq::start(true, &["--allow-host", "send_receipt=http://127.0.0.1:*"]).await?;
    let order = |id: &str| {
        json!({
            "task": "send_receipt",
            "payload": {
                "order_id": id,
                "amount_cents": 1999,
                "email": "ada@example.com",
                "payment_url": payments.url(),
                "email_url": emails.url(),
            },
            "max_attempts": 10,
        })
    };

    // One order in three tasks (no submission key: three tasks), and
    // another order once.
    let mut ids = Vec::new();
    for id in ["A-1", "A-1", "A-1", "B-2"] {
        ids.push(dtq.submit_new("default", order(id), None).await?);
    }
    let mut results = Vec::new();
    for id in &ids {
        let task = dtq
            .wait_for(
                "default",
                id,
                &["SUCCEEDED", "FAILED", "DEAD_LETTERED"],
                WAIT,
            )
            .await?;
        assert_eq!(task["status"], "SUCCEEDED", "{task:#}");
        results.push(task["result"].clone());
    }

    let a1 = &results[..3];
    let charged: Vec<&Value> = a1.iter().filter(|r| r.get("deduped").is_none()).collect();
    assert_eq!(charged.len(), 1, "{a1:?}");
    let charge_id = charged[0]["charge_id"].clone();
    for result in a1 {
        assert_eq!(result["order_id"], "A-1", "{result}");
        assert_eq!(result["charge_id"], charge_id, "{result}");
        assert_eq!(result["receipt_sent"], true, "{result}");
    }
    assert_eq!(results[3]["receipt_sent"], true, "{}", results[3]);
    assert_ne!(results[3]["charge_id"], charge_id);

    assert_eq!(payments.charges_for("A-1"), 1, "{:?}", payments.charges());
    assert_eq!(payments.charges_for("B-2"), 1, "{:?}", payments.charges());
    assert_eq!(emails.emails_for("A-1"), 1, "{:?}", emails.emails());
    assert_eq!(emails.emails_for("B-2"), 1, "{:?}", emails.emails());
    let receipt = &emails.emails()[0];
    assert_eq!(receipt.body["to"], "ada@example.com");
    assert!(receipt.idempotency_key.is_some(), "{receipt:?}");
    let charges = payments.requests_to("/charges");
    assert_eq!(charges.len(), 2, "one request per order: {charges:?}");
    assert!(
        charges.iter().all(|r| r.idempotency_key.is_some()),
        "{charges:?}"
    );
    Ok(())
}
