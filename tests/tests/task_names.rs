//! Task names where the API reads them from task records: the listing's
//! `?task=` filter keeps the status filter's bound on what one request
//! reads, and the live events of a partitioned queue, merged over its
//! partitions, each carry their task's name.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use dtq_host::client::events::Watched;
use dtq_host::ingest;
use dtq_host::store::LIST_SCAN_BUDGET;
use dtq_tests::{Dtq, echo_request};
use futures::StreamExt;
use reqwest::Method;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

const ADMIN: &str = "names-admin";

/// A page of `GET /v1/queues/default/tasks{query}`: its task ids and its
/// `next_cursor`.
async fn page(dtq: &Dtq, query: &str) -> Result<(Vec<String>, Option<String>)> {
    let (status, body) = dtq
        .call(
            Method::GET,
            &format!("/v1/queues/default/tasks{query}"),
            None,
            &[],
        )
        .await?;
    ensure!(status == 200, "{query}: {status} {body}");
    let ids = body["tasks"]
        .as_array()
        .context("tasks")?
        .iter()
        .map(|t| t["task_id"].as_str().map(str::to_owned).context("task_id"))
        .collect::<Result<_>>()?;
    Ok((ids, body["next_cursor"].as_str().map(str::to_owned)))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_task_filter_reads_a_bounded_part_of_the_index() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let settings = dtq.config.ingest_settings();
    let total = LIST_SCAN_BUDGET + 100;
    let submitted: Vec<Result<()>> = futures::stream::iter(0..total)
        .map(|n| {
            let req = echo_request(json!(n));
            let (store, settings) = (&dtq.store, &settings);
            async move {
                ingest::submit(store, settings, "default", None, req, |_| true).await?;
                Ok(())
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    submitted.into_iter().collect::<Result<()>>()?;

    // No task has this name: the first request stops at the budget and
    // says where to go on; the second reads the rest and ends.
    let (ids, cursor) = page(&dtq, "?task=sleep&limit=10").await?;
    assert!(ids.is_empty(), "{ids:?}");
    let cursor = cursor.context("a short page continues")?;
    let (ids, cursor) = page(&dtq, &format!("?task=sleep&limit=10&cursor={cursor}")).await?;
    assert_eq!((ids, cursor), (vec![], None));

    // Every task has this one: full pages.
    let (ids, cursor) = page(&dtq, "?task=echo&limit=1000").await?;
    assert_eq!(ids.len(), 1000);
    assert!(cursor.is_some());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn merged_events_of_a_partitioned_queue_carry_their_task_names() -> Result<()> {
    let dtq = Dtq::start(false, &["--admin-token", ADMIN]).await?;
    let auth = format!("Bearer {ADMIN}");
    let (status, body) = dtq
        .call(
            Method::PUT,
            "/v1/queues/pq/partitions",
            Some(json!({"count": 4})),
            &[("Authorization", &auth)],
        )
        .await?;
    ensure!(status == 200, "{status} {body}");
    // Round robin over the partitions: every one holds some of each name.
    let mut names = HashMap::new();
    for n in 0..8 {
        let task = if n % 2 == 0 { "echo" } else { "sleep" };
        let id = dtq
            .submit_new("pq", json!({"task": task, "payload": {"ms": 1}}), None)
            .await?;
        names.insert(id, task);
    }
    let client = dtq_host::client::Client::new(&dtq.api)?;
    let mut events = client.watch("pq", None, Some("0".into()))?;
    let mut seen = HashMap::new();
    while seen.len() < names.len() {
        let next = tokio::time::timeout(WAIT, events.next()).await??;
        let Watched::Event(event) = next else {
            bail!("the stream broke: {next:?}");
        };
        let data: Value = serde_json::from_str(&event.data)?;
        let id = data["task_id"].as_str().context("task_id")?.to_owned();
        seen.insert(id, data["task"].clone());
    }
    for (id, task) in &names {
        assert_eq!(seen[id], json!(task), "{id}");
    }
    Ok(())
}
