//! Real HTTP services on loopback for the tests of handlers' outbound
//! requests: a payment service, an email service and a few test endpoints.
//!
//! A [`Service`] is an HTTP/1 server (axum) on a free `127.0.0.1` port,
//! running on a thread and runtime of its own so that it answers whatever
//! the test's runtime is doing, and stopped (in-flight requests dropped)
//! when it is dropped. Every instance serves every route; a test starting
//! two, one as the payment service and one as the email service, gets two
//! apart records:
//!
//! | route | does |
//! |---|---|
//! | `POST /charges` `{"order_id", "amount_cents"}` | charges: answers `{"charge_id", "order_id", "amount_cents"}` |
//! | `POST /emails` `{"to", "order_id", …}` | sends an email: answers `{"email_id"}` |
//! | `GET /charges` | the charges made, pretty JSON: `{"charges": [{"charge_id", "order_id", "amount_cents", "idempotency_key"}]}` |
//! | `GET /emails` | the emails sent, pretty JSON: `{"emails": [{"email_id", "idempotency_key", "body"}]}` |
//! | any method, `/slow?ms=N` | answers `slow` after N ms |
//! | `GET /big?bytes=N[&chunked=1]` | answers N bytes, with `Content-Length` or (`chunked=1`) without |
//! | any method, `/ok` | answers `ok` |
//!
//! Both `POST` routes honour `Idempotency-Key` as payment APIs do: the first
//! request with a key acts and stores its answer, a later one with the same
//! key gets the stored answer (with `Idempotent-Replayed: true`) and does
//! not act again; the same key with a different request body is refused
//! with 422. Without the header every request acts.
//!
//! Every request is recorded when it arrives, before it is answered
//! ([`Service::requests`]), and a test can wait for one
//! ([`Service::wait_for_request`]) instead of sleeping.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

/// The header the `POST` routes honour.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// A request as the service saw it arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// `GET`, `POST`, ….
    pub method: String,
    /// The path and query, as sent.
    pub path: String,
    /// The `Idempotency-Key` header, if the request carried one.
    pub idempotency_key: Option<String>,
    /// The body, decoded lossily.
    pub body: String,
}

/// A charge the payment route made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// `ch_<n>`, n counting from 1 in this service.
    pub charge_id: String,
    /// The order charged.
    pub order_id: String,
    /// The amount charged.
    pub amount_cents: u64,
    /// The key of the request that made the charge.
    pub idempotency_key: Option<String>,
}

/// An email the email route sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Email {
    /// `em_<n>`, n counting from 1 in this service.
    pub email_id: String,
    /// The request body.
    pub body: Value,
    /// The key of the request that sent it.
    pub idempotency_key: Option<String>,
}

/// What the service has seen and done.
#[derive(Default)]
struct Records {
    requests: Vec<Recorded>,
    charges: Vec<Charge>,
    emails: Vec<Email>,
    /// The stored answer per (path, idempotency key), and the body of the
    /// request that made it.
    answered: HashMap<(String, String), (Bytes, Value)>,
}

struct State {
    records: Mutex<Records>,
    /// The number of requests recorded, for waiters.
    arrived: tokio::sync::watch::Sender<usize>,
}

impl State {
    fn records(&self) -> MutexGuard<'_, Records> {
        // A test that panicked while holding the lock has failed already;
        // the records are still worth reading.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An HTTP service on a free loopback port, stopped on drop. See the
/// [module docs](self) for its routes.
pub struct Service {
    url: String,
    state: Arc<State>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Service {
    /// Start a service on a free `127.0.0.1` port; it accepts connections
    /// when this returns.
    pub fn start() -> Result<Service> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let url = format!("http://{}", listener.local_addr()?);
        let state = Arc::new(State {
            records: Mutex::default(),
            arrived: tokio::sync::watch::Sender::new(0),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(state.clone());
        let thread = std::thread::Builder::new()
            .name("test-http-service".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(e) => panic!("test HTTP service: {e}"),
                    };
                    // Not a graceful shutdown: a request sleeping in /slow
                    // must not hold the test up.
                    tokio::select! {
                        served = axum::serve(listener, app) => {
                            if let Err(e) = served {
                                panic!("test HTTP service: {e}");
                            }
                        }
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(Service {
            url,
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The base URL, `http://127.0.0.1:<port>`, without a trailing slash.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every request received so far, in order of arrival.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.records().requests.clone()
    }

    /// The requests received so far whose path starts with `path`.
    pub fn requests_to(&self, path: &str) -> Vec<Recorded> {
        let records = self.state.records();
        records
            .requests
            .iter()
            .filter(|r| r.path.starts_with(path))
            .cloned()
            .collect()
    }

    /// Every charge made, in order.
    pub fn charges(&self) -> Vec<Charge> {
        self.state.records().charges.clone()
    }

    /// How many charges order `order_id` has.
    pub fn charges_for(&self, order_id: &str) -> usize {
        let records = self.state.records();
        records
            .charges
            .iter()
            .filter(|c| c.order_id == order_id)
            .count()
    }

    /// Every email sent, in order.
    pub fn emails(&self) -> Vec<Email> {
        self.state.records().emails.clone()
    }

    /// How many emails were sent about order `order_id` (their body's
    /// `order_id`).
    pub fn emails_for(&self, order_id: &str) -> usize {
        let records = self.state.records();
        records
            .emails
            .iter()
            .filter(|e| e.body["order_id"] == order_id)
            .count()
    }

    /// Wait until a request whose path starts with `path` has arrived, and
    /// return the first such; fail after `timeout`.
    pub async fn wait_for_request(&self, path: &str, timeout: Duration) -> Result<Recorded> {
        let mut seen = self.wait_for_requests(path, 1, timeout).await?;
        Ok(seen.swap_remove(0))
    }

    /// Wait until `n` requests whose path starts with `path` have arrived,
    /// and return all of those seen; fail with what arrived after `timeout`.
    pub async fn wait_for_requests(
        &self,
        path: &str,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<Recorded>> {
        let mut arrived = self.state.arrived.subscribe();
        let wait = async {
            loop {
                let seen = self.requests_to(path);
                if seen.len() >= n {
                    return anyhow::Ok(seen);
                }
                arrived.changed().await?;
            }
        };
        tokio::time::timeout(timeout, wait).await.with_context(|| {
            format!(
                "{n} request(s) to {path} did not reach {} within {timeout:?}; it saw {:?}",
                self.url,
                self.requests()
            )
        })?
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Every route: record the request, then answer it.
async fn handle(
    axum::extract::State(state): axum::extract::State<Arc<State>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = headers
        .get(IDEMPOTENCY_KEY)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let path = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_string(), |p| p.as_str().to_string());
    state.records().requests.push(Recorded {
        method: method.to_string(),
        path: path.clone(),
        idempotency_key: key.clone(),
        body: String::from_utf8_lossy(&body).into_owned(),
    });
    state.arrived.send_modify(|n| *n += 1);

    let query: HashMap<String, String> = uri
        .query()
        .map(|q| {
            q.split('&')
                .filter_map(|pair| pair.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default();
    let number = |name: &str| query.get(name).and_then(|v| v.parse::<u64>().ok());
    match (method, uri.path()) {
        (Method::POST, "/charges") => idempotent(&state, "/charges", key, body, charge),
        (Method::POST, "/emails") => idempotent(&state, "/emails", key, body, email),
        (Method::GET, "/charges") => listing(&state, "charges"),
        (Method::GET, "/emails") => listing(&state, "emails"),
        (_, "/slow") => {
            tokio::time::sleep(Duration::from_millis(number("ms").unwrap_or(0))).await;
            "slow".into_response()
        }
        (Method::GET, "/big") => {
            let bytes = usize::try_from(number("bytes").unwrap_or(0)).unwrap_or(usize::MAX);
            big(bytes, query.get("chunked").is_some_and(|v| v == "1"))
        }
        (_, "/ok") => "ok".into_response(),
        _ => (StatusCode::NOT_FOUND, "no such route").into_response(),
    }
}

/// Answer a `POST` once per idempotency key: `act` makes the answer of a
/// new request (and records what it did).
fn idempotent(
    state: &State,
    path: &str,
    key: Option<String>,
    body: Bytes,
    act: fn(&mut Records, &Bytes, Option<&str>) -> Result<Value, String>,
) -> Response {
    let mut records = state.records();
    let stored = key
        .as_ref()
        .and_then(|key| records.answered.get(&(path.to_string(), key.clone())));
    if let Some((first_body, answer)) = stored {
        if *first_body != body {
            let error = json!({"error": "Idempotency-Key reused with a different request"});
            return (StatusCode::UNPROCESSABLE_ENTITY, axum::Json(error)).into_response();
        }
        let replayed = [("idempotent-replayed", "true")];
        return (replayed, axum::Json(answer.clone())).into_response();
    }
    match act(&mut records, &body, key.as_deref()) {
        Ok(answer) => {
            if let Some(key) = key {
                records
                    .answered
                    .insert((path.to_string(), key), (body, answer.clone()));
            }
            axum::Json(answer).into_response()
        }
        Err(why) => (StatusCode::BAD_REQUEST, axum::Json(json!({"error": why}))).into_response(),
    }
}

/// `POST /charges`: make a charge.
fn charge(records: &mut Records, body: &Bytes, key: Option<&str>) -> Result<Value, String> {
    #[derive(Deserialize)]
    struct ChargeRequest {
        order_id: String,
        amount_cents: u64,
    }
    let request: ChargeRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let charge = Charge {
        charge_id: format!("ch_{}", records.charges.len() + 1),
        order_id: request.order_id,
        amount_cents: request.amount_cents,
        idempotency_key: key.map(str::to_string),
    };
    let answer = json!({
        "charge_id": charge.charge_id,
        "order_id": charge.order_id,
        "amount_cents": charge.amount_cents,
    });
    records.charges.push(charge);
    Ok(answer)
}

/// `POST /emails`: send an email.
fn email(records: &mut Records, body: &Bytes, key: Option<&str>) -> Result<Value, String> {
    let body: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let email_id = format!("em_{}", records.emails.len() + 1);
    records.emails.push(Email {
        email_id: email_id.clone(),
        body,
        idempotency_key: key.map(str::to_string),
    });
    Ok(json!({"email_id": email_id}))
}

/// `GET /charges` and `GET /emails`: what the service did, pretty-printed
/// (one field a line, for readers without a JSON tool).
fn listing(state: &State, what: &str) -> Response {
    let records = state.records();
    let items: Vec<Value> = if what == "charges" {
        records
            .charges
            .iter()
            .map(|c| {
                json!({
                    "charge_id": c.charge_id,
                    "order_id": c.order_id,
                    "amount_cents": c.amount_cents,
                    "idempotency_key": c.idempotency_key,
                })
            })
            .collect()
    } else {
        records
            .emails
            .iter()
            .map(|e| {
                json!({
                    "email_id": e.email_id,
                    "idempotency_key": e.idempotency_key,
                    "body": e.body,
                })
            })
            .collect()
    };
    let text = serde_json::to_string_pretty(&json!({ what: items })).unwrap_or_default();
    ([("content-type", "application/json")], text + "\n").into_response()
}

/// `GET /big`: `bytes` bytes of `x`, with a `Content-Length` unless
/// `chunked`.
fn big(bytes: usize, chunked: bool) -> Response {
    if !chunked {
        return vec![b'x'; bytes].into_response();
    }
    const CHUNK: usize = 512;
    let chunks = (0..bytes.div_ceil(CHUNK)).map(move |i| {
        let len = CHUNK.min(bytes - i * CHUNK);
        Ok::<_, std::convert::Infallible>(Bytes::from(vec![b'x'; len]))
    });
    Body::from_stream(futures::stream::iter(chunks)).into_response()
}
