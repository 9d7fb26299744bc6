//! Bounded queue names (issue 31): any submitter may name a new queue, so
//! the fleet's registry of queue names (`dtq:queues`) and each process's
//! per-queue maps are bounded by `--max-queues`; a submission to a new
//! queue past it is refused with 409 `TOO_MANY_QUEUES`, writing nothing,
//! while the queues already known go on working. Against a real
//! redis-server and the real API.

use anyhow::Result;
use dtq_tests::{Dtq, assert_error};
use reqwest::Method;
use serde_json::json;

const MAX: usize = 3;

fn echo(i: usize) -> serde_json::Value {
    json!({"task": "echo", "payload": i})
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_queue_names_stops_at_the_bound() -> Result<()> {
    let dtq = Dtq::start(false, &["--max-queues", &MAX.to_string()]).await?;
    for i in 0..MAX {
        dtq.submit_new(&format!("q{i}"), echo(i), None).await?;
    }
    // One submission per new name, as a flood would send them.
    for i in MAX..MAX + 50 {
        let refused = dtq.submit(&format!("flood-{i}"), echo(i), None).await?;
        assert_error(&refused, 409, "TOO_MANY_QUEUES");
        assert_eq!(refused.1["error"]["details"]["max"], MAX, "{}", refused.1);
        // Reads of unknown names do not grow this process's maps either.
        let (status, _) = dtq
            .call(Method::GET, &format!("/v1/queues/read-{i}"), None, &[])
            .await?;
        assert_eq!(status, 200);
    }
    let batch = dtq
        .call(
            Method::POST,
            "/v1/queues/flood-batch/tasks/batch",
            Some(json!({"tasks": [echo(0)]})),
            &[],
        )
        .await?;
    assert_error(&batch, 409, "TOO_MANY_QUEUES");

    let mut conn = dtq.redis.conn().await?;
    let registered: usize = redis::cmd("SCARD")
        .arg("dtq:queues")
        .query_async(&mut conn)
        .await?;
    assert_eq!(registered, MAX);
    assert!(
        dtq.store.known_queue_names() <= MAX,
        "{} names in this process's maps",
        dtq.store.known_queue_names()
    );
    // Nothing of a refused submission was written.
    let keys = dtq.redis.keys().await?;
    assert!(!keys.iter().any(|k| k.contains("flood")), "{keys:?}");
    // The queues the registry holds go on working.
    for i in 0..MAX {
        dtq.submit_new(&format!("q{i}"), echo(i), None).await?;
    }
    let (status, body) = dtq.call(Method::GET, "/v1/queues", None, &[]).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["queues"].as_array().map(Vec::len), Some(MAX), "{body}");
    Ok(())
}
