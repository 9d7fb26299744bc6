//! `GET /metrics` (issue 13): what a worker did shows as exact counts, the
//! queue depths are read from Redis at scrape time, labels stay bounded,
//! and the text is a well-formed OpenMetrics exposition, checked line by
//! line by the strict parser below (every sample in the family its `TYPE`
//! line opened, every histogram's buckets cumulative up to `+Inf`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_host::server::{Roles, Server};
use dtq_host::store::NewTask;
use dtq_tests::{Dtq, RedisServer, free_port, guests, sha256_hex};
use serde_json::json;
use tokio_util::sync::CancellationToken;

type Labels = BTreeMap<String, String>;

/// One metric family: its `TYPE` and `HELP`.
#[derive(Debug)]
struct Family {
    kind: String,
    help: String,
}

/// One sample line.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: Labels,
    value: f64,
}

/// A parsed exposition.
#[derive(Debug)]
struct Exposition {
    families: BTreeMap<String, Family>,
    samples: Vec<Sample>,
}

impl Exposition {
    /// The value of the sample `name` with exactly `labels`.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: Labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }

    /// [`Exposition::value`], or 0 for a series that is absent.
    fn count(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.value(name, labels).unwrap_or(0.0)
    }

    /// The samples named `name`.
    fn series(&self, name: &str) -> impl Iterator<Item = &Sample> {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// Every value label `label` takes in samples of family `family`.
    fn label_values(&self, family: &str, label: &str) -> BTreeSet<String> {
        self.samples
            .iter()
            .filter(|s| s.name.starts_with(family))
            .filter_map(|s| s.labels.get(label).cloned())
            .collect()
    }
}

/// A metric or label name: `[a-zA-Z_:][a-zA-Z0-9_:]*` (no `:` in labels).
fn check_name(name: &str, colon: bool) -> Result<()> {
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
    let ok = |c: char| ok_first(c) || c.is_ascii_digit();
    let mut chars = name.chars();
    ensure!(
        chars.next().is_some_and(ok_first) && chars.all(ok),
        "{name:?} is not a valid name"
    );
    Ok(())
}

/// Parse an OpenMetrics text exposition strictly: a `HELP` then a `TYPE`
/// (then maybe a `UNIT`) line opens each family, once; every sample line is
/// `name{label="value",...} value` of the family open, with a suffix its
/// type allows; the text ends with `# EOF`.
fn parse(text: &str) -> Result<Exposition> {
    let body = text
        .strip_suffix("# EOF\n")
        .context("the exposition does not end with `# EOF`")?;
    let mut families = BTreeMap::new();
    let mut samples = Vec::new();
    let mut help: Option<(String, String)> = None;
    let mut open: Option<(String, String)> = None;
    for (n, line) in body.split_terminator('\n').enumerate() {
        let at = || format!("line {}: {line:?}", n + 1);
        ensure!(!line.is_empty() && !line.contains('\r'), "{}", at());
        if let Some(rest) = line.strip_prefix("# ") {
            let (keyword, rest) = rest.split_once(' ').with_context(at)?;
            let (name, value) = rest.split_once(' ').with_context(at)?;
            check_name(name, true).with_context(at)?;
            ensure!(!value.is_empty(), "{}", at());
            match keyword {
                "HELP" => {
                    ensure!(help.is_none(), "two HELP lines: {}", at());
                    help = Some((name.to_owned(), value.to_owned()));
                }
                "TYPE" => {
                    let (help_of, text) =
                        help.take().with_context(|| format!("no HELP: {}", at()))?;
                    ensure!(help_of == name, "HELP of another family: {}", at());
                    ensure!(
                        ["counter", "gauge", "histogram"].contains(&value),
                        "type: {}",
                        at()
                    );
                    let family = Family {
                        kind: value.to_owned(),
                        help: text,
                    };
                    ensure!(
                        families.insert(name.to_owned(), family).is_none(),
                        "family declared twice: {}",
                        at()
                    );
                    open = Some((name.to_owned(), value.to_owned()));
                }
                "UNIT" => {
                    let (family, _) = open.as_ref().with_context(at)?;
                    ensure!(
                        family == name && name.ends_with(&format!("_{value}")),
                        "unit: {}",
                        at()
                    );
                }
                _ => bail!("unknown comment: {}", at()),
            }
            continue;
        }
        ensure!(help.is_none(), "HELP without TYPE before {}", at());
        let sample = parse_sample(line).with_context(at)?;
        let (family, kind) = open
            .as_ref()
            .with_context(|| format!("no TYPE: {}", at()))?;
        let suffix = sample
            .name
            .strip_prefix(family.as_str())
            .with_context(|| format!("not of family {family}: {}", at()))?;
        let allowed: &[&str] = match kind.as_str() {
            "counter" => &["_total", "_created"],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            _ => &[""],
        };
        ensure!(allowed.contains(&suffix), "suffix of a {kind}: {}", at());
        ensure!(
            (suffix == "_bucket") == sample.labels.contains_key("le"),
            "`le` belongs to buckets only: {}",
            at()
        );
        samples.push(sample);
    }
    ensure!(help.is_none(), "HELP without TYPE at the end");
    let exposition = Exposition { families, samples };
    check_histograms(&exposition)?;
    Ok(exposition)
}

/// `name{k="v",...} value`, with `\\`, `\"` and `\n` escapes in values.
fn parse_sample(line: &str) -> Result<Sample> {
    let name_end = line.find(['{', ' ']).context("no value")?;
    let name = &line[..name_end];
    check_name(name, true)?;
    let mut rest = &line[name_end..];
    let mut labels = Labels::new();
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            let (key, after) = inner.split_once("=\"").context("a label without =\"")?;
            check_name(key, false)?;
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next() {
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, '\\')) => value.push('\\'),
                        Some((_, '"')) => value.push('"'),
                        other => bail!("bad escape {other:?}"),
                    },
                    Some((i, '"')) => break i,
                    Some((_, c)) => value.push(c),
                    None => bail!("an unterminated label value"),
                }
            };
            ensure!(
                labels.insert(key.to_owned(), value).is_none(),
                "label {key} twice"
            );
            inner = &after[end + 1..];
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            inner = inner.strip_prefix(',').context("expected `,` or `}`")?;
        }
    }
    let value = rest
        .strip_prefix(' ')
        .context("no space before the value")?;
    ensure!(
        !value.is_empty()
            && (["+Inf", "-Inf", "NaN"].contains(&value)
                || value
                    .chars()
                    .all(|c| c.is_ascii_digit() || "+-.e".contains(c))),
        "value {value:?} (a timestamp, or not a number)"
    );
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse()?,
    };
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Each histogram series: buckets in increasing `le`, counts cumulative,
/// the last `+Inf` and equal to `_count`, and a `_sum`.
fn check_histograms(exposition: &Exposition) -> Result<()> {
    for (family, _) in exposition
        .families
        .iter()
        .filter(|(_, f)| f.kind == "histogram")
    {
        let mut series: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
        for sample in exposition.series(&format!("{family}_bucket")) {
            let mut labels = sample.labels.clone();
            let le = labels.remove("le").context("a bucket without le")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse()?
            };
            series.entry(labels).or_default().push((le, sample.value));
        }
        for (labels, buckets) in series {
            let pairs: Vec<(&str, &str)> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            for pair in buckets.windows(2) {
                ensure!(
                    pair[0].0 < pair[1].0 && pair[0].1 <= pair[1].1,
                    "{family}{labels:?}: buckets {pair:?}"
                );
            }
            let last = buckets.last().context("no bucket")?;
            let count = exposition.value(&format!("{family}_count"), &pairs);
            ensure!(
                last.0 == f64::INFINITY && count == Some(last.1),
                "{family}{labels:?}: +Inf bucket {last:?}, count {count:?}"
            );
            ensure!(
                exposition.value(&format!("{family}_sum"), &pairs).is_some(),
                "{family}{labels:?}: no _sum"
            );
        }
    }
    Ok(())
}

/// GET `url` with `token` as the bearer token: the status, the
/// `Content-Type` and the body.
async fn get(url: &str, token: Option<&str>) -> Result<(u16, String, String)> {
    let mut req = reqwest::Client::new().get(url);
    if let Some(token) = token {
        req = req.bearer_auth(token);
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Ok((status, content_type, resp.text().await?))
}

/// Scrape `url` (200, OpenMetrics) and parse it.
async fn scrape(url: &str) -> Result<(Exposition, String)> {
    let (status, content_type, text) = get(url, None).await?;
    ensure!(status == 200, "GET {url}: {status} {text}");
    ensure!(
        content_type.starts_with("application/openmetrics-text"),
        "Content-Type {content_type:?}"
    );
    let exposition = parse(&text).with_context(|| format!("the exposition:\n{text}"))?;
    Ok((exposition, text))
}

/// Scrape `url` until `ready` holds (counters move just after the writes
/// a client can see); fail after 10 s with the last text.
async fn scrape_until(
    url: &str,
    ready: impl Fn(&Exposition) -> bool,
) -> Result<(Exposition, String)> {
    let start = Instant::now();
    loop {
        let (exposition, text) = scrape(url).await?;
        if ready(&exposition) {
            return Ok((exposition, text));
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("the metrics did not get there within 10 s:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const OUTCOMES: &str = "dtq_attempt_outcomes_total";

/// A task written to Redis directly, past the API's check of its name.
fn raw_task(queue: &str, task: &str) -> NewTask {
    let now = dtq_host::base::now_ms();
    NewTask {
        id: uuid::Uuid::now_v7().to_string(),
        queue: queue.into(),
        task: task.into(),
        payload: "{}".into(),
        fingerprint: "test".into(),
        idempotency_key: None,
        max_attempts: 3,
        timeout_ms: None,
        now,
        run_at: now,
        expires_at: None,
        group: None,
        traceparent: None,
        parent: None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_metrics_count_what_the_worker_did_and_read_the_queues() -> Result<()> {
    let dtq = Dtq::start(true, &["--task-timeout-ms", "300"]).await?;
    let url = format!("{}/metrics", dtq.api);
    let wait = Duration::from_secs(30);

    // Three successes, a retry then a success, a fatal failure (a payload
    // that does not parse), and a deadline trap twice, then the DLQ.
    let mut ids = Vec::new();
    for n in 0..3 {
        let body = json!({"task": "echo", "payload": {"n": n}});
        ids.push(dtq.submit_new("default", body, None).await?);
    }
    let flaky = json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 3});
    ids.push(dtq.submit_new("default", flaky, None).await?);
    let fatal = json!({"task": "flaky", "payload": {"no": "such field"}});
    ids.push(dtq.submit_new("default", fatal, None).await?);
    let slow = json!({"task": "sleep", "payload": {"ms": 5000}, "max_attempts": 2});
    let slow = dtq.submit_new("default", slow, None).await?;
    for id in &ids {
        dtq.wait_for("default", id, &["SUCCEEDED", "FAILED"], wait)
            .await?;
    }
    dtq.wait_for("default", &slow, &["DEAD_LETTERED"], wait)
        .await?;

    // A queue no worker reads: two ready, one delayed.
    for delay_ms in [0, 0, 600_000] {
        let body = json!({"task": "echo", "payload": {}, "delay_ms": delay_ms});
        dtq.submit_new("idle", body, None).await?;
    }

    // A task name nobody knows: refused by the API; written to Redis
    // anyway, a worker defers it, counted under `other`.
    let (status, body) = dtq
        .submit(
            "default",
            json!({"task": "no_such_task", "payload": {}}),
            None,
        )
        .await?;
    ensure!(status == 400, "{status} {body}");
    let mut unknown = raw_task("default", "no_such_task");
    dtq.store.submit(&mut unknown, 0).await?;
    let other_deferred = [
        ("queue", "default"),
        ("task", "other"),
        ("outcome", "deferred"),
    ];
    scrape_until(&url, |m| m.count(OUTCOMES, &other_deferred) >= 1.0).await?;
    let (status, body) = dtq
        .call(
            reqwest::Method::POST,
            &format!("/v1/queues/default/tasks/{}/cancel", unknown.id),
            None,
            &[],
        )
        .await?;
    ensure!(status == 200 || status == 202, "cancel: {status} {body}");
    dtq.wait_for("default", &unknown.id, &["CANCELLED"], wait)
        .await?;

    // Every known task's completions are counted.
    let known = |m: &Exposition| {
        m.series(OUTCOMES)
            .filter(|s| s.labels["task"] != "other")
            .map(|s| s.value)
            .sum::<f64>()
    };
    let (m, text) = scrape_until(&url, |m| known(m) >= 8.0).await?;
    let outcome = |task: &str, outcome: &str| {
        m.count(
            OUTCOMES,
            &[("queue", "default"), ("task", task), ("outcome", outcome)],
        )
    };
    let expected = [
        ("echo", "success", 3.0),
        ("flaky", "retry", 1.0),
        ("flaky", "success", 1.0),
        ("flaky", "fatal", 1.0),
        ("sleep", "retry", 1.0),
        ("sleep", "dead_lettered", 1.0),
    ];
    for (task, name, n) in expected {
        ensure!(outcome(task, name) == n, "{task} {name}: {text}");
    }
    ensure!(known(&m) == 8.0, "more completions than ran: {text}");
    ensure!(outcome("other", "deferred") >= 1.0, "{text}");

    // The task label takes only known names; the unknown one is `other`.
    ensure!(!text.contains("no_such_task"), "{text}");
    let tasks = m.label_values("dtq_attempt", "task");
    let allowed: BTreeSet<String> = ["echo", "flaky", "sleep", "other"].map(String::from).into();
    ensure!(tasks.is_subset(&allowed), "task labels {tasks:?}");

    // One duration per handler call; each of sleep's ran to the 300 ms
    // deadline.
    let durations = |task: &str, suffix: &str, le: Option<&str>| {
        let mut labels = vec![("queue", "default"), ("task", task)];
        labels.extend(le.map(|le| ("le", le)));
        m.value(&format!("dtq_attempt_duration_seconds{suffix}"), &labels)
    };
    ensure!(durations("echo", "_count", None) == Some(3.0), "{text}");
    ensure!(durations("flaky", "_count", None) == Some(3.0), "{text}");
    ensure!(durations("sleep", "_count", None) == Some(2.0), "{text}");
    ensure!(
        durations("sleep", "_bucket", Some("0.25")) == Some(0.0),
        "{text}"
    );
    ensure!(
        durations("sleep", "_bucket", Some("+Inf")) == Some(2.0),
        "{text}"
    );
    ensure!(
        durations("sleep", "_sum", None).is_some_and(|s| s >= 0.6),
        "{text}"
    );
    ensure!(
        durations("echo", "_bucket", Some("0.001")).is_some(),
        "the buckets start at 1 ms: {text}"
    );
    ensure!(
        durations("echo", "_bucket", Some("60.0")).is_some(),
        "the buckets end at 60 s: {text}"
    );

    // Two deadline traps, and every class is there from the start.
    for class in [
        "deadline",
        "out_of_memory",
        "stack_overflow",
        "panic",
        "limit",
        "cancelled",
        "other",
    ] {
        let n = if class == "deadline" { 2.0 } else { 0.0 };
        let value = m.value("dtq_sandbox_traps_total", &[("class", class)]);
        ensure!(value == Some(n), "{class}: {value:?}\n{text}");
    }

    ensure!(
        m.value("dtq_worker_tasks_in_flight", &[]) == Some(0.0),
        "{text}"
    );
    ensure!(m.value("dtq_worker_slots", &[]) == Some(4.0), "{text}");

    // Each loaded handler with the digest of its module.
    let info: BTreeMap<String, String> = m
        .series("dtq_handler_info")
        .map(|s| {
            ensure!(s.value == 1.0, "{s:?}");
            Ok((s.labels["task"].clone(), s.labels["digest"].clone()))
        })
        .collect::<Result<_>>()?;
    ensure!(info == dtq.sandbox.loaded(), "{info:?}");
    // How the worker's pool slots are reset: one mode, the sandbox's.
    let modes: Vec<(String, f64)> = m
        .series("dtq_sandbox_slot_reset")
        .map(|s| (s.labels["mode"].clone(), s.value))
        .collect();
    ensure!(
        modes == [(dtq.sandbox.slot_reset().as_str().to_owned(), 1.0)],
        "{modes:?}\n{text}"
    );
    let echo_wasm = std::fs::read(format!("{}/echo.wasm", guests::EXAMPLES_DIR))?;
    ensure!(
        info.get("echo") == Some(&sha256_hex(&echo_wasm)),
        "{info:?}"
    );

    // The depths, read from Redis for this scrape.
    ensure!(m.value("dtq_redis_up", &[]) == Some(1.0), "{text}");
    let depth = |queue: &str, state: &str| {
        m.value("dtq_queue_depth", &[("queue", queue), ("state", state)])
    };
    for (queue, state, n) in [
        ("default", "ready", 0.0),
        ("default", "running", 0.0),
        ("default", "delayed", 0.0),
        ("default", "dead_lettered", 1.0),
        ("idle", "ready", 2.0),
        ("idle", "running", 0.0),
        ("idle", "delayed", 1.0),
        ("idle", "dead_lettered", 0.0),
    ] {
        ensure!(depth(queue, state) == Some(n), "{queue} {state}: {text}");
    }
    let queues = m.label_values("dtq_queue_depth", "queue");
    ensure!(
        queues == ["default", "idle"].map(String::from).into(),
        "{queues:?}"
    );

    // Redis round trips: every submission that reached the store (the six
    // above, the three to `idle`, and the raw one) is one `submit`.
    let trips = |operation: &str| {
        m.value(
            "dtq_redis_round_trip_seconds_count",
            &[("operation", operation)],
        )
    };
    ensure!(trips("submit") == Some(10.0), "{text}");
    for operation in ["start", "complete", "heartbeat", "queues", "stats"] {
        ensure!(
            trips(operation).is_some_and(|n| n >= 1.0),
            "{operation}: {text}"
        );
    }

    // Every family is dtq's and has its help.
    for (name, family) in &m.families {
        ensure!(name.starts_with("dtq_"), "{name}");
        ensure!(family.help.len() > 20, "{name}: {:?}", family.help);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_need_the_read_scope_on_every_queue() -> Result<()> {
    let read_all = "read-all-4b1d6a0f2c9e8d7b5a3f1e0c9d8b7a6f";
    let read_one = "read-one-9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b";
    let submit = "submit-1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d";
    let tokens = format!("{read_all} read *;{read_one} read default;{submit} submit");
    let dtq = Dtq::start(false, &["--tokens", &tokens]).await?;
    let url = format!("{}/metrics", dtq.api);
    for (token, status) in [
        (None, 401),
        (Some(submit), 403),
        (Some(read_one), 403),
        (Some(read_all), 200),
    ] {
        let (got, _, text) = get(&url, token).await?;
        ensure!(got == status, "{token:?}: {got} {text}");
        if status == 200 {
            parse(&text)?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_without_the_api_serves_its_metrics_on_metrics_listen() -> Result<()> {
    let redis = RedisServer::start()?;
    let port = free_port()?;
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    let listen = format!("127.0.0.1:{port}");
    let config = dtq_host::Config::from_args([
        "--redis",
        &redis.url(),
        "--handlers",
        guests::EXAMPLES_DIR,
        "--concurrency",
        "3",
        "--metrics-listen",
        &listen,
        "--cache-dir",
        &cache.display().to_string(),
    ])?;
    let server = Server::prepare(config, Roles::WORKER).await?;
    let store = server.store().clone();
    let stop = CancellationToken::new();
    let run = tokio::spawn(server.serve(None, stop.clone().cancelled_owned()));

    let url = format!("http://{listen}/metrics");
    let start = Instant::now();
    while get(&url, None).await.is_err() {
        ensure!(
            start.elapsed() < Duration::from_secs(10),
            "{url} never answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut task = raw_task("default", "echo");
    store.submit(&mut task, 0).await?;
    let success = [
        ("queue", "default"),
        ("task", "echo"),
        ("outcome", "success"),
    ];
    let (m, text) = scrape_until(&url, |m| m.count(OUTCOMES, &success) == 1.0).await?;
    ensure!(m.value("dtq_worker_slots", &[]) == Some(3.0), "{text}");
    ensure!(m.value("dtq_redis_up", &[]) == Some(1.0), "{text}");
    ensure!(
        m.series("dtq_handler_info")
            .any(|s| s.labels["task"] == "echo"),
        "{text}"
    );

    // It serves nothing else.
    let (status, _, body) = get(&format!("http://{listen}/v1/queues"), None).await?;
    ensure!(
        status == 404 && body.contains("NOT_FOUND"),
        "{status} {body}"
    );

    stop.cancel();
    run.await??;
    ensure!(get(&url, None).await.is_err(), "still listening after stop");
    Ok(())
}
