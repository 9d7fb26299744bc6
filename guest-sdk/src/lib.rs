//! Write dtq task handlers in Rust: one function from a typed payload to a
//! typed result, built as a WebAssembly component for `wasm32-wasip2`.
//!
//! A handler is a function `fn(Context, P) -> Result<R>`, where the payload
//! `P` is any [`serde::de::DeserializeOwned`] type (or [`RawJson`]) and the
//! result `R` any [`serde::Serialize`] type (or [`RawJson`]).
//! [`handler!`] exports it as the component's `handle` function; the crate's
//! `Cargo.toml` needs `crate-type = ["cdylib"]`, and
//! `cargo build --release --target wasm32-wasip2` makes the `.wasm` a host
//! worker runs. Inside the sandbox a handler reaches only what this crate
//! offers: [`idempotent_operation`], a namespaced slice of Redis in [`kv`],
//! the task's [`log`], [`progress`] reports for whoever watches the task,
//! and [`tasks`] it submits (flows: exactly once, and a parent that waits
//! for its children).
//!
//! How a call ends decides what the host does with the task:
//!
//! * `Ok(result)` → SUCCEEDED with `result` as JSON.
//! * a retryable [`Error`] (what `?` gives for any error), a panic or a trap
//!   → retried with backoff until the attempts run out, then dead-lettered.
//! * a fatal [`Error`] ([`fatal!`], [`Error::fatal`], a payload that does not
//!   parse as `P`) → FAILED at once.
//!
//! # Example
//!
//! Charge an order through a payment service once, however often the task
//! is retried or redelivered (`examples/send_receipt` also emails the
//! receipt):
//!
//! ```no_run
//! use dtq_guest::{Context, Result, http, idempotent_operation};
//! use serde_json::{Value, json};
//!
//! #[derive(serde::Deserialize)]
//! struct Order { order_id: String, amount_cents: u64, payment_url: String }
//!
//! fn charge(_ctx: Context, order: Order) -> Result<Value> {
//!     let id = &order.order_id;
//!     // Inside the operation the host sends the same Idempotency-Key on
//!     // every run, so the payment service charges once.
//!     let (charged, _) = idempotent_operation(format!("charge:{id}"), 86_400, || {
//!         let body = json!({"order_id": id, "amount_cents": order.amount_cents});
//!         http::post_json(format!("{}/charges", order.payment_url), &body)?
//!             .error_for_status()?
//!             .json::<Value>()
//!     })?;
//!     Ok(json!({"order_id": id, "deduped": !charged}))
//! }
//!
//! dtq_guest::handler!(charge);
//! # fn main() {}
//! ```
//!
//! # Namespaces
//!
//! The host puts every [`kv`] key of a handler under
//! `dtq:guest:{<namespace>}:` and its idempotency claims in a keyspace of
//! their own that no kv key can name. The namespace is the operator's to
//! give: the task name unless `dtq` runs with `--namespace TASK=NS`, for
//! example to let two task types share counters. A handler may ask for one
//! with `handler!(f, namespace = "...")`; it is then loaded only where the
//! operator gave it exactly that namespace. See [`handler!`].
//!
//! # Building natively
//!
//! The bindings compile on any target so that `cargo check` and doc tests
//! work on the build machine, but the host imports exist only inside a dtq
//! worker: calling [`kv`], [`log`], [`http`], [`progress`] or
//! [`idempotent_operation`] outside one panics.

#![deny(missing_docs)]

mod context;
mod error;
pub mod http;
pub mod idempotency;
mod json;
pub mod kv;
pub mod log;
mod progress;
pub mod tasks;

pub use context::Context;
pub use error::{Error, Refusal, Result, ResultExt};
pub use idempotency::{idempotent_operation, stored_result};
pub use json::{FromJson, IntoJson, RawJson};
pub use progress::progress;

/// The bindings of the `dtq:handler` WIT world. Not a stable API: handlers use
/// the rest of this crate, and [`handler!`] wires them to these.
#[doc(hidden)]
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod bindings {
    wit_bindgen::generate!({
        world: "handler",
        path: "../wit",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "dtq_guest::bindings",
    });
}

/// Export a handler function as the component's `handle`.
///
/// The function has the shape `fn(Context, P) -> Result<R>` with
/// `P: FromJson` (any `DeserializeOwned` type, or [`RawJson`]) and
/// `R: IntoJson` (any `Serialize` type, or [`RawJson`]). Use the macro once
/// per component, at the crate's top level.
///
/// ```no_run
/// use dtq_guest::{Context, Result};
///
/// #[derive(serde::Deserialize)]
/// struct Greet { name: String }
///
/// fn greet(_ctx: Context, payload: Greet) -> Result<String> {
///     Ok(format!("hello, {}", payload.name))
/// }
///
/// dtq_guest::handler!(greet);
/// # fn main() {}
/// ```
///
/// # Choosing the namespace
///
/// `handler!(f, namespace = "billing")` asks for the handler's [`kv`] keys
/// and idempotency claims to live in namespace `billing` instead of its task
/// name, so that handlers deployed under different task names can share
/// state. The namespace must be 1 to 64 ASCII letters, digits, `-`, `_` or
/// `.` (checked at compile time).
///
/// The macro embeds the namespace, as UTF-8 bytes, in a custom section named
/// `dtq-namespace` of the handler's core module. The namespace is the
/// operator's decision: the host loads such a component only when it runs
/// with `--namespace TASK=billing` for its task, and refuses it otherwise,
/// so a handler cannot make itself a co-tenant of another's keys.
///
/// ```no_run
/// use dtq_guest::{Context, Result, kv};
///
/// fn refund(_ctx: Context, order_id: String) -> Result<i64> {
///     kv::incr_by(format!("charges:{order_id}"), -1)
/// }
///
/// dtq_guest::handler!(refund, namespace = "billing");
/// # fn main() {}
/// ```
///
/// A namespace that could be confused with a key prefix does not compile:
///
/// ```compile_fail
/// fn noop(_ctx: dtq_guest::Context, _payload: ()) -> dtq_guest::Result<()> {
///     Ok(())
/// }
///
/// dtq_guest::handler!(noop, namespace = "billing:admin");
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! handler {
    ($handler:expr $(,)?) => {
        const _: () = {
            struct DtqHandler;

            impl $crate::bindings::Guest for DtqHandler {
                fn handle(
                    ctx: $crate::bindings::TaskContext,
                    payload: ::std::string::String,
                ) -> ::core::result::Result<::std::string::String, $crate::bindings::HandlerError>
                {
                    $crate::__private::run(ctx, payload, $handler)
                }
            }

    $crate::bindings::export!(DtqHandler with_types_in $crate::bindings);
        };
    };
    ($handler:expr, namespace = $namespace:literal $(,)?) => {
        $crate::handler!($handler);

        const _: () = {
            #[cfg_attr(target_family = "wasm", unsafe(link_section = "dtq-namespace"))]
            #[used]
            static DTQ_NAMESPACE: [u8; $namespace.len()] =
                $crate::__private::namespace_section::<{ $namespace.len() }>($namespace);
        };
    };
}

/// What [`handler!`] expands to; not a stable API.
#[doc(hidden)]
pub mod __private {
    use crate::bindings::{HandlerError, TaskContext};
    use crate::{Context, FromJson, IntoJson, Result};

    /// Run one call: parse the payload, call the handler, write the result.
    pub fn run<P, R, F>(
        ctx: TaskContext,
        payload: String,
        handler: F,
    ) -> core::result::Result<String, HandlerError>
    where
        P: FromJson,
        R: IntoJson,
        F: FnOnce(Context, P) -> Result<R>,
    {
        let payload = P::from_json(payload)?;
        let result = handler(Context::from(ctx), payload)?;
        Ok(result.into_json()?)
    }

    /// The bytes of the `dtq-namespace` custom section for `namespace`;
    /// evaluated at compile time, so an invalid namespace fails the build.
    pub const fn namespace_section<const N: usize>(namespace: &str) -> [u8; N] {
        let bytes = namespace.as_bytes();
        assert!(
            !bytes.is_empty() && bytes.len() <= 64,
            "a dtq namespace must be 1 to 64 bytes long"
        );
        assert!(bytes.len() == N, "namespace length mismatch");
        let mut out = [0u8; N];
        let mut i = 0;
        while i < N {
            let b = bytes[i];
            assert!(
                b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.',
                "a dtq namespace may hold only ASCII letters, digits, '-', '_' and '.'"
            );
            out[i] = b;
            i += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::__private::{namespace_section, run};
    use super::bindings::{HandlerError, TaskContext};
    use super::{Context, Error, RawJson, Result};

    fn task_context(attempt: u32) -> TaskContext {
        TaskContext {
            task_id: "t-1".into(),
            queue: "q".into(),
            task_name: "demo".into(),
            attempt,
            max_attempts: 3,
            idempotency_key: Some("k".into()),
            deadline_ms: 1_000,
        }
    }

    /// A call's outcome in a comparable form: the result text, or whether the
    /// error is fatal and its message.
    fn outcome(
        out: core::result::Result<String, HandlerError>,
    ) -> core::result::Result<String, (bool, String)> {
        out.map_err(|err| match err {
            HandlerError::Fatal(message) => (true, message),
            HandlerError::Retryable(message) => (false, message),
        })
    }

    #[derive(serde::Deserialize)]
    struct Add {
        a: i64,
        b: i64,
    }

    fn add(ctx: Context, payload: Add) -> Result<serde_json::Value> {
        if payload.a < 0 {
            crate::fatal!("a is negative");
        }
        if ctx.attempt < 2 {
            return Err(Error::retryable("first attempt fails"));
        }
        Ok(serde_json::json!({"sum": payload.a + payload.b, "task": ctx.task_id}))
    }

    #[test]
    fn run_writes_the_result_as_json() {
        let out = outcome(run(task_context(2), r#"{"a": 2, "b": 3}"#.into(), add));
        assert_eq!(out, Ok(r#"{"sum":5,"task":"t-1"}"#.to_string()));
    }

    #[test]
    fn run_maps_errors_to_their_kind() {
        let retry = outcome(run(task_context(1), r#"{"a": 2, "b": 3}"#.into(), add));
        assert_eq!(retry, Err((false, "first attempt fails".into())));
        let fatal = outcome(run(task_context(2), r#"{"a": -1, "b": 3}"#.into(), add));
        assert_eq!(fatal, Err((true, "a is negative".into())));
    }

    #[test]
    fn a_payload_that_does_not_parse_is_fatal() {
        let out = outcome(run(task_context(2), r#"{"a": "two"}"#.into(), add));
        match out {
            Err((true, message)) => {
                assert!(message.starts_with("payload does not match"), "{message}");
            }
            other => panic!("expected a fatal error, got {other:?}"),
        }
    }

    #[test]
    fn raw_json_passes_through_untouched() {
        let text = r#"{ "spaced" :  [1, 2] }"#;
        let out = outcome(run(task_context(1), text.into(), |_ctx, p: RawJson| Ok(p)));
        assert_eq!(out, Ok(text.to_string()));
    }

    #[test]
    fn question_mark_gives_a_retryable_error_with_sources() {
        fn parse() -> Result<u8> {
            Ok("300".parse::<u8>()?)
        }
        let err = parse().err().map(|e| (e.is_fatal(), e.to_string()));
        assert_eq!(
            err,
            Some((false, "number too large to fit in target type".into()))
        );
    }

    #[test]
    fn host_errors_map_by_whether_a_retry_can_help() {
        use super::bindings::dtq::handler::types::HostError;
        let fatal = |e: HostError| Error::from_host("op", e).is_fatal();
        assert!(fatal(HostError::InvalidKey(String::new())));
        assert!(fatal(HostError::ValueTooLarge(1)));
        assert!(fatal(HostError::InvalidArgument("ttl 0".into())));
        assert!(!fatal(HostError::WrongType("string".into())));
        assert!(!fatal(HostError::Unavailable("down".into())));
        assert!(!fatal(HostError::OutcomeUnknown("reset".into())));
        assert!(!fatal(HostError::ClaimLost("taken over".into())));
        assert!(!fatal(HostError::QuotaExceeded("full".into())));
        let unknown = Error::from_host("kv incr-by", HostError::OutcomeUnknown("reset".into()));
        assert_eq!(unknown.refusal(), Some(crate::Refusal::OutcomeUnknown));
        assert!(
            unknown.message().contains("may or may not have applied"),
            "{unknown}"
        );
    }

    #[test]
    fn namespace_section_holds_the_utf8_bytes() {
        const SECTION: [u8; 9] = namespace_section::<9>("shared-ns");
        assert_eq!(&SECTION, b"shared-ns");
    }
}
