//! OpenTelemetry (issue 34): a real `dtq serve` with `--otlp-endpoint`
//! exports, over OTLP/HTTP to a receiver in this test, the spans of a
//! submission, of its task's attempt and of the attempt's outbound
//! request, all in the trace the submitter's `traceparent` named, each the
//! child of the one before; the downstream service gets the request's own
//! `traceparent`; a log line inside the attempt carries the trace id. And
//! without the flag nothing reaches the receiver.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use axum::body::Bytes;
use axum::http::HeaderMap;
use dtq_tests::process::{DtqProcess, dtq_command};
use dtq_tests::{ApiClient, RedisServer, TempDir, free_port, guests};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use serde_json::{Value, json};

/// The binary under test.
const DTQ: &str = env!("CARGO_BIN_EXE_dtq");

/// The trace the submitter is in, and its span that submits.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SENT_SPAN_ID: &str = "00f067aa0ba902b7";

/// How long anything that should happen may take.
const WAIT: Duration = Duration::from_secs(60);

/// What a loopback HTTP server of this test saw: the OTLP receiver's spans
/// and requests, or the downstream service's `traceparent` headers.
#[derive(Default)]
struct Seen {
    requests: usize,
    spans: Vec<Span>,
    traceparents: Vec<Option<String>>,
}

type Shared = Arc<Mutex<Seen>>;

/// Serve `app` on a free loopback port, on this test's runtime; its URL.
async fn serve(app: axum::Router) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

/// An OTLP/HTTP receiver: `POST /v1/traces` with protobuf, every span kept.
async fn receiver(seen: Shared) -> Result<String> {
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| async move {
            let request = ExportTraceServiceRequest::decode(body);
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.requests += 1;
            if let Ok(request) = request {
                for resource in request.resource_spans {
                    for scope in resource.scope_spans {
                        seen.spans.extend(scope.spans);
                    }
                }
            }
            (
                [("content-type", "application/x-protobuf")],
                Vec::<u8>::new(),
            )
        }),
    );
    serve(app).await
}

/// A downstream service: answers `ok`, keeping each request's `traceparent`.
async fn downstream(seen: Shared) -> Result<String> {
    let app = axum::Router::new().fallback(move |headers: HeaderMap| async move {
        let traceparent = headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.traceparents.push(traceparent);
        "ok"
    });
    serve(app).await
}

/// A `dtq serve` running the test guests (`http_client` may reach
/// loopback), logging JSON, with `flags` besides; healthy.
async fn dtq_serve(redis: &RedisServer, dir: &TempDir, flags: &[&str]) -> Result<DtqProcess> {
    let port = free_port()?;
    let cache = std::env::temp_dir().join("dtq-test-artifact-cache");
    let mut cmd = dtq_command(DTQ);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|n| n.starts_with("OTEL_")) {
            cmd.env_remove(name);
        }
    }
    cmd.arg("serve")
        .args(["--redis", &redis.url()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--allow-host", "http_client=http://127.0.0.1:*"])
        .args(["--log-format", "json"])
        .args(flags)
        .arg("--handlers")
        .arg(guests::TEST_GUESTS_DIR)
        .arg("--cache-dir")
        .arg(&cache);
    let log = dir.path.join("serve.log");
    let mut serve = DtqProcess::spawn("serve", cmd, log, format!("http://127.0.0.1:{port}"))?;
    serve.wait_healthy(WAIT).await?;
    Ok(serve)
}

/// Submit `payload` to `http_client` with the submitter's `traceparent`;
/// the task's id.
async fn submit_traced(api: &str, payload: Value) -> Result<String> {
    let answer: Value = reqwest::Client::new()
        .post(format!("{api}/v1/queues/default/tasks"))
        .header("traceparent", format!("00-{TRACE_ID}-{SENT_SPAN_ID}-01"))
        .json(&json!({"task": "http_client", "payload": payload, "max_attempts": 1}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    answer["task_id"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("no task_id in {answer}"))
}

/// Stop `serve` with SIGTERM (its exporter sends what it holds) and wait.
async fn stop(serve: &mut DtqProcess) -> Result<()> {
    serve.signal(libc::SIGTERM)?;
    let status = serve.wait_exit(WAIT).await?;
    ensure!(status.success(), "exited with {status}");
    Ok(())
}

/// The string attribute `key` of `span`.
fn attribute<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(s) => Some(s.as_str()),
            _ => None,
        })
}

/// The spans of `name` in the submitter's trace.
fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|s| hex::encode(&s.trace_id) == TRACE_ID && s.name == name)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_submission_its_attempt_and_its_request_are_spans_of_the_submitters_trace() -> Result<()>
{
    let (otlp, service) = (Shared::default(), Shared::default());
    let receiver = receiver(otlp.clone()).await?;
    let downstream = downstream(service.clone()).await?;
    let redis = RedisServer::start()?;
    let dir = TempDir::new("tracing-process")?;
    let mut serve = dtq_serve(&redis, &dir, &["--otlp-endpoint", &receiver]).await?;

    let api = ApiClient::new(serve.api.clone());
    let fetched = submit_traced(&serve.api, json!({"op": "get", "url": downstream})).await?;
    // An op the guest does not know fails the attempt: a warning, logged
    // inside the attempt's span.
    let failed = submit_traced(&serve.api, json!({"op": "no_such_op"})).await?;
    let task = api
        .wait_for("default", &fetched, &["SUCCEEDED"], WAIT)
        .await?;
    ensure!(task["result"]["status"] == 200, "{task:#}");
    api.wait_for("default", &failed, &["FAILED"], WAIT).await?;
    stop(&mut serve).await?;

    let seen = otlp.lock().unwrap_or_else(|e| e.into_inner());
    let submits = named(&seen.spans, "POST /v1/queues/{queue}/tasks");
    ensure!(submits.len() == 2, "two submissions: {:#?}", seen.spans);
    for submit in &submits {
        assert_eq!(hex::encode(&submit.parent_span_id), SENT_SPAN_ID);
        assert_eq!(attribute(submit, "queue"), Some("default"));
    }
    let attempt = named(&seen.spans, "attempt")
        .into_iter()
        .find(|s| attribute(s, "task_id") == Some(fetched.as_str()))
        .with_context(|| format!("no attempt of {fetched}: {:#?}", seen.spans))?;
    ensure!(
        submits.iter().any(|s| s.span_id == attempt.parent_span_id),
        "the attempt's parent is a submission: {attempt:#?}"
    );
    assert_eq!(attribute(attempt, "task"), Some("http_client"));
    assert_eq!(attribute(attempt, "outcome"), Some("success"));
    let request = named(&seen.spans, "GET");
    ensure!(request.len() == 1, "one request: {:#?}", seen.spans);
    assert_eq!(request[0].parent_span_id, attempt.span_id);
    assert_eq!(attribute(request[0], "server.address"), Some("127.0.0.1"));

    // Downstream, the request named its own span as the parent.
    let traceparents = service.lock().unwrap_or_else(|e| e.into_inner());
    let expected = format!("00-{TRACE_ID}-{}-01", hex::encode(&request[0].span_id));
    assert_eq!(traceparents.traceparents, [Some(expected)]);

    // The failed attempt's warning carries the trace id.
    let log = serve.log_text();
    let warned = log
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|line| line["message"] == "attempt failed" && line["task_id"] == failed.as_str())
        .with_context(|| format!("no warning of {failed}:\n{log}"))?;
    assert_eq!(warned["span"]["trace_id"], TRACE_ID, "{warned}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn without_an_endpoint_nothing_is_exported_and_nothing_is_added_downstream() -> Result<()> {
    let (otlp, service) = (Shared::default(), Shared::default());
    let _receiver = receiver(otlp.clone()).await?;
    let downstream = downstream(service.clone()).await?;
    let redis = RedisServer::start()?;
    let dir = TempDir::new("tracing-process-off")?;
    let mut serve = dtq_serve(&redis, &dir, &[]).await?;

    let api = ApiClient::new(serve.api.clone());
    let id = submit_traced(&serve.api, json!({"op": "get", "url": downstream})).await?;
    api.wait_for("default", &id, &["SUCCEEDED"], WAIT).await?;
    stop(&mut serve).await?;

    assert_eq!(otlp.lock().unwrap_or_else(|e| e.into_inner()).requests, 0);
    let seen = service.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(seen.traceparents, [None]);
    Ok(())
}
