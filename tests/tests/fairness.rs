//! Fair fetching across queues: a worker consuming several queues, all idle
//! but one, drains the busy one at close to the rate it drains it alone.
//!
//! Before the single fetch loop, each queue's loop held the free slots
//! through a 500 ms blocking read: 200 echo tasks with `--concurrency 4`
//! took about 0.2 s with `--queues b` and about 50 s with
//! `--queues a,c,d,e,b`.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dtq_tests::Dtq;
use serde_json::json;

const TASKS: usize = 200;

/// Far above the single-queue time (a fraction of a second), far below the
/// 50 s of four idle queues each holding the slots for a blocking read.
const BOUND: Duration = Duration::from_secs(5);

/// Submit [`TASKS`] echo tasks to `b`, start a worker consuming `queues`
/// with `--concurrency 4`, and time until `b` is drained; every task must
/// have succeeded.
async fn drain_time(queues: &str) -> Result<Duration> {
    let mut dtq = Dtq::start(false, &["--queues", queues, "--concurrency", "4"]).await?;
    let mut ids = Vec::with_capacity(TASKS);
    for i in 0..TASKS {
        ids.push(
            dtq.submit_new("b", json!({"task": "echo", "payload": i}), None)
                .await?,
        );
    }
    let start = Instant::now();
    dtq.start_worker();
    loop {
        let stats = dtq.store.stats("b").await?;
        if stats.ready == 0 && stats.running == 0 && stats.delayed == 0 {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("queue b not drained in 120 s with --queues {queues}: {stats:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = start.elapsed();
    for id in &ids {
        let task = dtq.task("b", id).await?;
        assert_eq!(task["status"], "SUCCEEDED", "{task}");
    }
    dtq.stop_worker().await?;
    Ok(took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::print_stdout, reason = "the test reports its drain times")]
async fn a_busy_queue_among_idle_ones_drains_at_close_to_its_own_rate() -> Result<()> {
    let alone = drain_time("b").await?;
    let among_idle = drain_time("a,c,d,e,b").await?;
    println!(
        "{TASKS} echo tasks, --concurrency 4: --queues b drained in {alone:?}, \
         --queues a,c,d,e,b in {among_idle:?}"
    );
    assert!(
        among_idle < BOUND,
        "with four idle queues, b took {among_idle:?} (alone: {alone:?})"
    );
    Ok(())
}

/// Two busy queues share the slots: neither waits for the other to drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_queues_share_the_slots() -> Result<()> {
    let mut dtq = Dtq::start(false, &["--queues", "p,q", "--concurrency", "2"]).await?;
    let mut p = Vec::new();
    let mut q = Vec::new();
    for i in 0..40 {
        p.push(
            dtq.submit_new("p", json!({"task": "echo", "payload": i}), None)
                .await?,
        );
        q.push(
            dtq.submit_new("q", json!({"task": "echo", "payload": i}), None)
                .await?,
        );
    }
    dtq.start_worker();
    // When the first queue is drained, the other is at least half done.
    let start = Instant::now();
    loop {
        let (sp, sq) = (dtq.store.stats("p").await?, dtq.store.stats("q").await?);
        let left = |s: &dtq_host::store::QueueStats| s.ready + s.running + s.delayed;
        if left(&sp) == 0 || left(&sq) == 0 {
            assert!(
                left(&sp) <= 20 && left(&sq) <= 20,
                "one queue drained while the other had {} and {} left",
                left(&sp),
                left(&sq)
            );
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("neither queue drained: {sp:?} {sq:?}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for (queue, ids) in [("p", &p), ("q", &q)] {
        for id in ids {
            dtq.wait_for(queue, id, &["SUCCEEDED"], Duration::from_secs(30))
                .await?;
        }
    }
    dtq.stop_worker().await?;
    Ok(())
}

/// Calls that compute without waiting, more of them than the worker has
/// guest threads, do not hold up the tasks beside them: the fetch loop and
/// the completer share the guest runtime with the calls, and get a turn at
/// every epoch tick of a spinning guest. Quick tasks run and complete while
/// every spinner is still RUNNING.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(
    clippy::print_stdout,
    reason = "the test reports how long the quick tasks took"
)]
async fn quick_tasks_complete_while_spinning_calls_hold_every_guest_thread() -> Result<()> {
    const SPINNERS: usize = 6;
    const SPIN_MS: u64 = 8_000;
    let mut dtq = Dtq::start(false, &["--queues", "b", "--concurrency", "8"]).await?;
    let mut spinners = Vec::new();
    for _ in 0..SPINNERS {
        spinners.push(
            dtq.submit_new(
                "b",
                json!({"task": "sleep", "payload": {"ms": SPIN_MS}}),
                None,
            )
            .await?,
        );
    }
    dtq.start_worker();
    for id in &spinners {
        dtq.wait_for("b", id, &["RUNNING"], Duration::from_secs(30))
            .await?;
    }
    let start = Instant::now();
    let mut quick = Vec::new();
    for i in 0..20 {
        quick.push(
            dtq.submit_new("b", json!({"task": "echo", "payload": i}), None)
                .await?,
        );
    }
    for id in &quick {
        dtq.wait_for("b", id, &["SUCCEEDED"], Duration::from_secs(30))
            .await?;
    }
    let took = start.elapsed();
    println!("20 quick tasks beside {SPINNERS} spinning calls took {took:?}");
    for id in &spinners {
        let task = dtq.task("b", id).await?;
        assert_eq!(
            task["status"], "RUNNING",
            "20 quick tasks took {took:?}, past a spinner's end: {task}"
        );
    }
    for id in &spinners {
        dtq.wait_for("b", id, &["SUCCEEDED"], Duration::from_secs(60))
            .await?;
    }
    dtq.stop_worker().await?;
    Ok(())
}
