//! Chaos: real `dtq` processes (three workers and one API) against a
//! `redis-server` with AOF on, while the test SIGKILLs a random worker every
//! few seconds (starting a new one in its place) and stops and restarts
//! Redis twice. The workload is mostly `send_receipt` orders (each with its
//! own Idempotency-Key, some submitted twice with it), with `counter` and
//! short `sleep` tasks. `send_receipt` charges each order through a payment
//! service and emails its receipt through an email service, over HTTP: both
//! are real HTTP servers that this test runs in its own process
//! (`dtq_tests::services`), on loopback, which the workers are allowed to
//! reach (`--allow-host send_receipt=http://127.0.0.1:*`). Both honour
//! `Idempotency-Key` as payment APIs do, and record every request, charge
//! and email.
//!
//! At the end the test prints one table and asserts each figure: no
//! acknowledged task lost or stuck, no live worker's task dead-lettered as
//! lost, and, from the services' own records:
//!
//! - every order whose task SUCCEEDED was charged exactly once, no order
//!   more than once, and no order whose task never ran at all (about one
//!   order in a hundred is held back, `delay_ms` an hour, and cancelled
//!   before it runs; any other task that ends with no attempt counts too);
//! - each SUCCEEDED task's result names the charge the service recorded
//!   for its order (`charge_id`);
//! - every charge request of an order carried one and the same
//!   Idempotency-Key (the host derives it from the handler's namespace and
//!   the operation key `charge:<order_id>`), so a request repeated after a
//!   kill (the table counts these replays) was answered with the stored
//!   charge instead of charging again;
//! - every SUCCEEDED order got exactly one email, naming its charge, and a
//!   never-run order none. At least one, because a task succeeds only once
//!   its `receipt:<order_id>` operation is done, and that operation is done
//!   only after the email service answered 2xx, and it records the email
//!   before it answers. At most one, because that operation's requests, too,
//!   carry one Idempotency-Key, which the test's email service honours; an
//!   email service that ignored the header could send a second email when a
//!   worker dies between the request and the operation's commit.
//!
//! The tasks are submitted in waves, one before each fault, and each fault
//! strikes once half of its wave is acknowledged: the workers are busy, so a
//! kill or an outage interrupts tasks mid-run, not an idle fleet.
//!
//! Only acknowledged submissions count: 202 (new task), 200 (replay of a
//! terminal key) or 409 (key in flight; its task id is in the details). A
//! submission that fails (Redis down, connection dropped, timeout) is sent
//! again, with the same Idempotency-Key when it has one, until acknowledged.
//!
//! Sizes come from the environment; the defaults are the short form that
//! `cargo test` (and so CI) runs in a few minutes. `scripts/chaos` runs the
//! long form.
//!
//! | variable | default | |
//! |---|---|---|
//! | `DTQ_CHAOS_TASKS` | 4000 | submissions (tasks, plus deliberate duplicate submissions of orders); about 70 % are new orders |
//! | `DTQ_CHAOS_SECS` | 60 | seconds of faults (a wave of submissions before each), Redis outages aside |
//! | `DTQ_CHAOS_KILL_MS` | 2500 | mean time between worker kills (each drawn from 80 % to 120 % of it) |
//! | `DTQ_CHAOS_REDIS_RESTARTS` | 2 | Redis stops and restarts, spread evenly over the run |
//! | `DTQ_CHAOS_DRAIN_SECS` | 180 | deadline for every task to be terminal once the chaos ends |
//! | `DTQ_CHAOS_SEED` | random | replays a run's workload and fault schedule (it is printed) |
//!
//! Every process writes its log to a file in the test's temporary
//! directory; when the test fails, the tail of each is printed and the
//! directory is kept.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use dtq_tests::chaos::{
    Chaos, Figure, REQUEST_TIMEOUT, Servers, Settings, Submission, TERMINAL, Waves, examples,
    task_fields, wait_terminal,
};
use dtq_tests::services::{Recorded, Service};
use dtq_tests::{ApiClient, PersistentRedis, TempDir};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The queue every task goes to.
const QUEUE: &str = "default";

/// What the workers let `send_receipt` reach: the test's services, on
/// loopback (`--allow-host`).
const ALLOW_SERVICES: &str = "send_receipt=http://127.0.0.1:*";

/// The delay of the orders held back so that they never run (ms): far
/// beyond the end of any run. They are cancelled once the chaos is over.
const HELD_BACK_DELAY_MS: u64 = 3_600_000;

/// One new order in this many is held back.
const HELD_BACK_EVERY: usize = 100;

/// Redis persistence: AOF on, fsynced every second. A graceful stop
/// (SHUTDOWN or SIGTERM) writes and fsyncs the whole AOF before the server
/// exits, and Redis writes each command to the AOF file before it replies,
/// so a graceful stop loses no acknowledged write; `always` would only add
/// an fsync per write, which guards against a machine crash this test does
/// not make.
const REDIS_PERSISTENCE: &[&str] = &["--appendonly", "yes", "--appendfsync", "everysec"];

/// Workers running at any time.
const WORKERS: usize = 3;

/// Each worker's execution slots (the default): what a kill interrupts
/// when the worker is busy.
const CONCURRENCY: &str = "8";

/// The visibility timeout every process runs with (ms): short, so that a
/// killed worker's tasks are reclaimed quickly, and shorter than each Redis
/// outage.
const VISIBILITY_MS: &str = "1000";

/// Every task's attempts: enough that worker kills alone never exhaust them.
const MAX_ATTEMPTS: u32 = 10;

/// Every task's time limit (ms); the longest task busy-waits 200 ms.
const TASK_TIMEOUT_MS: u64 = 5_000;

/// Submissions in flight at once.
const SUBMITTERS: usize = 32;

/// How the submissions go: `SUBMITTERS` at a time to `QUEUE`, a fault
/// striking up to 100 ms after half of its wave is acknowledged.
const WAVES: Waves = Waves {
    queue: QUEUE,
    submitters: SUBMITTERS,
    jitter_ms: 100,
    noun: "submissions",
};

/// The flags of every server process besides the ones all chaos servers
/// run with: `send_receipt` allowed to reach the test's services, and
/// short timings.
fn server_flags() -> Vec<String> {
    [
        "--allow-host",
        ALLOW_SERVICES,
        "--concurrency",
        CONCURRENCY,
        "--visibility-timeout-ms",
        VISIBILITY_MS,
    ]
    .map(str::to_owned)
    .to_vec()
}

// ---------------------------------------------------------------------------
// The workload

/// What one submission is.
enum Work {
    /// `send_receipt` of order `order` (an index into the orders).
    Order(usize),
    Counter,
    Sleep,
}

/// One planned submission.
struct Planned {
    body: Value,
    key: Option<String>,
    work: Work,
}

/// An order of the run.
struct Order {
    /// `ord-NNNNNN`.
    id: String,
    /// Held back (`delay_ms` an hour): it must never run. It is cancelled
    /// once the chaos is over.
    held_back: bool,
}

/// The base URLs the `send_receipt` payloads carry.
struct Services<'a> {
    payment_url: &'a str,
    email_url: &'a str,
}

/// The submissions of a run, in order, and the orders (`Work::Order`
/// indexes them): about 70 % new orders, 5 % orders submitted again, 15 %
/// counters and 10 % sleeps.
fn plan(
    settings: &Settings,
    rng: &mut StdRng,
    services: &Services<'_>,
) -> (Vec<Planned>, Vec<Order>) {
    let mut orders: Vec<(Order, Value)> = Vec::new();
    let mut planned = Vec::with_capacity(settings.size);
    let limits = |mut body: Value| {
        body["max_attempts"] = json!(MAX_ATTEMPTS);
        body["timeout_ms"] = json!(TASK_TIMEOUT_MS);
        body
    };
    for _ in 0..settings.size {
        let roll = rng.random_range(0..100);
        if roll < 5 && !orders.is_empty() {
            // A recent order submitted again with its key (often while its
            // task is in flight): the same task.
            let n = rng.random_range(orders.len().saturating_sub(8)..orders.len());
            planned.push(Planned {
                body: orders[n].1.clone(),
                key: Some(format!("order-{}", orders[n].0.id)),
                work: Work::Order(n),
            });
        } else if roll < 75 {
            let id = format!("ord-{:06}", orders.len());
            let held_back = orders.len() % HELD_BACK_EVERY == HELD_BACK_EVERY / 2;
            let mut body = limits(json!({
                "task": "send_receipt",
                "payload": {
                    "order_id": id,
                    "amount_cents": rng.random_range(100..100_000),
                    "payment_url": services.payment_url,
                    "email_url": services.email_url,
                },
            }));
            if held_back {
                body["delay_ms"] = json!(HELD_BACK_DELAY_MS);
            }
            planned.push(Planned {
                body: body.clone(),
                key: Some(format!("order-{id}")),
                work: Work::Order(orders.len()),
            });
            orders.push((Order { id, held_back }, body));
        } else if roll < 90 {
            planned.push(Planned {
                body: limits(json!({
                    "task": "counter",
                    "payload": {
                        "name": format!("c{}", rng.random_range(0..16)),
                        "by": rng.random_range(1..=5),
                    },
                })),
                key: None,
                work: Work::Counter,
            });
        } else {
            planned.push(Planned {
                body: limits(json!({
                    "task": "sleep",
                    "payload": {"ms": rng.random_range(20..=200)},
                })),
                key: None,
                work: Work::Sleep,
            });
        }
    }
    (
        planned,
        orders.into_iter().map(|(order, _)| order).collect(),
    )
}

impl Submission for Planned {
    fn body(&self) -> &Value {
        &self.body
    }

    fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }
}

/// Cancel the held-back task `id`, retrying what may be a passing failure
/// (a 5xx, a dropped connection, a timeout); the answer, or the last
/// failure.
async fn cancel(api: &ApiClient, id: &str) -> String {
    let path = format!("/v1/queues/{QUEUE}/tasks/{id}/cancel");
    let mut last = String::new();
    for _ in 0..20 {
        let answer = tokio::time::timeout(
            REQUEST_TIMEOUT,
            api.call(reqwest::Method::POST, &path, None, &[]),
        )
        .await;
        last = match answer {
            Ok(Ok((code, body))) if code < 500 => return format!("{code} {body}"),
            Ok(Ok((code, body))) => format!("{code} {body}"),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => format!("no answer within {REQUEST_TIMEOUT:?}"),
        };
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    last
}

// ---------------------------------------------------------------------------
// Reading the outcome

/// A task hash's fields this test reads.
#[derive(Clone, Debug, Default)]
struct TaskRow {
    status: String,
    error: Option<String>,
    worker: Option<String>,
    attempts: Option<String>,
    /// The handler's result (JSON), once SUCCEEDED.
    result: Option<String>,
}

impl TaskRow {
    fn is_terminal(&self) -> bool {
        TERMINAL.contains(&self.status.as_str())
    }

    /// Attempts started (0 for a task that never ran).
    fn attempts(&self) -> u32 {
        self.attempts
            .as_deref()
            .and_then(|a| a.parse().ok())
            .unwrap_or(0)
    }
}

/// The task hashes of `ids` (`None` for a task with no hash).
async fn read_tasks(
    conn: &mut redis::aio::MultiplexedConnection,
    ids: &[String],
) -> Result<Vec<Option<TaskRow>>> {
    let fields = ["status", "error", "worker", "attempts", "result"];
    let rows = task_fields(conn, QUEUE, ids, &fields).await?;
    Ok(rows
        .into_iter()
        .map(|f| {
            let [status, error, worker, attempts, result] = <[_; 5]>::try_from(f).ok()?;
            Some(TaskRow {
                status: status?,
                error,
                worker,
                attempts,
                result,
            })
        })
        .collect())
}

fn describe(id: &str, row: Option<&TaskRow>) -> String {
    match row {
        None => format!("{id}: no task hash"),
        Some(r) => format!(
            "{id}: {} attempts {} worker {} error {:?}",
            r.status,
            r.attempts.as_deref().unwrap_or("-"),
            r.worker.as_deref().unwrap_or("-"),
            r.error.as_deref().unwrap_or("")
        ),
    }
}

/// How many of `requests` carried an Idempotency-Key that an earlier one
/// had carried already: repeats the service answered from what it stored.
fn replays(requests: &[Recorded]) -> usize {
    let mut keys = HashSet::new();
    requests
        .iter()
        .filter_map(|r| r.idempotency_key.as_deref())
        .filter(|k| !keys.insert(*k))
        .count()
}

/// The pid in a consumer name `<pid>-<uuid>`.
fn consumer_pid(worker: &str) -> Option<u32> {
    worker.split('-').next()?.parse().ok()
}

// ---------------------------------------------------------------------------
// The test

#[tokio::test(flavor = "multi_thread")]
async fn chaos_loses_and_doubles_nothing() -> Result<()> {
    let settings = Settings::from_env("DTQ_CHAOS", ("TASKS", 4_000), 60, 180)?;
    eprintln!(
        "chaos: seed {} (DTQ_CHAOS_SEED={} replays it): {} submissions over {} s, {} workers, \
         a kill every ~{} ms, {} Redis restarts",
        settings.seed,
        settings.seed,
        settings.size,
        settings.secs,
        WORKERS,
        settings.kill_ms,
        settings.redis_restarts
    );
    // The services `send_receipt` calls, in this process: they outlive
    // every worker.
    let payments = Service::start()?;
    let email_service = Service::start()?;
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let services = Services {
        payment_url: payments.url(),
        email_url: email_service.url(),
    };
    let (planned, orders) = plan(&settings, &mut rng, &services);
    let chaos_rng = StdRng::seed_from_u64(rng.random());

    let dir = TempDir::new("chaos")?;
    let redis = PersistentRedis::start(REDIS_PERSISTENCE)?;
    let t_setup = Instant::now();
    let servers = Servers {
        bin: DTQ,
        redis_url: redis.url(),
        flags: server_flags(),
        log_filter: "info".into(),
    };
    let mut api_proc = servers.start(&dir.path, "api", "api").await?;
    let mut chaos = Chaos::new("chaos", dir.path.clone(), redis, servers);
    chaos.start_workers(WORKERS).await?;
    eprintln!(
        "chaos: API and {WORKERS} workers ready in {:.1} s; payment service {}, email service \
         {}; logs in {}",
        t_setup.elapsed().as_secs_f64(),
        payments.url(),
        email_service.url(),
        dir.path.display()
    );

    let api = ApiClient::new(api_proc.api.clone());
    let planned = Arc::new(planned);
    let acks = chaos
        .run(WAVES, &settings, chaos_rng, &api, planned.clone())
        .await;
    let t0 = chaos.t0;
    let chaos_ended = t0.elapsed();

    // What was acknowledged.
    let mut task_ids: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut key_tasks: HashMap<String, HashSet<String>> = HashMap::new();
    let mut order_task: HashMap<usize, String> = HashMap::new();
    let mut never_acked = Vec::new();
    let mut retried = 0;
    let mut codes: BTreeMap<u16, usize> = BTreeMap::new();
    let mut expected_tasks = 0;
    let mut first_submission: HashSet<String> = HashSet::new();
    let (mut counters, mut sleeps) = (0, 0);
    for (p, ack) in planned.iter().zip(&acks) {
        let logical_new = match &p.key {
            Some(k) => first_submission.insert(k.clone()),
            None => true,
        };
        if logical_new {
            expected_tasks += 1;
            match p.work {
                Work::Order(_) => {}
                Work::Counter => counters += 1,
                Work::Sleep => sleeps += 1,
            }
        }
        let ack = match ack {
            Ok(ack) => ack,
            Err(e) => {
                never_acked.push(format!("{e:#}"));
                continue;
            }
        };
        *codes.entry(ack.code).or_default() += 1;
        if ack.tries > 1 {
            retried += 1;
        }
        if seen.insert(ack.task_id.clone()) {
            task_ids.push(ack.task_id.clone());
        }
        if let Some(k) = &p.key {
            key_tasks
                .entry(k.clone())
                .or_default()
                .insert(ack.task_id.clone());
        }
        if let Work::Order(o) = p.work {
            order_task.entry(o).or_insert_with(|| ack.task_id.clone());
        }
    }

    // The held-back orders never run: cancel them, while they wait.
    let mut held_tasks: HashSet<String> = HashSet::new();
    let mut cancel_answers: HashMap<String, String> = HashMap::new();
    for (o, order) in orders.iter().enumerate() {
        if let (true, Some(task)) = (order.held_back, order_task.get(&o)) {
            held_tasks.insert(task.clone());
            cancel_answers.insert(task.clone(), cancel(&api, task).await);
        }
    }

    // Wait for every acknowledged task to be terminal (Redis is up, and the
    // workers are the last three started).
    let mut conn = chaos.redis.conn().await?;
    if chaos.error.is_none() {
        let deadline = Instant::now() + Duration::from_secs(settings.drain_secs);
        wait_terminal(&mut conn, "chaos", QUEUE, &task_ids, deadline, t0).await?;
    }
    let drained = t0.elapsed();
    chaos.note_exits(&mut api_proc)?;

    // The outcome: the tasks.
    let rows = read_tasks(&mut conn, &task_ids).await?;
    let row_of: HashMap<&str, Option<&TaskRow>> = task_ids
        .iter()
        .zip(&rows)
        .map(|(id, r)| (id.as_str(), r.as_ref()))
        .collect();

    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    let mut other_status: BTreeMap<String, usize> = BTreeMap::new();
    let (mut lost, mut stuck, mut live_lost, mut other) = (vec![], vec![], vec![], vec![]);
    let (mut held_unrun, mut held_off) = (0, vec![]);
    let mut max_attempts_seen = 0u32;
    let mut retried_tasks = 0;
    for (id, row) in task_ids.iter().zip(&rows) {
        let held = held_tasks.contains(id);
        let Some(row) = row else {
            lost.push(describe(id, None));
            continue;
        };
        *by_status.entry(row.status.clone()).or_default() += 1;
        let attempts = row.attempts();
        max_attempts_seen = max_attempts_seen.max(attempts);
        if attempts > 1 {
            retried_tasks += 1;
        }
        if held {
            if row.status == "CANCELLED" && attempts == 0 {
                held_unrun += 1;
            } else {
                held_off.push(format!(
                    "{}; cancel answered {}",
                    describe(id, Some(row)),
                    cancel_answers.get(id).map_or("-", String::as_str)
                ));
            }
        }
        if !row.is_terminal() {
            stuck.push(describe(id, Some(row)));
        } else if row.status != "SUCCEEDED" && !held {
            *other_status.entry(row.status.clone()).or_default() += 1;
            other.push(describe(id, Some(row)));
        }
        let lost_worker = row.status == "DEAD_LETTERED"
            && row
                .error
                .as_deref()
                .is_some_and(|e| e.starts_with("worker lost"));
        let by_killed = row
            .worker
            .as_deref()
            .and_then(consumer_pid)
            .is_some_and(|pid| chaos.killed.contains(&pid));
        if lost_worker && !by_killed {
            live_lost.push(describe(id, Some(row)));
        }
    }

    // The outcome: what the payment and email services recorded.
    let charges = payments.charges();
    let charge_requests = payments.requests_to("/charges");
    let emails = email_service.emails();
    let email_requests = email_service.requests_to("/emails");
    let planned_orders: HashSet<&str> = orders.iter().map(|o| o.id.as_str()).collect();
    let mut charges_of: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut unknown_effects = Vec::new();
    for c in &charges {
        charges_of
            .entry(c.order_id.as_str())
            .or_default()
            .push(c.charge_id.as_str());
        if !planned_orders.contains(c.order_id.as_str()) {
            unknown_effects.push(format!("charge {c:?} of an order never planned"));
        }
    }
    let mut emails_of: HashMap<&str, Vec<&Value>> = HashMap::new();
    for e in &emails {
        let order = e.body["order_id"].as_str().unwrap_or("?");
        emails_of.entry(order).or_default().push(&e.body);
        if !planned_orders.contains(order) {
            unknown_effects.push(format!("email {} of an order never planned", e.body));
        }
    }
    // The Idempotency-Keys each order's charge requests carried.
    let mut keys_of: HashMap<String, Vec<Option<String>>> = HashMap::new();
    for r in &charge_requests {
        let order = serde_json::from_str::<Value>(&r.body)
            .ok()
            .and_then(|b| b["order_id"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "?".into());
        keys_of
            .entry(order)
            .or_default()
            .push(r.idempotency_key.clone());
    }

    let (mut succeeded_orders, mut charged_once) = (0, 0);
    let (mut not_once, mut twice, mut unrun_effects) = (vec![], vec![], vec![]);
    let (mut wrong_result, mut key_off, mut email_off) = (vec![], vec![], vec![]);
    let mut unrun_orders = 0;
    for (o, order) in orders.iter().enumerate() {
        let id = order.id.as_str();
        let order_charges = charges_of.get(id).map_or(&[][..], Vec::as_slice);
        let order_emails = emails_of.get(id).map_or(&[][..], Vec::as_slice);
        let Some(task) = order_task.get(&o) else {
            // Never acknowledged (a figure of its own): whether it ran is
            // not known.
            continue;
        };
        let row = row_of.get(task.as_str()).copied().flatten();
        let line = |what: &str| format!("order {id}: {what}; task {}", describe(task, row));
        if order_charges.len() > 1 {
            twice.push(line(&format!("charges {order_charges:?}")));
        }
        if let Some(keys) = keys_of.get(id) {
            let distinct: HashSet<&Option<String>> = keys.iter().collect();
            if distinct.len() != 1 || distinct.contains(&None) {
                key_off.push(line(&format!("charge requests' keys {keys:?}")));
            }
        }
        let ran = row.is_some_and(|r| r.attempts() > 0);
        if !ran {
            unrun_orders += 1;
            if !order_charges.is_empty() || !order_emails.is_empty() {
                unrun_effects.push(line(&format!(
                    "never ran, yet charges {order_charges:?}, {} emails",
                    order_emails.len()
                )));
            }
        }
        let Some(row) = row.filter(|r| r.status == "SUCCEEDED") else {
            continue;
        };
        succeeded_orders += 1;
        if order_charges.len() == 1 {
            charged_once += 1;
        } else {
            not_once.push(line(&format!("charges {order_charges:?}")));
        }
        let result: Value = row
            .result
            .as_deref()
            .and_then(|r| serde_json::from_str(r).ok())
            .unwrap_or(Value::Null);
        let charge_id = result["charge_id"].as_str().unwrap_or("");
        if result["order_id"] != id || !order_charges.contains(&charge_id) {
            wrong_result.push(line(&format!(
                "result {result}, charges recorded {order_charges:?}"
            )));
        }
        if order_emails.len() != 1 || order_emails[0]["charge_id"] != charge_id {
            let sent: Vec<&Value> = order_emails.iter().map(|e| &e["charge_id"]).collect();
            email_off.push(line(&format!(
                "{} emails (naming charges {sent:?}), result {result}",
                order_emails.len()
            )));
        }
    }
    unrun_effects.extend(unknown_effects);
    let split_keys: Vec<String> = key_tasks
        .iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|(k, ids)| format!("key {k}: tasks {ids:?}"))
        .collect();
    let succeeded = by_status.get("SUCCEEDED").copied().unwrap_or(0);
    let other_breakdown = other_status
        .iter()
        .map(|(s, n)| format!("{s} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let charge_replays = replays(&charge_requests);
    let email_replays = replays(&email_requests);

    let figures = vec![
        Figure {
            label: "tasks submitted (acknowledged)".into(),
            value: task_ids.len(),
            expected: expected_tasks,
            note: format!(
                "{} submissions: {} answered 202, {} 200, {} 409; {} needed more than one try\n\
                 tasks: {} send_receipt orders, {counters} counter, {sleeps} sleep",
                planned.len(),
                codes.get(&202).unwrap_or(&0),
                codes.get(&200).unwrap_or(&0),
                codes.get(&409).unwrap_or(&0),
                retried,
                orders.len(),
            ),
        },
        Figure::none("submissions never acknowledged", &never_acked),
        Figure::none("idempotency keys with two tasks", &split_keys),
        Figure {
            label: "tasks succeeded".into(),
            value: succeeded,
            expected: task_ids.len() - held_tasks.len(),
            note: format!(
                "{retried_tasks} took more than one attempt, at most {max_attempts_seen}"
            ),
        },
        Figure {
            label: "held-back orders cancelled before a run".into(),
            value: held_unrun,
            expected: held_tasks.len(),
            note: format!(
                "submitted with delay_ms {HELD_BACK_DELAY_MS}, cancelled once the chaos was over\n{}",
                examples(&held_off)
            ),
        },
        Figure {
            label: "tasks in other terminal statuses".into(),
            value: other.len(),
            expected: 0,
            note: if other.is_empty() {
                String::new()
            } else {
                format!("{other_breakdown}\n{}", examples(&other))
            },
        },
        Figure::none("tasks lost (acknowledged, no record)", &lost),
        Figure::none("tasks stuck (not terminal by the deadline)", &stuck),
        Figure::none("live tasks dead-lettered as lost", &live_lost),
        Figure {
            label: "SUCCEEDED orders charged exactly once".into(),
            value: charged_once,
            expected: succeeded_orders,
            note: format!(
                "the payment service: {} charges, {} charge requests, {charge_replays} of them \
                 a key it had answered\n(a request repeated after a kill: answered with the \
                 stored charge, nothing charged)\n{}",
                charges.len(),
                charge_requests.len(),
                examples(&not_once)
            ),
        },
        Figure {
            label: "orders charged more than once".into(),
            value: twice.len(),
            expected: 0,
            note: format!("of {} orders\n{}", orders.len(), examples(&twice)),
        },
        Figure {
            label: "charges+emails of never-run/unknown orders".into(),
            value: unrun_effects.len(),
            expected: 0,
            note: format!(
                "{unrun_orders} orders never ran ({} held back)\n{}",
                held_tasks.len(),
                examples(&unrun_effects)
            ),
        },
        Figure::none("SUCCEEDED results not naming their charge", &wrong_result),
        Figure {
            label: "orders not sending one Idempotency-Key".into(),
            value: key_off.len(),
            expected: 0,
            note: format!(
                "every charge request of an order must carry the same key\n{}",
                examples(&key_off)
            ),
        },
        Figure {
            label: "SUCCEEDED orders without exactly one email".into(),
            value: email_off.len(),
            expected: 0,
            note: format!(
                "the email service: {} emails, {} email requests, {email_replays} of them a key \
                 it had answered\n{}",
                emails.len(),
                email_requests.len(),
                examples(&email_off)
            ),
        },
    ];

    // The table.
    let outages = chaos.outage_summary();
    let table = format!(
        "\nchaos: seed {}, {} workers killed (SIGKILL), Redis stopped and restarted {} times \
         ({outages}); submitted and struck for {:.0} s, drained in {:.0} s more, {:.0} s in \
         all\n\n",
        settings.seed,
        chaos.killed.len(),
        chaos.outages.len(),
        chaos_ended.as_secs_f64(),
        (drained - chaos_ended).as_secs_f64(),
        drained.as_secs_f64()
    );
    chaos.report(table, figures, 44, &api_proc, dir);
    Ok(())
}
