//! Flows (issue 36): handlers submit tasks exactly once, with their
//! attempt's success, and a parent waits for its children, holding no
//! slot, and resumes once they have all ended.
//!
//! A real worker runs the `flows` test guest (`tests/guests/flows`)
//! against a real redis-server (or the three-primary cluster, with
//! `DTQ_TEST_REDIS=cluster`: children live in another queue, so another
//! slot, than their parent). The parent runs on queue `default`, its
//! children on `kids`; the worker is granted `flows=kids:flows` only.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};
use dtq_tests::Dtq;
use serde_json::{Value, json};

/// Longest a task may take to reach what a test waits for.
const WAIT: Duration = Duration::from_secs(60);

const TERMINAL: [&str; 5] = [
    "SUCCEEDED",
    "FAILED",
    "DEAD_LETTERED",
    "CANCELLED",
    "EXPIRED",
];

/// The flags of a worker that runs parents and children: `kids` is
/// consumed unless `kids_run` is false (its children then stay QUEUED).
fn flags(kids_run: bool) -> Vec<&'static str> {
    let queues = if kids_run { "default,kids" } else { "default" };
    vec!["--queues", queues, "--submit-to", "flows=kids:flows"]
}

/// Submit a `flows` task with `payload` to `default`; its id.
async fn submit(dtq: &Dtq, payload: Value) -> Result<String> {
    dtq.submit_new(
        "default",
        json!({"task": "flows", "payload": payload}),
        None,
    )
    .await
}

/// The ids of every task of queue `queue` (its task hashes in Redis).
async fn tasks_of(dtq: &Dtq, queue: &str) -> Result<Vec<String>> {
    let prefix = format!("dtq:task:{{{queue}}}:");
    let mut ids: Vec<String> = dtq
        .redis
        .keys()
        .await?
        .into_iter()
        .filter_map(|k| k.strip_prefix(&prefix).map(str::to_owned))
        .collect();
    ids.sort();
    Ok(ids)
}

/// Whether Redis has `key`.
async fn exists(dtq: &Dtq, key: &str) -> Result<bool> {
    let n: i64 = redis::cmd("EXISTS")
        .arg(key)
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    Ok(n == 1)
}

/// Poll task `id` of `default` until `done` holds for it; the task then.
async fn wait_until(dtq: &Dtq, id: &str, done: impl Fn(&Value) -> bool) -> Result<Value> {
    let start = Instant::now();
    loop {
        let task = dtq.task("default", id).await?;
        if done(&task) {
            return Ok(task);
        }
        ensure!(
            start.elapsed() < WAIT,
            "task {id} did not get there: {task:#}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// When the sweep next looks at the flow of `parent` (of `default`), in ms
/// (its score in the flows index); `None` once it left the index.
async fn next_look(dtq: &Dtq, parent: &str) -> Result<Option<u64>> {
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg("dtq:flows:{default}")
        .arg(parent)
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    Ok(score.map(|s| s as u64))
}

/// Submit a parent fanning out to `children` on `kids` (which `dtq`'s
/// worker does not run) and wait until it waits with all of them applied;
/// its id and the task as the API shows it then.
async fn waiting_parent(dtq: &Dtq, children: usize) -> Result<(String, Value)> {
    let parent = submit(
        dtq,
        json!({"fan_out": children, "queue": "kids", "task": "flows"}),
    )
    .await?;
    let waiting = wait_until(dtq, &parent, |t| {
        t["status"] == "WAITING"
            && t["children"]
                .as_array()
                .is_some_and(|c| c.len() == children)
    })
    .await?;
    Ok((parent, waiting))
}

/// The ids of the children of `task` (its JSON), in order.
fn child_ids(task: &Value) -> Result<Vec<String>> {
    task["children"]
        .as_array()
        .context("children")?
        .iter()
        .map(|c| c["task_id"].as_str().map(str::to_owned).context("task_id"))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parent_fans_out_waits_and_resumes_once_with_its_childrens_results() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    let parent = submit(
        &dtq,
        json!({"fan_out": 6, "queue": "kids", "task": "flows"}),
    )
    .await?;
    let done = dtq.wait_for("default", &parent, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    let result = &done["result"];
    assert_eq!(result["sum"], 15, "0 + 1 + ... + 5: {result}");
    assert_eq!(dtq.store.stats("default").await?.waiting, 0, "it resumed");
    assert_eq!(result["children"], 6);
    assert_eq!(result["failed"], 0);
    // The run after the wait is the same attempt, not a new one.
    assert_eq!(done["attempts"], 1, "{done:#}");

    // Seen from outside: the parent names its children, in submission
    // order, and each child names its parent.
    let children = done["children"].as_array().context("children")?;
    assert_eq!(children.len(), 6, "{done:#}");
    let ids: Vec<&str> = children
        .iter()
        .filter_map(|c| c["task_id"].as_str())
        .collect();
    assert_eq!(
        result["ids"].as_array().map(Vec::len),
        Some(6),
        "the handler saw its children: {result}"
    );
    assert_eq!(
        ids,
        result["ids"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
    );
    for (i, child) in children.iter().enumerate() {
        assert_eq!(child["status"], "SUCCEEDED", "{child}");
        assert_eq!(child["queue"], "kids");
        let record = dtq.task("kids", child["task_id"].as_str().unwrap()).await?;
        assert_eq!(
            record["parent"],
            json!({"queue": "default", "task_id": parent})
        );
        assert_eq!(record["payload"], json!({"n": i}), "submission order");
    }
    // Exactly these six exist in the children's queue.
    let mut sorted: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    sorted.sort();
    assert_eq!(tasks_of(&dtq, "kids").await?, sorted);

    // The parent went WAITING, then QUEUED once (the resumption), then ran
    // again and succeeded.
    let statuses: Vec<String> = dtq
        .redis
        .task_events("default", &parent)
        .await?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let waited = statuses
        .iter()
        .position(|s| s == "WAITING")
        .with_context(|| format!("no WAITING event: {statuses:?}"))?;
    assert_eq!(
        statuses[waited..],
        ["WAITING", "QUEUED", "RUNNING", "SUCCEEDED"],
        "the parent's events: {statuses:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_parent_holds_no_slot_and_its_key_stays_in_flight() -> Result<()> {
    // Children never run here: the parent waits for good.
    let dtq = Dtq::start(true, &flags(false)).await?;
    let (code, body) = dtq
        .submit(
            "default",
            json!({"task": "flows", "payload": {"fan_out": 2, "queue": "kids", "task": "flows"}}),
            Some("parent-key"),
        )
        .await?;
    assert_eq!(code, 202, "{body}");
    let parent = body["task_id"].as_str().context("task_id")?.to_owned();
    // WAITING comes with the completion; its children, once applied.
    wait_until(&dtq, &parent, |t| {
        t["status"] == "WAITING" && t["children"].as_array().is_some_and(|c| c.len() == 2)
    })
    .await?;
    // No slot held: its message was acknowledged.
    assert_eq!(dtq.redis.pending("default").await?.unwrap_or(0), 0);
    // The key's task is still in flight.
    let (code, body) = dtq
        .submit(
            "default",
            json!({"task": "flows", "payload": {"fan_out": 2, "queue": "kids", "task": "flows"}}),
            Some("parent-key"),
        )
        .await?;
    assert_eq!(code, 409, "{body}");
    assert_eq!(body["error"]["details"]["task_id"], parent.as_str());
    // Other work still runs beside it (4 slots, 4 more tasks).
    let mut others = Vec::new();
    for _ in 0..4 {
        others.push(
            dtq.submit_new("default", json!({"task": "echo", "payload": 1}), None)
                .await?,
        );
    }
    for id in others {
        dtq.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    }
    assert_eq!(dtq.task("default", &parent).await?["status"], "WAITING");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_child_is_visible_to_its_parent() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    let parent = submit(
        &dtq,
        json!({"fan_out": 4, "queue": "kids", "task": "flows", "fail": [2]}),
    )
    .await?;
    let done = dtq.wait_for("default", &parent, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "the parent decides: {done:#}");
    let result = &done["result"];
    assert_eq!(result["failed"], 1, "{result}");
    assert_eq!(result["sum"], 1 + 3, "{result}");
    assert_eq!(
        result["statuses"],
        json!(["SUCCEEDED", "SUCCEEDED", "FAILED", "SUCCEEDED"])
    );
    let children = done["children"].as_array().context("children")?;
    assert_eq!(children[2]["status"], "FAILED");
    assert!(
        children[2]["error"]
            .as_str()
            .is_some_and(|e| e.contains("fails, as asked")),
        "{:#}",
        children[2]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failing_attempt_submits_nothing() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    let id = dtq
        .submit_new(
            "default",
            json!({"task": "flows", "max_attempts": 3,
                "payload": {"submit_then_fail": {"queue": "kids", "task": "flows"}}}),
            None,
        )
        .await?;
    let done = dtq.wait_for("default", &id, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "DEAD_LETTERED", "{done:#}");
    assert_eq!(done["attempts"], 3);
    // A success next to it shows the worker applies what succeeds: once
    // its child exists, a wrongly applied failure would exist too.
    let ok = submit(
        &dtq,
        json!({"submit": {"queue": "kids", "task": "flows", "payload": {"n": 7}}}),
    )
    .await?;
    let ok = dtq.wait_for("default", &ok, &TERMINAL, WAIT).await?;
    let child = ok["result"]["id"].as_str().context("the child's id")?;
    dtq.wait_for_new("kids", child, &["SUCCEEDED"], WAIT)
        .await?;
    // At the source: the failed attempts' completions staged nothing, so
    // the task has no outbox for anyone to apply, now or later.
    assert!(
        !exists(&dtq, &format!("dtq:flow:{{default}}:{id}")).await?,
        "a failed attempt wrote its staged submissions"
    );
    assert_eq!(
        tasks_of(&dtq, "kids").await?,
        [child.to_owned()],
        "three failed attempts each staged a task; none may exist"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rerun_stages_the_same_children_once() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    let parent = submit(
        &dtq,
        json!({"fan_out": 4, "queue": "kids", "task": "flows", "crash_first": true}),
    )
    .await?;
    let done = dtq.wait_for("default", &parent, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["attempts"], 2, "attempt 1 failed after staging");
    assert_eq!(done["result"]["sum"], 6);
    // Attempt 1 was told the ids its children would have; attempt 2 staged
    // the same ones, and only those exist.
    let first: String = redis::cmd("GET")
        .arg(format!("dtq:guest:{{flows}}:ids:{parent}"))
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    let first: Vec<String> = serde_json::from_str(&first)?;
    let applied: Vec<String> = done["result"]["ids"]
        .as_array()
        .context("ids")?
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    assert_eq!(first, applied, "a re-run stages the same children");
    let mut sorted = applied.clone();
    sorted.sort();
    assert_eq!(tasks_of(&dtq, "kids").await?, sorted);
    // Each child's key derives from its parent and position.
    for (i, id) in applied.iter().enumerate() {
        let key = format!("dtq.flow:{parent}:{i}");
        assert_eq!(id, &dtq_host::base::derived_task_id("kids", &key));
        assert_eq!(dtq.task("kids", id).await?["idempotency_key"], key);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_submission_follows_the_submission_contract() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    // Two parents submit under one key of their own: one task.
    let body = json!({"submit": {"queue": "kids", "task": "flows",
        "payload": {"n": 3}, "key": "shared-key"}});
    let a = submit(&dtq, body.clone()).await?;
    let a = dtq.wait_for("default", &a, &TERMINAL, WAIT).await?;
    let b = submit(&dtq, body).await?;
    let b = dtq.wait_for("default", &b, &TERMINAL, WAIT).await?;
    assert_eq!(a["status"], "SUCCEEDED");
    assert_eq!(a["result"]["id"], b["result"]["id"], "{a:#} {b:#}");
    let id = a["result"]["id"].as_str().context("id")?;
    dtq.wait_for_new("kids", id, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(tasks_of(&dtq, "kids").await?, [id.to_owned()]);
    assert_eq!(
        dtq.redis
            .idem_record("kids", "shared-key")
            .await?
            .context("a record")?["task_id"],
        id
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_submission_without_a_grant_is_refused_before_the_handler_returns() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    for (queue, task) in [("other", "flows"), ("kids", "echo")] {
        let id = submit(&dtq, json!({"denied": {"queue": queue, "task": task}})).await?;
        let done = dtq.wait_for("default", &id, &TERMINAL, WAIT).await?;
        assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
        let refused = done["result"]["refused"].as_str().context("refused")?;
        assert!(refused.contains("not granted"), "{refused}");
        assert!(
            refused.contains(queue) && refused.contains(task),
            "{refused}"
        );
    }
    // And a worker granted nothing refuses everything.
    let bare = Dtq::start(true, &["--queues", "default,kids"]).await?;
    let id = submit(&bare, json!({"denied": {"queue": "kids", "task": "flows"}})).await?;
    let done = bare.wait_for("default", &id, &TERMINAL, WAIT).await?;
    assert!(
        done["result"]["refused"]
            .as_str()
            .is_some_and(|r| r.contains("not granted")),
        "{done:#}"
    );
    assert!(tasks_of(&bare, "kids").await?.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cancelling_a_waiting_parent_cancels_its_waiting_children() -> Result<()> {
    let dtq = Dtq::start(true, &flags(false)).await?;
    let (parent, waiting) = waiting_parent(&dtq, 3).await?;
    let children = child_ids(&waiting)?;
    let (_, stats) = dtq
        .call(reqwest::Method::GET, "/v1/queues/default", None, &[])
        .await?;
    assert_eq!(
        (&stats["waiting"], &stats["ready"], &stats["running"]),
        (&json!(1), &json!(0), &json!(0)),
        "the waiting parent is counted as waiting, and only there: {stats}"
    );
    let (code, body) = dtq
        .call(
            reqwest::Method::POST,
            &format!("/v1/queues/default/tasks/{parent}/cancel"),
            None,
            &[],
        )
        .await?;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["status"], "CANCELLED");
    assert_eq!(body["cancelled_children"], json!(children), "it says so");
    assert_eq!(dtq.store.stats("default").await?.waiting, 0, "cancelled");
    let parent = dtq.task("default", &parent).await?;
    assert_eq!(parent["status"], "CANCELLED");
    assert!(
        parent["error"]
            .as_str()
            .is_some_and(|e| e.contains("waiting for its children")),
        "{parent:#}"
    );
    for id in &children {
        assert_eq!(dtq.task("kids", id).await?["status"], "CANCELLED");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn children_a_dead_canceller_left_are_cancelled_by_the_sweep() -> Result<()> {
    // Children never run here: they wait, QUEUED.
    let dtq = Dtq::start(true, &flags(false)).await?;
    let (parent, waiting) = waiting_parent(&dtq, 3).await?;
    let children = child_ids(&waiting)?;
    let statuses = async || -> Result<Vec<String>> {
        let mut out = Vec::new();
        for id in &children {
            let task = dtq.task("kids", id).await?;
            out.push(task["status"].as_str().unwrap_or_default().to_owned());
        }
        Ok(out)
    };
    let score = async || next_look(&dtq, &parent).await;
    let indexed = async || -> Result<bool> { Ok(score().await?.is_some()) };
    let settings = dtq.config.ingest_settings();
    let look = async |at: u64| {
        dtq_host::ingest::repair(&dtq.store, &settings, "default", &parent, at).await
    };

    // It has waited long: its next look is minutes off.
    let at = dtq_host::base::now_ms();
    let _: u64 = redis::cmd("ZADD")
        .arg("dtq:flows:{default}")
        .arg("XX")
        .arg("CH")
        .arg(at + 300_000)
        .arg(&parent)
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    // The parent's cancel lands, and its canceller (an API process killed
    // mid-call) never reaches the children.
    let outcome = dtq.store.cancel("default", &parent, at).await?;
    assert_eq!(outcome, dtq_host::store::CancelOutcome::Cancelled);
    let next = score()
        .await?
        .context("a cancelled parent's live flow stays swept")?;
    assert!(
        next < at + 60_000,
        "its next look comes soon: {next} (cancelled at {at})"
    );

    // A record without its `finished_at` (written by hand, or by an older
    // version) is timed by its `updated_at`, the same instant here.
    let _: u64 = redis::cmd("HDEL")
        .arg(format!("dtq:task:{{default}}:{parent}"))
        .arg("finished_at")
        .query_async(&mut dtq.redis.conn().await?)
        .await?;

    // Within the canceller's grace a look leaves them to it.
    assert_eq!(look(at + 1_000).await?.cancelled, 0);
    assert_eq!(statuses().await?, ["QUEUED"; 3]);

    // Past it, the sweep cancels them, and they tell their parent.
    assert_eq!(look(at + 2_000).await?.cancelled, 3);
    assert_eq!(statuses().await?, ["CANCELLED"; 3]);
    assert!(indexed().await?, "not yet told");
    for child in &children {
        dtq.store
            .settle_child("kids", child, &format!("default/{parent}"))
            .await?;
    }
    // Every child ended: the flow leaves the index, and the parent stays
    // cancelled.
    assert!(!indexed().await?, "a settled cancelled flow left the index");
    assert_eq!(look(at + 3_000).await?.cancelled, 0);
    assert_eq!(dtq.task("default", &parent).await?["status"], "CANCELLED");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_asks_a_running_child_of_a_cancelled_parent_to_stop_once() -> Result<()> {
    // Children never run here: they wait, QUEUED, but for the one marked
    // RUNNING by hand (its worker's `start`).
    let dtq = Dtq::start(true, &flags(false)).await?;
    let (parent, waiting) = waiting_parent(&dtq, 2).await?;
    let children = child_ids(&waiting)?;
    let running = format!("dtq:task:{{kids}}:{}", children[0]);
    let mark = async |status: &str| -> Result<()> {
        let _: u64 = redis::cmd("HSET")
            .arg(&running)
            .arg("status")
            .arg(status)
            .query_async(&mut dtq.redis.conn().await?)
            .await?;
        Ok(())
    };
    mark("RUNNING").await?;
    let at = dtq_host::base::now_ms();
    let outcome = dtq.store.cancel("default", &parent, at).await?;
    assert_eq!(outcome, dtq_host::store::CancelOutcome::Cancelled);
    let settings = dtq.config.ingest_settings();
    let look = async |at: u64| {
        dtq_host::ingest::repair(&dtq.store, &settings, "default", &parent, at).await
    };

    // Past the canceller's grace the sweep cancels the queued child and
    // asks the running one to stop.
    assert_eq!(look(at + 2_000).await?.cancelled, 2);
    assert_eq!(dtq.task("kids", &children[1]).await?["status"], "CANCELLED");
    let flag: Option<String> = redis::cmd("HGET")
        .arg(&running)
        .arg("cancel_requested")
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    assert_eq!(flag.as_deref(), Some("1"));
    // The request stands: later looks, while the child still runs, ask
    // again but count nothing new (no warning, and the looks back off).
    let swept = async || {
        next_look(&dtq, &parent)
            .await?
            .context("the flow is still swept")
    };
    // (The first records the cancelled child's end, which its own settle
    // would have told the parent later.)
    assert_eq!(look(at + 12_000).await?.cancelled, 0);
    let before = swept().await?;
    assert_eq!(look(at + 22_000).await?.cancelled, 0);
    assert!(swept().await? > before, "an unchanged look backs off");
    assert_eq!(dtq.task("kids", &children[0]).await?["status"], "RUNNING");
    // The mechanism says so itself, and still lists the child it asked
    // again (the API's `cancelled_children`).
    let again = dtq.store.cancel_children("default", &parent).await?;
    assert_eq!((again.ids, again.new), (vec![children[0].clone()], 0));

    // Its worker dies and the reclaim puts it back in the queue, still
    // flagged: the next look cancels it outright, which counts.
    mark("QUEUED").await?;
    assert_eq!(look(at + 32_000).await?.cancelled, 1);
    assert_eq!(dtq.task("kids", &children[0]).await?["status"], "CANCELLED");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_submission_inside_an_operation_applies_with_its_commit() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    // Attempt 1 commits the operation, then fails: the submission applies
    // with the commit all the same, and attempt 2 finds the operation done
    // (its effect does not run again): one task.
    let id = submit(
        &dtq,
        json!({"op_submit": {"queue": "kids", "task": "flows", "key": "op-1", "fail_after": true}}),
    )
    .await?;
    let done = dtq.wait_for("default", &id, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["attempts"], 2);
    assert_eq!(
        done["result"]["ran"], false,
        "attempt 2 found it done: {done:#}"
    );
    let children = done["children"].as_array().context("children")?;
    assert_eq!(children.len(), 1, "{done:#}");
    let child = children[0]["task_id"].as_str().context("task_id")?;
    dtq.wait_for("kids", child, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(tasks_of(&dtq, "kids").await?, [child.to_owned()]);
    // Its key is scoped by the operation's.
    let key = dtq.task("kids", child).await?["idempotency_key"].clone();
    assert!(
        key.as_str()
            .is_some_and(|k| k.starts_with(&format!("dtq.flow:{id}:op:"))),
        "{key}"
    );

    // An operation that does not commit submits nothing, though the
    // attempt succeeds.
    let id = submit(
        &dtq,
        json!({"op_submit": {"queue": "kids", "task": "flows", "key": "op-2", "abort": true}}),
    )
    .await?;
    let done = dtq.wait_for("default", &id, &TERMINAL, WAIT).await?;
    assert_eq!(done["result"], json!({"aborted": true}), "{done:#}");
    // The staged entry is dropped once the operation is known not to have
    // committed (the completion's follow-up), and the flow leaves the index.
    let start = Instant::now();
    loop {
        let flows: Vec<String> = redis::cmd("ZRANGE")
            .arg("dtq:flows:{default}")
            .arg(0)
            .arg(-1)
            .query_async(&mut dtq.redis.conn().await?)
            .await?;
        if !flows.contains(&id) {
            break;
        }
        ensure!(
            start.elapsed() < WAIT,
            "the aborted operation's flow stays: {flows:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        dtq.task("default", &id).await?["children"]
            .as_array()
            .is_some_and(Vec::is_empty)
    );
    assert_eq!(
        tasks_of(&dtq, "kids").await?,
        [child.to_owned()],
        "nothing new"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_parent_does_not_expire_it_had_started() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    // Its expiry passes while its children run: it had started by then.
    let parent = dtq
        .submit_new(
            "default",
            json!({"task": "flows", "expires_in_ms": 1000,
                "payload": {"fan_out": 2, "queue": "kids", "task": "flows", "slow_ms": 1500}}),
            None,
        )
        .await?;
    let done = dtq.wait_for("default", &parent, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["result"]["sum"], 1);
    assert!(done["expires_at"].is_null(), "{done:#}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handler_cannot_make_its_worker_hold_unbounded_submissions() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    // Payloads of 512 KiB until refused: the call's staged bytes are
    // bounded (16 MiB), so the refusal comes after about 32.
    let id = submit(
        &dtq,
        json!({"flood": {"queue": "kids", "task": "flows", "bytes": 524288}}),
    )
    .await?;
    let done = dtq.wait_for("default", &id, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "FAILED", "{done:#}");
    let error = done["error"].as_str().context("error")?;
    let staged: usize = error
        .strip_prefix("refused after ")
        .and_then(|rest| rest.split(':').next())
        .and_then(|n| n.parse().ok())
        .with_context(|| error.to_string())?;
    assert!((20..=32).contains(&staged), "{error}");
    assert!(error.contains("larger than the host allows"), "{error}");
    assert!(
        tasks_of(&dtq, "kids").await?.is_empty(),
        "a failed call submits nothing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_after_a_wait_submits_new_children() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    // Three phases, each a wait: the later phases' children are new tasks
    // (the same payload as an earlier one included), not replays of the
    // first phase's at the same place among the run's submissions.
    let parent = submit(
        &dtq,
        json!({"phases": [[1, 2], [1, 20], [300]], "queue": "kids", "task": "flows"}),
    )
    .await?;
    let done = dtq.wait_for("default", &parent, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "SUCCEEDED", "{done:#}");
    assert_eq!(done["result"]["children"], 5, "{done:#}");
    assert_eq!(done["result"]["sum"], 1 + 2 + 1 + 20 + 300, "{done:#}");
    assert_eq!(done["attempts"], 1);
    assert_eq!(tasks_of(&dtq, "kids").await?.len(), 5);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn purging_a_dead_lettered_parent_deletes_its_flow() -> Result<()> {
    let dtq = Dtq::start(true, &flags(true)).await?;
    let parent = dtq
        .submit_new(
            "default",
            json!({"task": "flows", "max_attempts": 1,
                "payload": {"fan_out": 2, "queue": "kids", "task": "flows", "fail_resumed": true}}),
            None,
        )
        .await?;
    let done = dtq.wait_for("default", &parent, &TERMINAL, WAIT).await?;
    assert_eq!(done["status"], "DEAD_LETTERED", "{done:#}");
    assert_eq!(done["children"].as_array().map(Vec::len), Some(2));
    let flow = format!("dtq:flow:{{default}}:{parent}");
    assert!(
        exists(&dtq, &flow).await?,
        "a dead letter keeps its flow, as its record"
    );
    let purged = dtq
        .store
        .purge_dead_letters(
            "default",
            std::slice::from_ref(&parent),
            dtq_host::base::now_ms(),
        )
        .await?;
    assert_eq!(purged, 1);
    assert!(!exists(&dtq, &flow).await?, "purged with its task");
    Ok(())
}

/// The sweep looks at a flow that stays unchanged (a parent waiting on
/// children that do not run) 10 s after its wait, then at gaps as long as
/// it has waited, up to 5 minutes: not every 10 s for as long as it waits.
/// A look that finds work (a child ended) is followed by one 10 s later.
#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_looks_at_a_long_wait_ever_less_often() -> Result<()> {
    // Children never run here: the parent waits for good.
    let dtq = Dtq::start(true, &flags(false)).await?;
    let (parent, waiting) = waiting_parent(&dtq, 2).await?;
    assert_eq!(dtq.store.stats("default").await?.waiting, 1);
    let waited_at: u64 = redis::cmd("HGET")
        .arg(format!("dtq:task:{{default}}:{parent}"))
        .arg("updated_at")
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    let settings = dtq.config.ingest_settings();
    // The sweep at each second from the wait, as a worker's would run it
    // (the worker's own sweep runs on a clock far behind these): the
    // seconds after the wait at which it looked at the flow.
    let looks_between = async |from: u64, to: u64| -> Result<Vec<u64>> {
        let mut looks = Vec::new();
        for s in from..=to {
            let at = waited_at + s * 1_000;
            if dtq.store.flows_due("default", at).await? == [parent.clone()] {
                looks.push(s);
                dtq_host::ingest::repair(&dtq.store, &settings, "default", &parent, at).await?;
            }
        }
        Ok(looks)
    };
    assert_eq!(
        looks_between(0, 1_000).await?,
        [10, 20, 40, 80, 160, 320, 620, 920],
        "seconds after the wait"
    );

    // A look that fails after taking the flow (its sweeper killed, or
    // Redis erring mid-repair) puts nothing off: due again 10 s later.
    let taken = dtq
        .store
        .flows_due("default", waited_at + 1_220_000)
        .await?;
    assert_eq!(taken, std::slice::from_ref(&parent));

    // A child ends unnoticed (cancelled; no worker here sweeps `kids`, so
    // its parent is not told): the next look finds it, the one after
    // comes 10 s later, and the gaps then grow as before.
    let cancel_kid = async |n: usize| -> Result<String> {
        let child = waiting["children"][n]["task_id"]
            .as_str()
            .context("child")?;
        let path = format!("/v1/queues/kids/tasks/{child}/cancel");
        let (code, body) = dtq.call(reqwest::Method::POST, &path, None, &[]).await?;
        ensure!(code == 200, "cancel: {code} {body}");
        Ok(child.to_owned())
    };
    let child = cancel_kid(0).await?;
    assert_eq!(
        looks_between(1_221, 1_600).await?,
        [1_230, 1_240, 1_540],
        "seconds after the wait"
    );
    let flow: Vec<String> = redis::cmd("HKEYS")
        .arg(format!("dtq:flow:{{default}}:{parent}"))
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    assert!(
        flow.contains(&format!("d:kids/{child}")),
        "the look recorded the child's end: {flow:?}"
    );

    // The last child ends and its parent is told, as a worker tells it:
    // the parent resumes, and its next look is 10 s off again (it finds
    // the parent ended), not where the backed-off looks had put it.
    let last = cancel_kid(1).await?;
    let told = dtq
        .store
        .settle_child("kids", &last, &format!("default/{parent}"))
        .await?;
    assert!(told, "the parent resumed");
    assert_eq!(dtq.store.stats("default").await?.waiting, 0, "resumed");
    let next = next_look(&dtq, &parent)
        .await?
        .context("the resumed flow is still swept")?;
    let now = dtq_host::base::now_ms();
    assert!(
        next <= now && next > now - 60_000,
        "the next look is due 10 s from the resumption: {next} (now {now})"
    );
    Ok(())
}
