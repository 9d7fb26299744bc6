//! The W3C trace context a submission hands to its task's attempts
//! (issue 34), in a dtq that does not trace itself: a `traceparent` the
//! submitter sent is stored with the task (its hash, and a carried
//! message's second field) and reaches the attempt, whichever way it
//! starts; a task submitted without one, or with a malformed one, stores
//! nothing for it, so untraced tasks cost Redis nothing more.

use anyhow::{Context as _, Result, ensure};
use dtq_host::store::QueueKeys;
use dtq_tests::Dtq;
use serde_json::{Value, json};

/// A valid W3C traceparent.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// An `echo` task, carried unless it has an expiry (which sends its
/// attempts through `start`).
fn echo(carried: bool) -> Value {
    match carried {
        true => json!({"task": "echo", "payload": {"n": 1}}),
        false => json!({"task": "echo", "payload": {"n": 1}, "expires_in_ms": 600_000}),
    }
}

/// Submit `body` with `headers`; its id.
async fn submit(dtq: &Dtq, body: &Value, headers: &[(&str, &str)]) -> Result<String> {
    let (status, answer) = dtq
        .call(
            reqwest::Method::POST,
            "/v1/queues/default/tasks",
            Some(body.clone()),
            headers,
        )
        .await?;
    ensure!(status == 202, "{status}: {answer}");
    answer["task_id"]
        .as_str()
        .map(str::to_owned)
        .context("a task id")
}

/// Field `traceparent` of task `id`'s hash.
async fn stored(dtq: &Dtq, id: &str) -> Result<Option<String>> {
    Ok(redis::cmd("HGET")
        .arg(QueueKeys::new("default").task(id))
        .arg("traceparent")
        .query_async(&mut dtq.redis.conn().await?)
        .await?)
}

/// The field names of each message of the default queue's stream.
async fn message_fields(dtq: &Dtq) -> Result<Vec<Vec<String>>> {
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&QueueKeys::new("default").stream)
        .arg("-")
        .arg("+")
        .query_async(&mut dtq.redis.conn().await?)
        .await?;
    Ok(entries
        .into_iter()
        .map(|(_, fields)| fields.into_iter().map(|(name, _)| name).collect())
        .collect())
}

/// Three tasks of `body`: without a traceparent, with one, with a
/// malformed one; their ids, after checking what each stored.
async fn submit_three(dtq: &Dtq, body: &Value) -> Result<[String; 3]> {
    let plain = submit(dtq, body, &[]).await?;
    let traced = submit(dtq, body, &[("traceparent", TRACEPARENT)]).await?;
    let junk = submit(dtq, body, &[("traceparent", "00-not-a-trace-01")]).await?;
    assert_eq!(stored(dtq, &plain).await?, None);
    assert_eq!(stored(dtq, &traced).await?.as_deref(), Some(TRACEPARENT));
    assert_eq!(stored(dtq, &junk).await?, None);
    Ok([plain, traced, junk])
}

/// The traceparent each started task of `ids` was handed, in `ids`' order.
async fn started(dtq: &Dtq, ids: &[String]) -> Result<Vec<Option<String>>> {
    let runs = dtq.read_and_start("tester", 10).await?;
    ids.iter()
        .map(|id| {
            runs.iter()
                .find(|(_, task)| &task.id == id)
                .map(|(_, task)| task.traceparent.clone())
                .with_context(|| format!("{id} did not start"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sent_traceparent_rides_the_carried_message_to_the_attempt() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let ids = submit_three(&dtq, &echo(true)).await?;
    // Only the traced task's message has a second field.
    let run = || vec!["run".to_owned()];
    assert_eq!(
        message_fields(&dtq).await?,
        [run(), vec!["run".into(), "traceparent".into()], run()]
    );
    let handed = started(&dtq, &ids).await?;
    assert_eq!(handed, [None, Some(TRACEPARENT.to_owned()), None]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sent_traceparent_reaches_an_attempt_that_start_begins() -> Result<()> {
    // Tasks with an expiry start through `start`: the task hash's field,
    // returned by the script.
    let dtq = Dtq::start(false, &[]).await?;
    let ids = submit_three(&dtq, &echo(false)).await?;
    let handed = started(&dtq, &ids).await?;
    assert_eq!(handed, [None, Some(TRACEPARENT.to_owned()), None]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_stores_its_traceparent_with_each_of_its_tasks() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let item = json!({"task": "echo", "payload": {"n": 1}});
    let (status, answer) = dtq
        .call(
            reqwest::Method::POST,
            "/v1/queues/default/tasks/batch",
            Some(json!({"tasks": [item, item]})),
            &[("traceparent", TRACEPARENT)],
        )
        .await?;
    ensure!(status == 200, "{status}: {answer}");
    let results = answer["results"].as_array().context("results")?;
    ensure!(results.len() == 2, "{answer}");
    for result in results {
        let id = result["body"]["task_id"].as_str().context("a task id")?;
        assert_eq!(stored(&dtq, id).await?.as_deref(), Some(TRACEPARENT));
    }
    Ok(())
}
