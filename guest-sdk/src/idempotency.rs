//! Run a side effect at most once per key, across retries and redeliveries.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::dtq::handler::idempotency as wit;
use crate::{Error, Result, log};

/// Run `effect` at most once per `key` within `ttl_seconds`.
///
/// The host keeps an atomic claim (`SET NX EX`) on `key` in the handler's
/// namespace. The call that wins the claim runs `effect`, stores its result as
/// JSON beside the claim (see [`stored_result`]) and returns
/// `Ok((true, Some(result)))`. Any later call within the TTL — a redelivery
/// after a worker crashed, a retry, a concurrent duplicate — finds the claim
/// taken and returns `Ok((false, None))` without running `effect`.
///
/// If `effect` returns an error, the claim is released before the error is
/// returned, so that a retry of the task can claim the key again and run the
/// effect: return an error only when the effect did not take place. (If
/// releasing fails too, the claim holds until its TTL and the returned error
/// says so.) A panic or trap inside `effect` does not release the claim; the
/// key stays claimed until its TTL.
///
/// A failure to store the result after `effect` succeeded is logged and
/// otherwise ignored: the effect has happened, the claim still guards it, and
/// the caller still gets the result.
///
/// The remaining window: if the sandbox dies after the effect but before the
/// claim is released or the task completes, the effect is not repeated; if it
/// dies while the effect is half done, the effect must itself tolerate that.
///
/// ```no_run
/// use dtq_guest::{idempotent_operation, kv};
///
/// # fn run() -> dtq_guest::Result<()> {
/// let (executed, charge) = idempotent_operation("charge:A-1", 86_400, || {
///     kv::incr_by("charges:A-1", 1_999)
/// })?;
/// if !executed {
///     dtq_guest::log::info("A-1 was charged before");
/// }
/// # let _ = charge; Ok(()) }
/// ```
pub fn idempotent_operation<T, F>(
    key: impl AsRef<str>,
    ttl_seconds: u32,
    effect: F,
) -> Result<(bool, Option<T>)>
where
    T: Serialize,
    F: FnOnce() -> Result<T>,
{
    let key = key.as_ref();
    let won = wit::claim(key, ttl_seconds).map_err(|e| Error::from_host("idempotency claim", e))?;
    if !won {
        return Ok((false, None));
    }
    match effect() {
        Ok(value) => {
            let stored = serde_json::to_string(&value)
                .map_err(|e| e.to_string())
                .and_then(|json| {
                    wit::store_result(key, &json)
                        .map_err(|e| Error::from_host("idempotency store-result", e).to_string())
                });
            if let Err(reason) = stored {
                log::fields()
                    .with("key", key)
                    .with("reason", reason)
                    .warn("idempotent operation ran but its result was not stored");
            }
            Ok((true, Some(value)))
        }
        Err(err) => match wit::release(key) {
            Ok(()) => Err(err),
            Err(release_err) => {
                let release_err = Error::from_host("idempotency release", release_err);
                let message = format!(
                    "{err} (the claim on {key:?} was not released and holds until its TTL: \
                     {release_err})"
                );
                Err(if err.is_fatal() {
                    Error::fatal(message)
                } else {
                    Error::retryable(message)
                })
            }
        },
    }
}

/// The result stored by the [`idempotent_operation`] that won `key`, if it
/// stored one and the claim has not expired.
///
/// A stored result that does not parse as `T` is a fatal error.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// let charged: Option<i64> = dtq_guest::stored_result("charge:A-1")?;
/// # let _ = charged; Ok(()) }
/// ```
pub fn stored_result<T: DeserializeOwned>(key: impl AsRef<str>) -> Result<Option<T>> {
    let key = key.as_ref();
    let Some(json) =
        wit::get_result(key).map_err(|e| Error::from_host("idempotency get-result", e))?
    else {
        return Ok(None);
    };
    serde_json::from_str(&json)
        .map(Some)
        .map_err(|e| Error::fatal(format!("stored result of {key:?} does not parse: {e}")))
}
