//! Task listing (`GET /v1/queues/{queue}/tasks`) against a real
//! redis-server, the real API and worker, and the example handlers: pages
//! newest first over more tasks than a page, the status filter, the bound
//! on what one request reads, tasks whose record is gone, the index's trim
//! by retention, and the route's refusals.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dtq_host::ingest;
use dtq_host::store::{INDEX_TRIM_EVERY, LIST_SCAN_BUDGET, QueueKeys};
use dtq_tests::{Dtq, assert_error, echo_request};
use futures::StreamExt;
use reqwest::Method;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

/// `GET /v1/queues/default/tasks{query}`: status and body.
async fn list(dtq: &Dtq, query: &str) -> Result<(u16, Value)> {
    dtq.call(
        Method::GET,
        &format!("/v1/queues/default/tasks{query}"),
        None,
        &[],
    )
    .await
}

/// A page that must be served: its task ids and its `next_cursor`.
async fn page(dtq: &Dtq, query: &str) -> Result<(Vec<String>, Option<String>)> {
    let (status, body) = list(dtq, query).await?;
    ensure!(status == 200, "{query}: {status} {body}");
    let ids = body["tasks"]
        .as_array()
        .context("tasks")?
        .iter()
        .map(|t| t["task_id"].as_str().map(str::to_owned).context("task_id"))
        .collect::<Result<_>>()?;
    Ok((ids, body["next_cursor"].as_str().map(str::to_owned)))
}

/// Every page of `query` (which has a `?`), following the cursors: the
/// ids, and how many pages it took.
async fn all_pages(dtq: &Dtq, query: &str) -> Result<(Vec<String>, usize)> {
    let (mut ids, mut cursor) = page(dtq, query).await?;
    let mut pages = 1;
    while let Some(c) = cursor {
        let (more, next) = page(dtq, &format!("{query}&cursor={c}")).await?;
        ids.extend(more);
        cursor = next;
        pages += 1;
        ensure!(pages < 100, "the pages do not end");
    }
    Ok((ids, pages))
}

async fn submit(dtq: &Dtq, body: Value) -> Result<String> {
    dtq.submit_new("default", body, None).await
}

fn echo(n: usize) -> Value {
    json!({"task": "echo", "payload": {"n": n}})
}

#[tokio::test(flavor = "multi_thread")]
async fn pages_go_newest_first_over_more_tasks_than_a_page() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let mut ids = Vec::new();
    for n in 0..25 {
        ids.push(submit(&dtq, echo(n)).await?);
    }
    let newest_first: Vec<String> = ids.iter().rev().cloned().collect();

    let (first, cursor) = page(&dtq, "?limit=10").await?;
    assert_eq!(first, newest_first[..10]);
    let cursor = cursor.context("more pages")?;
    let (second, cursor) = page(&dtq, &format!("?limit=10&cursor={cursor}")).await?;
    assert_eq!(second, newest_first[10..20]);
    let (third, cursor) = page(
        &dtq,
        &format!("?limit=10&cursor={}", cursor.context("more")?),
    )
    .await?;
    assert_eq!(third, newest_first[20..]);
    assert_eq!(cursor, None, "the last page ends the listing");

    // A page that ends exactly at the last task ends it too.
    let (all, pages) = all_pages(&dtq, "?limit=5").await?;
    assert_eq!((all, pages), (newest_first.clone(), 5));

    // The default page holds them all. Each task is a summary: what and
    // where, not its payload.
    let (status, body) = list(&dtq, "").await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["next_cursor"], Value::Null);
    assert_eq!(body["status"], Value::Null);
    let tasks = body["tasks"].as_array().context("tasks")?;
    assert_eq!(tasks.len(), 25);
    let newest = &tasks[0];
    assert_eq!(newest["task_id"], json!(ids[24]));
    assert_eq!(newest["queue"], "default");
    assert_eq!(newest["task"], "echo");
    assert_eq!(newest["status"], "QUEUED");
    assert_eq!(newest["attempts"], 0);
    assert!(
        newest["created_at"].as_u64().is_some_and(|t| t > 0),
        "{newest}"
    );
    assert!(newest.get("payload").is_none(), "{newest}");

    // Tasks submitted after a page was read do not shift the next page.
    let (first, cursor) = page(&dtq, "?limit=10").await?;
    submit(&dtq, echo(99)).await?;
    let (second, _) = page(
        &dtq,
        &format!("?limit=10&cursor={}", cursor.context("more")?),
    )
    .await?;
    assert_eq!([first, second].concat(), newest_first[..20]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_status_filter_keeps_the_tasks_of_one_status() -> Result<()> {
    let dtq = Dtq::start(true, &[]).await?;
    let mut succeeded = Vec::new();
    let mut dead = Vec::new();
    let mut scheduled = Vec::new();
    for n in 0..3 {
        succeeded.push(submit(&dtq, echo(n)).await?);
        dead.push(
            submit(
                &dtq,
                json!({"task": "flaky", "payload": {"succeed_on_attempt": 9}, "max_attempts": 1}),
            )
            .await?,
        );
        scheduled.push(
            submit(
                &dtq,
                json!({"task": "echo", "payload": n, "delay_ms": 3_600_000}),
            )
            .await?,
        );
    }
    for id in &succeeded {
        dtq.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    }
    for id in &dead {
        dtq.wait_for("default", id, &["DEAD_LETTERED"], WAIT)
            .await?;
    }
    let newest_first = |ids: &[String]| ids.iter().rev().cloned().collect::<Vec<_>>();

    let (got, _) = all_pages(&dtq, "?status=SUCCEEDED").await?;
    assert_eq!(got, newest_first(&succeeded));
    // Any case; pages of one.
    let (got, pages) = all_pages(&dtq, "?status=dead_lettered&limit=1").await?;
    assert_eq!(got, newest_first(&dead));
    assert!(pages >= 3, "{pages}");
    let (status, body) = list(&dtq, "?status=scheduled").await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "SCHEDULED");
    let got: Vec<&str> = body["tasks"]
        .as_array()
        .context("tasks")?
        .iter()
        .filter_map(|t| t["task_id"].as_str())
        .collect();
    assert_eq!(got, newest_first(&scheduled));
    assert_eq!(page(&dtq, "?status=RUNNING").await?, (vec![], None));

    // A status is the task's own, read with the page: a cancel shows.
    let (status, body) = dtq
        .call(
            Method::POST,
            &format!("/v1/queues/default/tasks/{}/cancel", scheduled[1]),
            None,
            &[],
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        page(&dtq, "?status=CANCELLED").await?,
        (vec![scheduled[1].clone()], None)
    );
    let (everything, _) = all_pages(&dtq, "?limit=4").await?;
    assert_eq!(everything.len(), 9);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_request_reads_a_bounded_part_of_the_index() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    // More tasks than one request reads, straight through the submission
    // path (no HTTP: it is only quicker).
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

    // No task has this status: the first request stops at the budget and
    // says where to go on; the second reads the rest and ends.
    let (ids, cursor) = page(&dtq, "?status=FAILED&limit=10").await?;
    assert!(ids.is_empty(), "{ids:?}");
    let cursor = cursor.context("a short page continues")?;
    let (ids, cursor) = page(&dtq, &format!("?status=FAILED&limit=10&cursor={cursor}")).await?;
    assert_eq!((ids, cursor), (vec![], None));

    // Unfiltered, every task once, newest first by the index's order.
    let (all, pages) = all_pages(&dtq, "?limit=1000").await?;
    assert_eq!(all.len(), total);
    assert_eq!(all.iter().collect::<HashSet<_>>().len(), total);
    assert_eq!(pages, 3);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tasks_whose_record_is_gone_are_skipped() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let mut ids = Vec::new();
    for n in 0..4 {
        ids.push(submit(&dtq, echo(n)).await?);
    }
    let mut conn = dtq.redis.conn().await?;
    let _: () = redis::cmd("DEL")
        .arg(QueueKeys::new("default").task(&ids[2]))
        .query_async(&mut conn)
        .await?;
    let (got, cursor) = page(&dtq, "?limit=3").await?;
    assert_eq!(got, [ids[3].clone(), ids[1].clone(), ids[0].clone()]);
    assert_eq!(cursor, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_index_is_trimmed_to_the_retention() -> Result<()> {
    let dtq = Dtq::start(false, &["--task-retention-s", "1"]).await?;
    let index = QueueKeys::new("default").index;
    let mut conn = dtq.redis.conn().await?;
    let settings = dtq.config.ingest_settings();
    let submit_n = |n: usize| {
        let (store, settings) = (&dtq.store, &settings);
        async move {
            for i in 0..n {
                let req = echo_request(json!(i));
                ingest::submit(store, settings, "default", None, req, |_| true).await?;
            }
            anyhow::Ok(())
        }
    };
    // Enough old entries to fill whole stream nodes (100 entries at most
    // each), which are what a `MINID ~` trim removes.
    submit_n(300).await?;
    let before: u64 = redis::cmd("XLEN")
        .arg(&index)
        .query_async(&mut conn)
        .await?;
    assert_eq!(before, 300);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // The next trim comes within INDEX_TRIM_EVERY submissions.
    submit_n(INDEX_TRIM_EVERY as usize).await?;
    let after: u64 = redis::cmd("XLEN")
        .arg(&index)
        .query_async(&mut conn)
        .await?;
    assert!(
        (INDEX_TRIM_EVERY..200).contains(&after),
        "{after} entries left of {}",
        300 + INDEX_TRIM_EVERY
    );
    let (all, _) = all_pages(&dtq, "?limit=1000").await?;
    assert_eq!(all.len() as u64, after);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_status_cursor_or_limit_is_400_with_a_code() -> Result<()> {
    let dtq = Dtq::start(false, &[]).await?;
    let bad_status = list(&dtq, "?status=DONE").await?;
    assert_error(&bad_status, 400, "INVALID_STATUS");
    let statuses = bad_status.1["error"]["details"]["statuses"]
        .as_array()
        .context("the statuses")?;
    assert_eq!(statuses.len(), 10, "{statuses:?}");
    assert!(statuses.contains(&json!("WAITING")));
    assert_error(&list(&dtq, "?status=").await?, 400, "INVALID_STATUS");
    assert_error(&list(&dtq, "?cursor=abc").await?, 400, "INVALID_CURSOR");
    assert_error(&list(&dtq, "?cursor=").await?, 400, "INVALID_CURSOR");
    assert_error(&list(&dtq, "?limit=0").await?, 400, "INVALID_LIMIT");
    assert_error(&list(&dtq, "?limit=1001").await?, 400, "INVALID_LIMIT");
    assert_error(&list(&dtq, "?order=asc").await?, 400, "INVALID_QUERY");
    // A queue nothing was submitted to lists nothing.
    assert_eq!(page(&dtq, "?status=QUEUED").await?, (vec![], None));
    Ok(())
}
