//! Namespace quotas against a real `redis-server`: the byte count follows
//! every kind of write (overwrite, delete, expiry, staged commit), a write
//! past the budget is refused and writes nothing, and a guest trying to fill
//! a `maxmemory` Redis leaves every other queue, and its own completion,
//! working.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use dtq_host::sandbox::{
    Call, CallReport, CancelHandle, HandlerSettings, Outcome, Sandbox, SandboxConfig, TaskContext,
};
use dtq_tests::{Dtq, RedisServer, guests};
use serde_json::{Value, json};

const USED: &str = "dtq:quota:{operations}";

async fn sandbox(redis: &RedisServer, budget: u64) -> Result<Sandbox> {
    let config = SandboxConfig {
        cache_dir: Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("quota-artifacts")),
        ..SandboxConfig::default()
    };
    let sandbox = Sandbox::new(config, redis.manager().await?)?;
    let settings = HandlerSettings {
        kv_quota_bytes: Some(budget),
        ..HandlerSettings::default()
    };
    sandbox.load_with("operations", &std::fs::read(guests::OPERATIONS)?, &settings)?;
    Ok(sandbox)
}

async fn run(sandbox: &Sandbox, payload: Value) -> CallReport {
    let call = Call {
        task: "operations".into(),
        ctx: TaskContext {
            task_id: uuid::Uuid::now_v7().to_string(),
            queue: "default".into(),
            task_name: "operations".into(),
            attempt: 1,
            max_attempts: 1,
            idempotency_key: None,
        },
        payload: payload.to_string(),
        deadline: None,
    };
    sandbox.call(call, &CancelHandle::new()).await
}

fn success(report: &CallReport) -> Result<Value> {
    match &report.outcome {
        Outcome::Success(json) => Ok(serde_json::from_str(json)?),
        other => bail!("expected success, got {other:?}\nlog:\n{}", report.log),
    }
}

async fn used(redis: &RedisServer) -> Result<u64> {
    let mut conn = redis.conn().await?;
    let used: Option<u64> = redis::cmd("HGET")
        .arg(USED)
        .arg("used")
        .query_async(&mut conn)
        .await?;
    Ok(used.unwrap_or(0))
}

/// Bytes one `flood` key counts: its name `f:<i>` and its value.
fn flood_key(i: usize, kb: usize) -> u64 {
    (format!("f:{i}").len() + (kb << 10)) as u64
}

#[tokio::test(flavor = "multi_thread")]
async fn the_count_follows_writes_overwrites_deletes_and_expiry() -> Result<()> {
    let redis = RedisServer::start()?;
    let sandbox = sandbox(&redis, 1 << 20).await?;

    let report = run(&sandbox, json!({"op": "flood", "kb": 1, "max": 3})).await;
    assert_eq!(success(&report)?, json!({"written": 3}));
    assert_eq!(used(&redis).await?, 3 * flood_key(0, 1));

    // Overwritten larger: counted as they are now, not added.
    run(&sandbox, json!({"op": "flood", "kb": 2, "max": 3})).await;
    assert_eq!(used(&redis).await?, 3 * flood_key(0, 2));

    // Written again with a TTL: once they expire, a later write takes them
    // off the count.
    run(
        &sandbox,
        json!({"op": "flood", "kb": 1, "max": 3, "ttl": 1}),
    )
    .await;
    assert_eq!(used(&redis).await?, 3 * flood_key(0, 1));
    let mut conn = redis.conn().await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: u64 = redis::cmd("EXISTS")
            .arg("dtq:guest:{operations}:f:0")
            .arg("dtq:guest:{operations}:f:1")
            .arg("dtq:guest:{operations}:f:2")
            .query_async(&mut conn)
            .await?;
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("the keys never expired");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = run(&sandbox, json!({"op": "incr", "key": "n"})).await;
    assert_eq!(success(&report)?, json!({"value": 1}));
    assert_eq!(used(&redis).await?, 2, "only `n` = 1 is left");

    // A staged write counts once it commits.
    let report = run(&sandbox, json!({"op": "stage", "key": "k", "bytes": 100})).await;
    assert_eq!(success(&report)?, json!({"outcome": "executed"}));
    assert_eq!(used(&redis).await?, 2 + ("s:k".len() + 100) as u64);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_write_past_the_budget_is_refused_and_writes_nothing() -> Result<()> {
    let redis = RedisServer::start()?;
    let budget = 64 << 10;
    let sandbox = sandbox(&redis, budget).await?;

    let report = run(&sandbox, json!({"op": "flood", "kb": 16, "max": 100})).await;
    let result = success(&report)?;
    assert_eq!(result["written"], 3, "{result}");
    assert_eq!(result["refusal"], "QuotaExceeded", "{result}");
    let message = result["error"].as_str().context("no message")?;
    assert!(message.contains("quota exceeded"), "{message}");
    assert_eq!(used(&redis).await?, 3 * flood_key(0, 16));
    let keys: Vec<String> = redis
        .keys()
        .await?
        .into_iter()
        .filter(|k| k.starts_with("dtq:guest:"))
        .collect();
    assert_eq!(keys.len(), 3, "{keys:?}");

    // An operation whose staged writes would pass it commits nothing and
    // releases its claim; a smaller one commits.
    let report = run(
        &sandbox,
        json!({"op": "stage", "key": "big", "bytes": 32 << 10}),
    )
    .await;
    let result = success(&report)?;
    assert_eq!(result["refusal"], "QuotaExceeded", "{result}");
    let mut conn = redis.conn().await?;
    let (value, claim): (Option<String>, u64) = redis::pipe()
        .cmd("GET")
        .arg("dtq:guest:{operations}:s:big")
        .cmd("EXISTS")
        .arg("dtq:claim:{operations}:big")
        .query_async(&mut conn)
        .await?;
    assert_eq!((value, claim), (None, 0));
    let report = run(
        &sandbox,
        json!({"op": "stage", "key": "small", "bytes": 100}),
    )
    .await;
    assert_eq!(success(&report)?, json!({"outcome": "executed"}));
    assert!(used(&redis).await? <= budget);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_filling_redis_leaves_other_queues_and_its_own_completion_working() -> Result<()> {
    let dtq = Dtq::start(true, &["--kv-quota-mib", "1", "--queues", "default,other"]).await?;
    // Redis may grow 16 MiB past what it holds now, and then refuses writes.
    let mut conn = dtq.redis.conn().await?;
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await?;
    let now: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .context("no used_memory")?
        .trim()
        .parse()?;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(now + (16 << 20))
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut conn)
        .await?;

    // 64 KiB values, up to 64 MiB: four times what Redis has room for.
    let flood = json!({"task": "operations", "payload": {"op": "flood", "kb": 64, "max": 1024}});
    let (status, body) = dtq.submit("default", flood, None).await?;
    assert_eq!(status, 202, "{body}");
    let flood_id = body["task_id"].as_str().context("no id")?.to_owned();
    let done = dtq
        .wait_for(
            "default",
            &flood_id,
            &["SUCCEEDED", "FAILED", "DEAD_LETTERED"],
            WAIT,
        )
        .await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["result"]["refusal"], "QuotaExceeded", "{done:#}");
    let written = done["result"]["written"].as_u64().context("no count")?;
    assert!((1..=16).contains(&written), "{done:#}");

    // Everyone else goes on: submissions are taken and run, on both queues.
    let mut ids = Vec::new();
    for i in 0..40 {
        let queue = if i % 2 == 0 { "default" } else { "other" };
        let (status, body) = dtq
            .submit(queue, json!({"task": "echo", "payload": i}), None)
            .await?;
        assert_eq!(status, 202, "{body}");
        ids.push((queue, body["task_id"].as_str().context("no id")?.to_owned()));
    }
    for (queue, id) in &ids {
        dtq.wait_for(queue, id, &["SUCCEEDED"], WAIT).await?;
    }
    Ok(())
}

const WAIT: Duration = Duration::from_secs(30);
