//! `http_client`: a command-driven guest for outbound HTTP, so the
//! integration tests can drive the host's allow-list, limits and
//! `Idempotency-Key` through `dtq_guest::http`.
//!
//! Payload → result:
//!
//! | payload | does | result |
//! |---|---|---|
//! | `{"op": "get", "url": U}` | `GET U` | `{"status": n, "body": S}` |
//! | `{"op": "post", "url": U, "json": V, "in_operation": K?}` | `POST U` with JSON `V`, inside `idempotency::operation(K)` when `K` is given | `{"status": n, "body": S}`, plus `"outcome": "executed"` or `"done"` inside an operation |
//! | `{"op": "many", "url": U, "n": N}` | N × `GET U`, stopping at the first error | `{"ok": n, "error": S?}` |
//! | `{"op": "own_key", "url": U, "key": K, "json": V?}` | `POST U` with `Idempotency-Key: K` and JSON `V` (default `{}`), inside operation `own:K` | `{"status": n, "body": S}` |
//! | `{"op": "operations", "url": U, "keys": [K…]}` | one `POST U` inside each operation `K` | `{"statuses": [n…]}` |
//! | `{"op": "fail_after_post", "url": U, "key": K}` | inside operation `K`: `POST U`, then a retryable error while the attempt is below 2 (so the operation runs again on the retry) | `{"status": n, "attempt": n}` |
//! | `{"op": "timed", "url": U, "connect_ms": a?, "first_byte_ms": b?, "between_bytes_ms": c?}` | `GET U` through `wasi:http` directly, with those `request-options` (`timed.rs`) | `{"status": n, "body": S}`, or `{"fallback": true, "error": code}` |
//!
//! A request that fails gives `{"error": S}` (S: the error's message) and
//! the call still succeeds, so a test reads the message from the result.
//! Response bodies are returned as text (lossily decoded).

mod timed;

use dtq_guest::http::{self, Method, Request, Response};
use dtq_guest::idempotency::{self, Operation, Options};
use dtq_guest::{Context, Error, Result};
use serde::Deserialize;
use serde_json::{Value, json};

/// TTL of the operations this guest opens.
const TTL_SECONDS: u32 = 3_600;

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum Op {
    Get {
        url: String,
    },
    Post {
        url: String,
        #[serde(default)]
        json: Value,
        #[serde(default)]
        in_operation: Option<String>,
    },
    Many {
        url: String,
        n: u32,
    },
    OwnKey {
        url: String,
        key: String,
        #[serde(default)]
        json: Option<Value>,
    },
    Operations {
        url: String,
        keys: Vec<String>,
    },
    FailAfterPost {
        url: String,
        key: String,
    },
    Timed {
        url: String,
        #[serde(default)]
        connect_ms: Option<u64>,
        #[serde(default)]
        first_byte_ms: Option<u64>,
        #[serde(default)]
        between_bytes_ms: Option<u64>,
    },
}

fn http_client(ctx: Context, op: Op) -> Result<Value> {
    Ok(match op {
        Op::Get { url } => reply(http::get(url)),
        Op::Post {
            url,
            json,
            in_operation: None,
        } => reply(http::post_json(url, &json)),
        Op::Post {
            url,
            json,
            in_operation: Some(key),
        } => match in_operation(&key, || http::post_json(url, &json).map(summary)) {
            Ok(Operation::Executed(mut result)) => {
                result["outcome"] = json!("executed");
                result
            }
            Ok(Operation::Done(_)) => json!({"outcome": "done"}),
            Ok(other) => json!({"error": format!("operation {key}: {other:?}")}),
            Err(e) => json!({"error": e.message()}),
        },
        Op::Many { url, n } => {
            let mut ok = 0;
            for _ in 0..n {
                if let Err(e) = http::get(url.as_str()) {
                    return Ok(json!({"ok": ok, "error": e.message()}));
                }
                ok += 1;
            }
            json!({"ok": ok})
        }
        Op::OwnKey { url, key, json } => {
            let sent = in_operation(&format!("own:{key}"), || {
                Request::new(Method::Post, url)
                    .idempotency_key(&key)
                    .json(&json.unwrap_or_else(|| json!({})))
                    .send()
                    .map(summary)
            });
            executed(sent)
        }
        Op::Operations { url, keys } => {
            let mut statuses = Vec::new();
            for key in keys {
                let sent = in_operation(&key, || {
                    http::post_json(url.as_str(), &json!({})).map(|r| r.status)
                });
                match sent {
                    Ok(Operation::Executed(status)) => statuses.push(status),
                    Ok(other) => {
                        return Ok(json!({"error": format!("operation {key}: {other:?}")}));
                    }
                    Err(e) => return Ok(json!({"error": e.message()})),
                }
            }
            json!({"statuses": statuses})
        }
        Op::FailAfterPost { url, key } => {
            // An error inside the operation releases its claim: the retry
            // runs the effect, and sends the request, again.
            let sent = idempotency::operation(&key, Options::ttl(TTL_SECONDS), || {
                let status = http::post_json(url, &json!({"attempt": ctx.attempt}))?.status;
                if ctx.attempt < 2 {
                    dtq_guest::retry!("failing attempt {} after the POST", ctx.attempt);
                }
                Ok(json!({"status": status, "attempt": ctx.attempt}))
            })?;
            match sent {
                Operation::Executed(result) => result,
                other => return Err(Error::fatal(format!("operation {key}: {other:?}"))),
            }
        }
        Op::Timed {
            url,
            connect_ms,
            first_byte_ms,
            between_bytes_ms,
        } => timed::get(
            &url,
            &timed::Timeouts {
                connect_ms,
                first_byte_ms,
                between_bytes_ms,
            },
        ),
    })
}

/// Run `effect` inside the operation `key`.
fn in_operation<T, F>(key: &str, effect: F) -> Result<Operation<T>>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
    F: FnOnce() -> Result<T>,
{
    idempotency::operation(key, Options::ttl(TTL_SECONDS), effect)
}

/// The result of an operation this call must have executed.
fn executed(sent: Result<Operation<Value>>) -> Value {
    match sent {
        Ok(Operation::Executed(result)) => result,
        Ok(other) => json!({"error": format!("not executed: {other:?}")}),
        Err(e) => json!({"error": e.message()}),
    }
}

/// A response as `{"status", "body"}`.
fn summary(response: Response) -> Value {
    json!({
        "status": response.status,
        "body": String::from_utf8_lossy(&response.body),
    })
}

/// A request's outcome: its summary, or `{"error": message}`.
fn reply(response: Result<Response>) -> Value {
    match response {
        Ok(response) => summary(response),
        Err(e) => json!({"error": e.message()}),
    }
}

dtq_guest::handler!(http_client);
