//! Run a side effect once per key, across retries, redeliveries and crashes.
//!
//! [`idempotent_operation`] has the seed contract's shape: `(executed,
//! result)`. [`operation`] is the richer form, for handlers that react to
//! each case ([`Operation`]).
//!
//! # What is guaranteed
//!
//! The host keeps a claim per key (in a keyspace [`kv`](crate::kv) cannot
//! reach) with its owner, the task attempt running the effect, and its
//! state. While the effect runs, its [`kv`](crate::kv) writes are *staged* by
//! the host, not sent to Redis; when the effect returns `Ok`, they are
//! applied together with the claim's "done" mark in one atomic step.
//!
//! | the effect's writes | guarantee within the TTL |
//! |---|---|
//! | [`kv`](crate::kv) calls | exactly once: applied whole with the claim, or not at all |
//! | anything else (declared with [`Options::external_effects`]) | at most once: if the attempt dies mid-effect, later callers get [`Operation::Abandoned`] |
//!
//! What a crash does at each point:
//!
//! - **before the commit** (the worker killed, the deadline hit, a trap):
//!   nothing of the effect's kv writes was applied. The task's next attempt
//!   (or, once the dead attempt's lease is over, any caller) takes the claim
//!   over and runs the effect again: it happens once.
//! - **during the commit**: the commit is atomic; if its reply is lost, the
//!   host asks Redis again under the same owner and never applies it twice.
//! - **after the commit**: later callers get [`Operation::Done`] with the
//!   stored result.
//!
//! While the owner is alive and still running, other callers get
//! [`Operation::InProgress`]; [`idempotent_operation`] turns that into a
//! retryable error, so a handler never reports success for an effect that
//! has not happened yet.
//!
//! # Reads and increments inside an effect
//!
//! Reads see the effect's own staged writes. [`kv::incr`](crate::kv::incr)
//! returns the value read from Redis plus the staged increments; the commit
//! adds the same delta, so increments made by others meanwhile are kept, and
//! the final value can differ from the one returned by what they added.
//! `set_nx` decides on the key as seen when it is called, and Redis decides
//! again at the commit. One operation may be open at a time.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::dtq::handler::idempotency::{self as wit, BeginOptions, ClaimState};
use crate::{Error, Result, log};

/// How an [`operation`] claims its key.
///
/// ```
/// let options = dtq_guest::idempotency::Options::ttl(86_400).external_effects();
/// assert!(options.external_effects);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// How long the key stays claimed, from the first call, in seconds
    /// (1 up to the host's maximum, 30 days by default).
    pub ttl_seconds: u32,
    /// The effect reaches outside [`kv`](crate::kv) (an HTTP call, say), so
    /// the host cannot stage it: if the attempt running it dies before it
    /// returns, the effect may or may not have happened, and later callers
    /// get [`Operation::Abandoned`] rather than running it again.
    pub external_effects: bool,
}

impl Options {
    /// Options with this TTL and kv effects only.
    pub fn ttl(ttl_seconds: u32) -> Self {
        Options {
            ttl_seconds,
            external_effects: false,
        }
    }

    /// The same options, declaring effects outside kv.
    pub fn external_effects(mut self) -> Self {
        self.external_effects = true;
        self
    }
}

/// What [`operation`] found or did. (`D`, the type of a done operation's
/// result, is `T` for callers.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operation<T, D = T> {
    /// This call ran the effect and committed it: its result.
    Executed(T),
    /// The effect was done before (by this task or another): the result the
    /// executing call stored (`None` when it stored none). A stored result
    /// that does not parse as `T` is a fatal error.
    Done(Option<D>),
    /// Another attempt that is still alive holds the key and has not
    /// finished: the effect's outcome is not known yet. Retrying later
    /// finds it done, or takes it over if that attempt dies.
    InProgress,
    /// The attempt that held the key died while running an effect declared
    /// with [`Options::external_effects`]: it may or may not have happened,
    /// and the host will not run it again.
    Abandoned,
}

/// Run `effect` once per `key` within `ttl_seconds`, as the seed contract
/// has it: `Ok((true, Some(result)))` to the call that runs it, `Ok((false,
/// None))` to every later call.
///
/// Also `(false, None)` for an abandoned effect with external effects (see
/// [`Options::external_effects`]; not settable here, so only through
/// [`operation`]). While another live attempt is running the effect, this
/// returns a retryable error, never `(false, None)`: the handler must not
/// report success for an effect that has not happened yet.
///
/// If `effect` returns an error, none of its kv writes apply and the claim
/// is released, so that a retry of the task runs it again. See the [module
/// docs](self) for what each crash does.
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
    match begin_and_run(key, Options::ttl(ttl_seconds), effect)? {
        Operation::Executed(value) => Ok((true, Some(value))),
        Operation::Done(_) | Operation::Abandoned => Ok((false, None)),
        Operation::InProgress => Err(Error::retryable(format!(
            "idempotent operation {key:?} is in progress in another attempt"
        ))),
    }
}

/// Run `effect` once per `key`, and say what happened: the richer form of
/// [`idempotent_operation`].
///
/// ```no_run
/// use dtq_guest::idempotency::{self, Operation, Options};
/// use dtq_guest::{Error, kv};
///
/// # fn run() -> dtq_guest::Result<()> {
/// let charged = match idempotency::operation("charge:A-1", Options::ttl(86_400), || {
///     kv::incr_by("charges:A-1", 1_999)
/// })? {
///     Operation::Executed(total) | Operation::Done(Some(total)) => total,
///     Operation::Done(None) => return Err(Error::fatal("charged, but no result stored")),
///     Operation::InProgress => return Err(Error::retryable("charge in progress")),
///     Operation::Abandoned => return Err(Error::fatal("charge abandoned: check by hand")),
/// };
/// # let _ = charged; Ok(()) }
/// ```
pub fn operation<T, F>(key: impl AsRef<str>, options: Options, effect: F) -> Result<Operation<T>>
where
    T: Serialize + DeserializeOwned,
    F: FnOnce() -> Result<T>,
{
    let key = key.as_ref();
    Ok(match begin_and_run(key, options, effect)? {
        Operation::Executed(value) => Operation::Executed(value),
        Operation::Done(None) => Operation::Done(None),
        Operation::Done(Some(json)) => Operation::Done(Some(parse_stored(key, &json)?)),
        Operation::InProgress => Operation::InProgress,
        Operation::Abandoned => Operation::Abandoned,
    })
}

/// Open the operation and run `effect` if the claim is this call's; a done
/// operation's stored result is left as JSON text.
fn begin_and_run<T, F>(key: &str, options: Options, effect: F) -> Result<Operation<T, String>>
where
    T: Serialize,
    F: FnOnce() -> Result<T>,
{
    let begin = BeginOptions {
        ttl_seconds: options.ttl_seconds,
        external_effects: options.external_effects,
    };
    let state = wit::begin(key, begin).map_err(|e| Error::from_host("idempotency begin", e))?;
    Ok(match state {
        ClaimState::Run(took_over) => {
            if took_over {
                log::fields()
                    .with("key", key)
                    .info("idempotent operation taken over from an attempt that died");
            }
            Operation::Executed(run_claimed(key, effect)?)
        }
        ClaimState::Done(json) => Operation::Done(json),
        ClaimState::InProgress => Operation::InProgress,
        ClaimState::Abandoned => Operation::Abandoned,
    })
}

/// Run the effect of a claim this call holds, then commit or abort it.
fn run_claimed<T, F>(key: &str, effect: F) -> Result<T>
where
    T: Serialize,
    F: FnOnce() -> Result<T>,
{
    let value = match effect() {
        Ok(value) => value,
        Err(err) => {
            // The staged writes are dropped either way; a claim left behind
            // (the abort not answered) is taken over by the next attempt.
            if let Err(abort) = wit::abort(key) {
                log::fields()
                    .with("key", key)
                    .with("reason", Error::from_host("idempotency abort", abort))
                    .warn("the claim was not released; the next attempt takes it over");
            }
            return Err(err);
        }
    };
    let json = serde_json::to_string(&value)
        .map_err(|e| Error::fatal(format!("result of {key:?} does not serialize: {e}")))?;
    // Refused or lost, nothing applied; unknown, the next attempt finds the
    // commit applied or takes the claim over.
    wit::commit(key, &json).map_err(|e| Error::from_host("idempotency commit", e))?;
    Ok(value)
}

fn parse_stored<T: DeserializeOwned>(key: &str, json: &str) -> Result<T> {
    serde_json::from_str(json)
        .map_err(|e| Error::fatal(format!("stored result of {key:?} does not parse: {e}")))
}

/// The result stored by the [`idempotent_operation`] that ran `key`, if it
/// is done and stored one, and the claim has not expired.
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
    parse_stored(key, &json).map(Some)
}
