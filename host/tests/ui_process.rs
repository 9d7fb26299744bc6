//! The web dashboard (`/ui`) as an operator uses it: a real `dtq serve`
//! (API and worker, the example handlers) on a real `redis-server`, and a
//! real headless Chromium driven through chromedriver (WebDriver).
//!
//! Chromium and chromedriver are Debian's `chromium` and `chromium-driver`,
//! which `scripts/setup` installs; without them the browser test fails and
//! says so (set `DTQ_CHROMIUM` / `DTQ_CHROMEDRIVER` to use others).
//!
//! The browser test saves screenshots of the pages it visits to
//! `$CARGO_TARGET_TMPDIR/dashboard-<page>.png`, and the queues page to
//! `$DTQ_UI_SCREENSHOT` instead when that is set (relative to the
//! workspace root): the README's
//! `docs/dashboard.png` is made with
//! `DTQ_UI_SCREENSHOT=docs/dashboard.png cargo test -p dtq-host --test ui_process`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dtq_tests::process::{DtqProcess, dtq_command};
use dtq_tests::{ApiClient, RedisServer, TempDir, assert_error, free_port, guests};
use fantoccini::{Client, ClientBuilder, Locator};
use reqwest::Method;
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The admin token of the server under test.
const ADMIN: &str = "ui-test-admin-token-5d1f0c9e7a3b";

/// How long a server may take to answer `/healthz` (it may compile the
/// handlers when the artifact cache is cold).
const STARTUP: Duration = Duration::from_secs(120);

/// Longest wait for anything to show, in the page or through the API.
const WAIT: Duration = Duration::from_secs(30);

/// Start `dtq serve` (API and worker) with `--admin-token`, `env` and the
/// further flags `args`.
async fn serve(
    redis: &RedisServer,
    dir: &TempDir,
    env: &[(&str, &str)],
    args: &[&str],
) -> Result<DtqProcess> {
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    let mut last = None;
    // A port free when probed may be taken before the server binds it.
    for attempt in 0..3 {
        let port = free_port()?;
        let mut cmd = dtq_command(DTQ);
        cmd.arg("serve")
            .args(["--redis", &redis.url()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-token", ADMIN])
            .args(["--retry-base-ms", "20", "--retry-max-ms", "100"])
            .arg("--handlers")
            .arg(guests::EXAMPLES_DIR)
            .arg("--cache-dir")
            .arg(&cache)
            .args(args)
            .envs(env.iter().copied());
        let log = dir.path.join(format!("serve-{attempt}.log"));
        let api = format!("http://127.0.0.1:{port}");
        let mut proc = DtqProcess::spawn("serve", cmd, log, api)?;
        match proc.wait_healthy(STARTUP).await {
            Ok(()) => return Ok(proc),
            Err(e) if proc.log_text().contains("cannot listen") => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("serve did not start")))
}

/// The static routes need no token even where every API route does, and
/// carry the strict headers; the idempotency-key lookup is a `read` route
/// with its own errors.
#[tokio::test(flavor = "multi_thread")]
async fn assets_are_served_with_strict_headers_and_keys_are_looked_up() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("ui-assets")?;
    let server = serve(
        &redis,
        &dir,
        &[("DTQ_TOKENS", "reader read; submitter submit")],
        &[],
    )
    .await?;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let base = &server.api;

    let resp = http.get(format!("{base}/ui")).send().await?;
    assert_eq!(resp.status(), 308);
    assert_eq!(header(&resp, "location"), "ui/");

    let resp = http.get(format!("{base}/ui/")).send().await?;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "content-type"), "text/html; charset=utf-8");
    let csp = header(&resp, "content-security-policy");
    assert!(csp.starts_with("default-src 'self';"), "{csp}");
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    assert_eq!(header(&resp, "x-content-type-options"), "nosniff");
    assert_eq!(header(&resp, "cache-control"), "no-cache");
    let etag = header(&resp, "etag");
    assert!(
        resp.text()
            .await?
            .contains("<script type=\"module\" src=\"app.js\">")
    );

    // A browser's copy that is current is not sent again.
    let resp = http
        .get(format!("{base}/ui/"))
        .header("if-none-match", &etag)
        .send()
        .await?;
    assert_eq!(resp.status(), 304);

    for (file, content_type) in [
        ("app.js", "text/javascript; charset=utf-8"),
        ("pages.js", "text/javascript; charset=utf-8"),
        ("style.css", "text/css; charset=utf-8"),
        ("favicon.svg", "image/svg+xml"),
    ] {
        let resp = http.get(format!("{base}/ui/{file}")).send().await?;
        assert_eq!(resp.status(), 200, "{file}");
        assert_eq!(header(&resp, "content-type"), content_type, "{file}");
        assert_eq!(header(&resp, "x-content-type-options"), "nosniff");
    }
    let resp = http.get(format!("{base}/ui/secrets.txt")).send().await?;
    assert_eq!(resp.status(), 404);
    let body: Value = resp.json().await?;
    assert_eq!(body["error"]["code"], "NOT_FOUND", "{body}");
    // The data is not static: without a token it is refused.
    let resp = http.get(format!("{base}/v1/queues")).send().await?;
    assert_eq!(resp.status(), 401);

    // The lookup: a key with a `/` (percent-encoded in the path).
    let api = ApiClient::new(base.clone());
    let reader = [("Authorization", "Bearer reader")];
    let key = "order/42";
    let (status, body) = api
        .call(
            Method::POST,
            "/v1/queues/default/tasks",
            Some(json!({"task": "echo", "payload": {"n": 42}})),
            &[
                ("Authorization", "Bearer submitter"),
                ("Idempotency-Key", key),
            ],
        )
        .await?;
    assert_eq!(status, 202, "{body}");
    let id = body["task_id"].as_str().context("task_id")?.to_owned();
    let path = "/v1/queues/default/idempotency/order%2F42";
    let start = Instant::now();
    loop {
        let (status, body) = api.call(Method::GET, path, None, &reader).await?;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["task_id"], id.as_str(), "{body}");
        assert_eq!(body["key"], key, "{body}");
        if body["state"] == "completed" {
            break;
        }
        assert_eq!(body["state"], "processing", "{body}");
        ensure!(
            start.elapsed() < WAIT,
            "the key's task did not complete: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let unknown = api
        .call(
            Method::GET,
            "/v1/queues/default/idempotency/never-used",
            None,
            &reader,
        )
        .await?;
    assert_error(&unknown, 404, "UNKNOWN_KEY");
    // The same key in another queue is another key.
    let other = api
        .call(
            Method::GET,
            "/v1/queues/other/idempotency/order%2F42",
            None,
            &reader,
        )
        .await?;
    assert_error(&other, 404, "UNKNOWN_KEY");
    let long = format!("/v1/queues/default/idempotency/{}", "k".repeat(256));
    let too_long = api.call(Method::GET, &long, None, &reader).await?;
    assert_error(&too_long, 400, "INVALID_IDEMPOTENCY_KEY");
    // `read`, not any token.
    let submitter = api
        .call(
            Method::GET,
            path,
            None,
            &[("Authorization", "Bearer submitter")],
        )
        .await?;
    assert_error(&submitter, 403, "FORBIDDEN");
    let nobody = api.call(Method::GET, path, None, &[]).await?;
    assert_error(&nobody, 401, "UNAUTHORIZED");
    Ok(())
}

fn header(resp: &reqwest::Response, name: &str) -> String {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The dashboard in Chromium: the queues page lists the queue with its
/// counts and a throughput chart from the live events; a task shows in
/// the task list and on its page (payload, result), is found by its
/// idempotency key; a dead-lettered task shows on the DLQ page, where
/// Requeue is refused without a token (the error shown plainly) and
/// requeues it with the admin token typed into the page; selected dead
/// letters are requeued at once, and Purge all empties the DLQ once
/// confirmed; the handlers page lists the worker's handlers.
#[tokio::test(flavor = "multi_thread")]
async fn the_dashboard_shows_queues_and_tasks_and_handles_dead_letters() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("ui-browser")?;
    let server = serve(&redis, &dir, &[], &[]).await?;
    let api = ApiClient::new(server.api.clone());

    // Some finished work, so the counts and the chart have something.
    let echo = api
        .submit_new(
            "default",
            json!({"task": "echo", "payload": {"greeting": "hello from the dashboard test"}}),
            Some("ui-echo-1"),
        )
        .await?;
    for round in 0..10 {
        for n in 0..3 {
            api.submit_new(
                "default",
                json!({"task": "echo", "payload": {"round": round, "n": n}}),
                None,
            )
            .await?;
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    api.wait_for("default", &echo, &["SUCCEEDED"], WAIT).await?;
    let dead = dead_letter(&api).await?;

    let driver = ChromeDriver::start(&dir)?;
    let browser = driver.session(&dir).await?;
    let result = drive(&browser, &server.api, &api, &echo, &dead).await;
    // The session ends however the test went, so Chromium exits.
    let closed = browser.close().await;
    result?;
    closed?;
    Ok(())
}

async fn drive(b: &Client, base: &str, api: &ApiClient, echo: &str, dead: &str) -> Result<()> {
    // Queues: the row with its counts, and the chart filled from the
    // events stream (opened with `?since=` five minutes back).
    b.goto(&format!("{base}/ui")).await?;
    let row = "#queues tr[data-queue='default']";
    wait_text(b, &format!("{row} th a"), |t| t == "default").await?;
    wait_text(b, &format!("{row} td[data-count='dead_lettered']"), |t| {
        t == "1"
    })
    .await?;
    wait_text(b, &format!("{row} td[data-count='ready']"), |t| t == "0").await?;
    wait_text(b, &format!("{row} td[data-count='waiting']"), |t| t == "0").await?;
    wait_text(b, "#stream-state", |t| t == "live").await?;
    let caption = wait_text(b, ".chart figcaption", |t| t.contains("32 completed")).await?;
    ensure!(caption.contains("1 not succeeded"), "{caption}");
    save_screenshot(b, "queues").await?;

    // Tasks: the echo task in the list, then its page.
    b.find(Locator::Css(&format!("{row} th a")))
        .await?
        .click()
        .await?;
    let link = format!("#tasks a[data-task-id='{echo}']");
    wait_text(b, &link, |t| t == echo).await?;
    b.find(Locator::Css(&link)).await?.click().await?;
    wait_text(b, "#task-status", |t| t.starts_with("SUCCEEDED")).await?;
    let payload = wait_text(b, "#payload", |t| {
        t.contains("hello from the dashboard test")
    })
    .await?;
    ensure!(payload.contains("\"greeting\""), "{payload}");
    wait_text(b, "#result", |t| {
        t.contains("hello from the dashboard test")
    })
    .await?;
    save_screenshot(b, "task").await?;
    ensure!(
        b.find_all(Locator::Css("#cancel")).await?.is_empty(),
        "a finished task offers Cancel"
    );

    // Search by idempotency key: back to the list, type the key, land on
    // the task.
    b.goto(&format!("{base}/ui/#/queues/default/tasks")).await?;
    let search = b
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#search"))
        .await?;
    search.send_keys("ui-echo-1").await?;
    b.find(Locator::Css("form[role='search'] button"))
        .await?
        .click()
        .await?;
    wait_text(b, "main h1", |t| t == format!("Task {echo}")).await?;

    // DLQ: Requeue without a token is refused, and the page says why.
    b.goto(&format!("{base}/ui/#/queues/default/dlq")).await?;
    let requeue = format!("#dlq tr[data-task-id='{dead}'] button.requeue");
    wait_text(b, &requeue, |t| t == "Requeue").await?;
    b.find(Locator::Css(&requeue)).await?.click().await?;
    wait_text(b, "#notice", |t| t.contains("UNAUTHORIZED")).await?;
    save_screenshot(b, "dlq").await?;
    ensure!(dlq_ids(api).await?.contains(&dead.to_owned()));

    // With the admin token typed into the page, it is requeued.
    let field = b.find(Locator::Css("#token")).await?;
    field.send_keys(ADMIN).await?;
    b.find(Locator::Css("#token-form button[type='submit']"))
        .await?
        .click()
        .await?;
    wait_text(b, "#token-state", |t| t.contains("token set")).await?;
    wait_text(b, &requeue, |t| t == "Requeue").await?;
    b.find(Locator::Css(&requeue)).await?.click().await?;
    wait_text(b, "#dlq-status", |t| t == format!("Requeued {dead}.")).await?;
    // Through the API: it left the DLQ, and its second attempt succeeded.
    let done = api.wait_for("default", dead, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(done["attempts"], 2, "{done:#}");
    ensure!(!dlq_ids(api).await?.contains(&dead.to_owned()));
    wait_text(b, "#dlq tbody", |t| t.contains("No dead-lettered task")).await?;

    // Bulk: two more dead letters, selected with the header's box and
    // requeued at once.
    let more = [dead_letter(api).await?, dead_letter(api).await?];
    b.refresh().await?;
    for id in &more {
        wait_text(b, &format!("#dlq tr[data-task-id='{id}'] td"), |_| true).await?;
    }
    b.find(Locator::Css("#select-all")).await?.click().await?;
    b.find(Locator::Css("#requeue-selected"))
        .await?
        .click()
        .await?;
    wait_text(b, "#dlq-status", |t| t == "Requeued 2.").await?;
    for id in &more {
        api.wait_for("default", id, &["SUCCEEDED"], WAIT).await?;
    }
    ensure!(dlq_ids(api).await?.is_empty());

    // Purge all, once confirmed.
    let purged = dead_letter(api).await?;
    b.refresh().await?;
    wait_text(b, &format!("#dlq tr[data-task-id='{purged}'] td"), |_| true).await?;
    b.find(Locator::Css("#purge-all")).await?.click().await?;
    b.accept_alert().await?;
    wait_text(b, "#dlq-status", |t| t == "Purged 1.").await?;
    ensure!(dlq_ids(api).await?.is_empty());

    pause_and_resume(b, base, api).await?;

    // Handlers: the worker and what it loaded from its directory.
    b.find(Locator::Css("a[data-nav='handlers']"))
        .await?
        .click()
        .await?;
    wait_text(b, "#workers tbody", |t| {
        t.contains("echo") && t.contains("flaky")
    })
    .await?;
    save_screenshot(b, "handlers").await?;
    Ok(())
}

/// The queue page's pause button (the admin token is set): pausing holds
/// a new task, the queues page says so, and resuming runs it.
async fn pause_and_resume(b: &Client, base: &str, api: &ApiClient) -> Result<()> {
    b.goto(&format!("{base}/ui/#/queues/default/tasks")).await?;
    wait_text(b, "#queue-state", |t| t.starts_with("Running")).await?;
    wait_text(b, "#pause-toggle", |t| t == "Pause").await?;
    b.find(Locator::Css("#pause-toggle")).await?.click().await?;
    wait_text(b, "#queue-state", |t| t.starts_with("Paused")).await?;
    wait_text(b, "#pause-toggle", |t| t == "Resume").await?;
    let (status, queue) = api
        .call(Method::GET, "/v1/queues/default", None, &[])
        .await?;
    ensure!(status == 200 && queue["paused"] == true, "{queue}");
    // Held while paused (the worker learns of the pause within a poll).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let held = api
        .submit_new("default", json!({"task": "echo", "payload": "held"}), None)
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, task) = api
        .call(
            Method::GET,
            &format!("/v1/queues/default/tasks/{held}"),
            None,
            &[],
        )
        .await?;
    ensure!(
        task["status"] == "QUEUED",
        "a paused queue started a task: {task}"
    );
    b.goto(&format!("{base}/ui")).await?;
    wait_text(b, "#queues tr[data-queue='default'] td[data-state]", |t| {
        t == "paused"
    })
    .await?;
    save_screenshot(b, "paused").await?;
    b.goto(&format!("{base}/ui/#/queues/default/tasks")).await?;
    wait_text(b, "#pause-toggle", |t| t == "Resume").await?;
    b.find(Locator::Css("#pause-toggle")).await?.click().await?;
    wait_text(b, "#queue-state", |t| t.starts_with("Running")).await?;
    api.wait_for("default", &held, &["SUCCEEDED"], WAIT).await?;
    Ok(())
}

/// Flows in Chromium: a `fan_out` parent's page lists its `square`
/// children in a tree (each with its status and a link to its page, with
/// the counts above them), a child expands to read its own children, and
/// a child's page links back to its parent. A parent whose children go to
/// a queue no worker consumes shows WAITING, on its page (its children
/// QUEUED), in the task list filtered by WAITING and in the queue's recent
/// events; cancelling it says how many children went with it.
#[tokio::test(flavor = "multi_thread")]
async fn the_task_page_shows_a_flow_as_a_tree() -> Result<()> {
    let redis = RedisServer::start()?;
    let dir = TempDir::new("ui-flows")?;
    let grants = [
        "--submit-to",
        "fan_out=default:square",
        "--submit-to",
        "fan_out=nowhere:square",
    ];
    let server = serve(&redis, &dir, &[], &grants).await?;
    let api = ApiClient::new(server.api.clone());

    let numbers = json!({"numbers": [1, 2, 3, 4], "queue": "default"});
    let done = api
        .submit_new(
            "default",
            json!({"task": "fan_out", "payload": numbers}),
            None,
        )
        .await?;
    let record = api.wait_for("default", &done, &["SUCCEEDED"], WAIT).await?;
    assert_eq!(
        record["result"],
        json!({"sum_of_squares": 30}),
        "{record:#}"
    );
    let children = child_ids(&record)?;
    ensure!(children.len() == 4, "{record:#}");

    // Its children go where no worker takes them: it waits.
    let nowhere = json!({"numbers": [5, 6], "queue": "nowhere"});
    let waiting = api
        .submit_new(
            "default",
            json!({"task": "fan_out", "payload": nowhere}),
            None,
        )
        .await?;
    let start = Instant::now();
    let parked = loop {
        let t = api.task("default", &waiting).await?;
        if t["status"] == "WAITING" && t["children"].as_array().is_some_and(|c| c.len() == 2) {
            break t;
        }
        ensure!(start.elapsed() < WAIT, "the parent did not wait: {t:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let parked_children = child_ids(&parked)?;

    let driver = ChromeDriver::start(&dir)?;
    let browser = driver.session(&dir).await?;
    let result = drive_flows(
        &browser,
        &server.api,
        &api,
        (&done, &children),
        (&waiting, &parked_children),
    )
    .await;
    let closed = browser.close().await;
    result?;
    closed?;
    Ok(())
}

async fn drive_flows(
    b: &Client,
    base: &str,
    api: &ApiClient,
    (done, children): (&str, &[String]),
    (waiting, parked): (&str, &[String]),
) -> Result<()> {
    // The finished parent: its children in submission order, each
    // SUCCEEDED, a `square` of `default`, linked to its page.
    b.goto(&format!("{base}/ui/#/queues/default/tasks/{done}"))
        .await?;
    wait_text(b, "#task-status", |t| t.starts_with("SUCCEEDED")).await?;
    wait_text(b, "#children .children-summary", |t| {
        t == "4 children: 4 SUCCEEDED"
    })
    .await?;
    let top = "#children > .children > ul.tree > li.child";
    let mut shown = Vec::new();
    for row in b.find_all(Locator::Css(top)).await? {
        shown.push(row.attr("data-task-id").await?.unwrap_or_default());
    }
    ensure!(shown == children, "rows {shown:?}, children {children:?}");
    for id in children {
        let row = format!("{top}[data-task-id='{id}']");
        let text = wait_text(b, &format!("{row} > .node"), |t| t.contains("SUCCEEDED")).await?;
        ensure!(
            text.contains("square") && text.contains("default"),
            "{text}"
        );
        let link = b
            .find(Locator::Css(&format!("{row} > .node a.child-link")))
            .await?;
        ensure!(link.text().await? == *id);
        let href = link.attr("href").await?.unwrap_or_default();
        ensure!(
            href == format!("#/queues/default/tasks/{id}"),
            "{id} links to {href}"
        );
    }
    // A child expands: its own children are read (it has none).
    let first = format!("{top}[data-task-id='{}']", children[0]);
    b.find(Locator::Css(&format!("{first} button.expand")))
        .await?
        .click()
        .await?;
    wait_text(b, &format!("{first} .subtree"), |t| t == "No child task.").await?;
    let expanded = b
        .find(Locator::Css(&format!("{first} button.expand")))
        .await?
        .attr("aria-expanded")
        .await?;
    ensure!(expanded.as_deref() == Some("true"), "{expanded:?}");
    scroll_to(b, "#children-h").await?;
    save_screenshot(b, "flow").await?;

    // A child's page links back to its parent, and has no children.
    let second = &children[1];
    b.find(Locator::Css(&format!(
        "{top}[data-task-id='{second}'] a.child-link"
    )))
    .await?
    .click()
    .await?;
    wait_text(b, "main h1", |t| t == format!("Task {second}")).await?;
    wait_text(b, "#task-status", |t| t.starts_with("SUCCEEDED")).await?;
    wait_text(b, "#task-parent", |t| t == format!("{done} in default")).await?;
    let section = b.find(Locator::Css("#children-h")).await?;
    ensure!(
        !section.is_displayed().await?,
        "a task without children shows Children"
    );
    b.find(Locator::Css("#parent-link")).await?.click().await?;
    wait_text(b, "main h1", |t| t == format!("Task {done}")).await?;
    wait_text(b, "#children .children-summary", |t| {
        t.starts_with("4 children")
    })
    .await?;

    // The waiting parent: WAITING, its children QUEUED in `nowhere`.
    b.goto(&format!("{base}/ui/#/queues/default/tasks/{waiting}"))
        .await?;
    wait_text(b, "#task-status", |t| {
        t == "WAITING (waiting for its children: 2 of 2 not ended)"
    })
    .await?;
    let badge = b.find(Locator::Css("#task-status .status")).await?;
    ensure!(badge.attr("class").await?.as_deref() == Some("status status-waiting"));
    wait_text(b, "#children .children-summary", |t| {
        t == "2 children: 2 QUEUED"
    })
    .await?;
    for id in parked {
        let row = format!("{top}[data-task-id='{id}'] > .node");
        let text = wait_text(b, &row, |t| t.contains("QUEUED")).await?;
        ensure!(text.contains("in nowhere"), "{text}");
        let href = b
            .find(Locator::Css(&format!("{row} a.child-link")))
            .await?
            .attr("href")
            .await?;
        ensure!(
            href == Some(format!("#/queues/nowhere/tasks/{id}")),
            "{href:?}"
        );
    }
    scroll_to(b, "#task-status").await?;
    save_screenshot(b, "flow-waiting").await?;

    // The task list, filtered by WAITING: the waiting parent only.
    b.goto(&format!("{base}/ui/#/queues/default/tasks?status=WAITING"))
        .await?;
    wait_text(b, &format!("#tasks a[data-task-id='{waiting}']"), |t| {
        t == waiting
    })
    .await?;
    wait_text(b, &format!("#tasks tr[data-task-id='{waiting}']"), |t| {
        t.contains("WAITING")
    })
    .await?;
    ensure!(
        b.find_all(Locator::Css(&format!("#tasks tr[data-task-id='{done}']")))
            .await?
            .is_empty(),
        "a SUCCEEDED task listed as WAITING"
    );
    let filter = b.find(Locator::Css("#status-filter")).await?;
    ensure!(filter.prop("value").await?.as_deref() == Some("WAITING"));

    // The queue's recent events: the parent went WAITING.
    b.goto(&format!("{base}/ui")).await?;
    wait_text(b, "#stream-state", |t| t == "live").await?;
    b.find(Locator::Css("#chart-queue"))
        .await?
        .select_by_value("default")
        .await?;
    let event = format!("#events tr[data-task-id='{waiting}'][data-status='WAITING']");
    let text = wait_text(b, &event, |t| t.contains("WAITING")).await?;
    ensure!(text.contains("fan_out"), "{text}");
    scroll_to(b, "#events-h").await?;
    save_screenshot(b, "events").await?;

    // Cancelled, it takes its two children with it.
    b.goto(&format!("{base}/ui/#/queues/default/tasks/{waiting}"))
        .await?;
    wait_text(b, "#cancel", |t| t == "Cancel task").await?;
    b.find(Locator::Css("#cancel")).await?.click().await?;
    wait_text(b, "#task-action", |t| t.starts_with("Task is CANCELLED.")).await?;
    wait_text(b, "#cancelled-children", |t| t.starts_with("2 child tasks")).await?;
    wait_text(b, "#children .children-summary", |t| {
        t == "2 children: 2 CANCELLED"
    })
    .await?;
    for id in parked {
        api.wait_for("nowhere", id, &["CANCELLED"], WAIT).await?;
    }
    Ok(())
}

/// Scroll the first element matching `css` to the top of the window, so
/// that a screenshot shows what follows it.
async fn scroll_to(b: &Client, css: &str) -> Result<()> {
    b.execute(
        "document.querySelector(arguments[0]).scrollIntoView()",
        vec![json!(css)],
    )
    .await?;
    Ok(())
}

/// The ids of a task's children, as the API lists them.
fn child_ids(task: &Value) -> Result<Vec<String>> {
    Ok(task["children"]
        .as_array()
        .context("children")?
        .iter()
        .filter_map(|c| c["task_id"].as_str().map(str::to_owned))
        .collect())
}

/// A task that fails its only attempt (it would succeed on a second):
/// its id, once dead-lettered.
async fn dead_letter(api: &ApiClient) -> Result<String> {
    let body = json!({"task": "flaky", "payload": {"succeed_on_attempt": 2}, "max_attempts": 1});
    let id = api.submit_new("default", body, None).await?;
    api.wait_for("default", &id, &["DEAD_LETTERED"], WAIT)
        .await?;
    Ok(id)
}

/// The ids the DLQ route lists.
async fn dlq_ids(api: &ApiClient) -> Result<Vec<String>> {
    let (status, body) = api
        .call(Method::GET, "/v1/queues/default/dlq", None, &[])
        .await?;
    ensure!(status == 200, "{body}");
    Ok(body["tasks"]
        .as_array()
        .context("tasks")?
        .iter()
        .filter_map(|t| t["task_id"].as_str().map(str::to_owned))
        .collect())
}

/// Wait until the first element matching `css` has a text that `want`
/// accepts; its text. Fails after [`WAIT`] with the last text seen.
async fn wait_text(b: &Client, css: &str, want: impl Fn(&str) -> bool) -> Result<String> {
    let start = Instant::now();
    let mut last = None;
    loop {
        if let Some(el) = b.find_all(Locator::Css(css)).await?.into_iter().next() {
            // The element may be replaced between the find and the read.
            if let Ok(text) = el.text().await {
                if want(&text) {
                    return Ok(text);
                }
                last = Some(text);
            }
        }
        if start.elapsed() > WAIT {
            let notice = match b.find(Locator::Css("#notice")).await {
                Ok(el) => el.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            bail!("{css}: last text {last:?} within {WAIT:?} (notice: {notice:?})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The page as a PNG, `dashboard-<page>.png` in the target directory;
/// the queues page where `DTQ_UI_SCREENSHOT` says instead, if set (see the
/// module documentation).
async fn save_screenshot(b: &Client, page: &str) -> Result<()> {
    let png = b.screenshot().await?;
    let path = match std::env::var_os("DTQ_UI_SCREENSHOT") {
        Some(p) if page == "queues" => Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p),
        _ => Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("dashboard-{page}.png")),
    };
    std::fs::write(&path, png).with_context(|| format!("write {}", path.display()))?;
    eprintln!("dashboard screenshot: {}", path.display());
    Ok(())
}

/// A chromedriver process on a free loopback port, killed on drop.
struct ChromeDriver {
    child: Child,
    url: String,
    chromium: PathBuf,
}

impl ChromeDriver {
    fn start(dir: &TempDir) -> Result<ChromeDriver> {
        let driver = program("DTQ_CHROMEDRIVER", &["chromedriver"])?;
        let chromium = program(
            "DTQ_CHROMIUM",
            &["chromium", "chromium-browser", "google-chrome"],
        )?;
        let port = free_port()?;
        let log = std::fs::File::create(dir.path.join("chromedriver.log"))?;
        let child = Command::new(&driver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {}", driver.display()))?;
        Ok(ChromeDriver {
            child,
            url: format!("http://127.0.0.1:{port}"),
            chromium,
        })
    }

    /// A new headless browser session, once chromedriver answers.
    async fn session(&self, dir: &TempDir) -> Result<Client> {
        let mut args = vec![
            "--headless=new".to_owned(),
            "--disable-gpu".to_owned(),
            "--disable-dev-shm-usage".to_owned(),
            "--window-size=1280,720".to_owned(),
            format!("--user-data-dir={}", dir.path.join("chromium").display()),
        ];
        // Chromium's sandbox refuses to run as root.
        // SAFETY: geteuid(2) has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            args.push("--no-sandbox".to_owned());
        }
        let caps = json!({
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": self.chromium, "args": args},
        });
        let serde_json::Value::Object(caps) = caps else {
            bail!("capabilities are an object");
        };
        self.wait_ready(dir).await?;
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&self.url)
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "no browser session from chromedriver at {}: {e}\n{}",
                    self.url,
                    driver_log(dir)
                )
            })
    }

    /// Wait until chromedriver's `/status` says it is ready.
    async fn wait_ready(&self, dir: &TempDir) -> Result<()> {
        let http = reqwest::Client::new();
        let start = Instant::now();
        loop {
            if let Ok(resp) = http.get(format!("{}/status", self.url)).send().await
                && let Ok(status) = resp.json::<Value>().await
                && status["value"]["ready"] == true
            {
                return Ok(());
            }
            ensure!(
                start.elapsed() < WAIT,
                "chromedriver at {} was not ready within {WAIT:?}\n{}",
                self.url,
                driver_log(dir)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn driver_log(dir: &TempDir) -> String {
    std::fs::read_to_string(dir.path.join("chromedriver.log")).unwrap_or_default()
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `$var` if set, else the first of `names` on `PATH`; a clear failure
/// when there is none.
fn program(var: &str, names: &[&str]) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(var) {
        return Ok(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for name in names {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    bail!(
        "none of {names:?} is on PATH: the dashboard test needs Debian's `chromium` and \
         `chromium-driver` (scripts/setup installs them), or {var} set to the program"
    )
}
