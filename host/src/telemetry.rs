//! OpenTelemetry: spans exported over OTLP/HTTP, and the W3C trace context
//! carried from a submission to its task's attempts and on to the
//! services a handler calls.
//!
//! Off unless an endpoint is configured (`--otlp-endpoint`,
//! `OTEL_EXPORTER_OTLP_ENDPOINT`): then [`start`] makes the exporter (OTLP
//! over HTTP, protobuf, batched on Tokio) and the `tracing` layer that
//! feeds it, and once the layer is installed [`activate`] makes
//! [`enabled`] true. Off, no layer is installed and the
//! rooms create none of the spans below: what they pay is one atomic load
//! per request or attempt.
//!
//! | span | made by | parent | attributes |
//! |---|---|---|---|
//! | `POST /v1/queues/{queue}/tasks` (and `/batch`), kind server | the submit routes ([`submission`]) | the request's `traceparent` header | queue |
//! | `attempt`, kind consumer | the worker, per attempt | the submission's span, by the `traceparent` stored with the task | task_id, queue, task, attempt, outcome |
//! | the request's method, kind client | the sandbox, per outbound request of a handler | the attempt | method, host, port, status |
//!
//! The context crosses the queue as a W3C `traceparent` string stored with
//! the task (a task hash field, and a field of a carried message): only
//! when tracing is on or the submitter sent one, so that an untraced task
//! costs Redis nothing more. A `traceparent` that is not a valid W3C one is
//! ignored, as the W3C spec asks: the request starts a trace of its own.
//! An outbound request carries its span's `traceparent` downstream, unless
//! the handler set the header itself.
//!
//! Each of these spans records its trace id in a field `trace_id`, so a
//! log line emitted inside it carries the id (in `--log-format json`,
//! under `span`).

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

/// The `tracing` target of the spans this module exports; other spans
/// (the debug spans of the rooms) stay out of the traces.
pub const TARGET: &str = "dtq_otel";

/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";

/// The provider, once [`start`] made it; its presence is [`enabled`].
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether this process exports spans.
pub fn enabled() -> bool {
    PROVIDER.get().is_some()
}

/// Where to export, and as which service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The OTLP/HTTP traces URL (`…/v1/traces`).
    pub traces_url: String,
    /// `service.name` of the spans.
    pub service_name: String,
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The exporter could not be made.
    #[error("cannot make the OTLP exporter: {0}")]
    Exporter(String),
    /// This process traces already, or has a subscriber of its own.
    #[error("tracing was started already, or the process has a subscriber")]
    Started,
}

/// How long the exporter waits for the receiver per batch.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// An exporter made by [`start`], not yet [`activate`]d.
pub struct Exporter(SdkTracerProvider);

/// Make the exporter to `settings`, and the `tracing` layer that turns
/// this module's spans ([`TARGET`]) into OpenTelemetry spans, and warnings
/// and errors inside them into span events. Nothing is traced until the
/// layer is installed and the exporter [`activate`]d. Must run inside a
/// Tokio runtime (the batches are sent from a task of it).
pub fn start<S>(settings: &Settings) -> Result<(impl Layer<S>, Exporter), TelemetryError>
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span>,
{
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(settings.traces_url.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let batches =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(settings.service_name.clone())
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(batches)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("dtq");
    // Nothing below INFO: the hint keeps the debug and trace callsites
    // off unless the logs' filter wants them.
    let ours = tracing_subscriber::filter::filter_fn(|meta| {
        if meta.is_span() {
            meta.target() == TARGET
        } else {
            *meta.level() <= tracing::Level::WARN
        }
    })
    .with_max_level_hint(tracing::Level::INFO);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(ours);
    Ok((layer, Exporter(provider)))
}

/// Trace from now on, exporting with `exporter`: once its layer is the
/// process's (a layer that could not be installed would make spans that
/// carry no context).
pub fn activate(exporter: Exporter) -> Result<(), TelemetryError> {
    PROVIDER
        .set(exporter.0)
        .map_err(|_| TelemetryError::Started)
}

/// Send the spans not sent yet and stop the exporter (at shutdown); does
/// nothing when tracing is off.
pub async fn shutdown() {
    let Some(provider) = PROVIDER.get() else {
        return;
    };
    let provider = provider.clone();
    // The provider's shutdown blocks until the batch task, on the
    // runtime, has sent the last batch.
    let ended = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    if let Ok(Err(e)) = ended {
        tracing::warn!(error = %e, "the last spans could not be exported");
    }
}

/// The valid W3C `traceparent` among `headers`, written afresh (so that
/// only a well-formed value is stored); `None` without one.
pub fn traceparent_of(headers: &http::HeaderMap) -> Option<String> {
    let context = TraceContextPropagator::new().extract(&Headers(headers));
    let span = context.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            span_context.trace_id(),
            span_context.span_id(),
            span_context.trace_flags().to_u8()
        )
    })
}

/// Make `traceparent` (a remote span: the submission's, for an attempt)
/// the parent of `span`, and record its trace id in its `trace_id` field.
/// Without one, the span's parent is the span it was made in, or none.
pub fn adopt(span: &Span, traceparent: Option<&str>) {
    if let Some(traceparent) = traceparent {
        let context = TraceContextPropagator::new().extract(&One(traceparent));
        if context.span().span_context().is_valid() {
            let _ = span.set_parent(context);
        }
    }
    let trace_id = span.context().span().span_context().trace_id();
    span.record("trace_id", tracing::field::display(trace_id));
}

/// The W3C `traceparent` that names `span` as a parent.
pub fn traceparent(span: &Span) -> Option<String> {
    let mut value = None;
    TraceContextPropagator::new().inject_context(&span.context(), &mut Slot(&mut value));
    value
}

/// Add `span`'s `traceparent` to `headers`, unless they have one.
pub fn inject(span: &Span, headers: &mut http::HeaderMap) {
    if headers.contains_key(TRACEPARENT) {
        return;
    }
    if let Some(value) = traceparent(span).and_then(|v| http::HeaderValue::from_str(&v).ok()) {
        headers.insert(TRACEPARENT, value);
    }
}

/// The span of a submission request named `name` (`POST
/// /v1/queues/{queue}/tasks`) to `queue`, and the `traceparent` its tasks
/// are to carry: with tracing on, a server span whose parent is the
/// request's `traceparent` and the traceparent naming it; off, no span and
/// the request's `traceparent` as it came (valid ones only).
pub fn submission(
    name: &'static str,
    queue: &str,
    headers: &http::HeaderMap,
) -> (Span, Option<String>) {
    let sent = traceparent_of(headers);
    if !enabled() {
        return (Span::none(), sent);
    }
    let span = tracing::info_span!(target: TARGET, "submit", otel.name = name,
        otel.kind = "server", http.request.method = "POST", queue = %queue,
        trace_id = tracing::field::Empty);
    adopt(&span, sent.as_deref());
    let carried = traceparent(&span);
    (span, carried)
}

/// Request headers, read by the propagator.
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// One stored `traceparent`, read by the propagator.
struct One<'a>(&'a str);

impl Extractor for One<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT).then_some(self.0)
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

/// Where the propagator writes a `traceparent`.
struct Slot<'a>(&'a mut Option<String>);

impl Injector for Slot<'_> {
    fn set(&mut self, key: &str, value: String) {
        if key == TRACEPARENT {
            *self.0 = Some(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(traceparent: &str) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        headers.insert(TRACEPARENT, traceparent.parse().expect("a header value"));
        headers
    }

    #[test]
    fn only_a_valid_traceparent_is_taken_and_it_is_written_afresh() {
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(traceparent_of(&headers(valid)).as_deref(), Some(valid));
        let upper = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01";
        assert_eq!(traceparent_of(&headers(upper)), None);
        for bad in [
            "",
            "junk",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(traceparent_of(&headers(bad)), None, "{bad:?}");
        }
        assert_eq!(traceparent_of(&http::HeaderMap::new()), None);
    }

    #[test]
    fn off_a_submission_has_no_span_and_passes_the_sent_traceparent_on() {
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let (span, carried) = submission("POST /x", "q", &headers(valid));
        assert!(span.is_none());
        assert_eq!(carried.as_deref(), Some(valid));
        let (_, carried) = submission("POST /x", "q", &http::HeaderMap::new());
        assert_eq!(carried, None);
    }
}
