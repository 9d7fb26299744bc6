//! The host side of `idempotency`: claims with an owner and a state, and the
//! kv writes of an open operation, staged until they commit with the claim.
//!
//! | step | Redis | if the attempt dies here |
//! |---|---|---|
//! | `begin` | `claim_begin.lua`: the claim is this call's, *running*, with a lease of [`Limits::claim_lease`](super::Limits::claim_lease) renewed every fifth of it while the call runs | the renewals stop; once the lease ends, the next caller takes the claim over |
//! | kv writes | none: staged in [`Operation`]; reads see them | nothing was written |
//! | `commit` | `claim_commit.lua`: the writes and *done* with the result, one atomic step, only while the claim is this call's | applied wholly or not at all; a lost reply is resolved by sending it again (the owner token makes it apply once) |
//! | `abort` | `claim_abort.lua`: the claim is released | the claim is taken over once its lease ends, as above |
//!
//! A live owner cut off from Redis for longer than the lease may find its
//! claim taken over: its commit is then refused (`claim-lost`), so the kv
//! writes still apply once.
//!
//! A claim counts against the namespace's budget from `begin` (its key and
//! record) and with its result from `commit`, until it expires or is
//! aborted; a `begin` without room, or past the namespace's live claims,
//! and a `commit` without room, are `quota-exceeded` ([`quota`]).
//!
//! The scripts live beside this file in `lua/`; every key they touch is
//! in the namespace's hash tag.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use super::imports::bindings::dtq::handler::idempotency::{BeginOptions, ClaimState, Host};
use super::imports::bindings::dtq::handler::types::HostError;
use super::imports::{HostCtx, HostResult, guest_try};
use super::quota;
use crate::store::Conn;
use crate::store::scripts::{self, ArgSink, Argv, ArgvLayout};

static BEGIN: LazyLock<Script> =
    LazyLock::new(|| quota::script(include_str!("lua/claim_begin.lua")));
static COMMIT: LazyLock<Script> =
    LazyLock::new(|| quota::script(include_str!("lua/claim_commit.lua")));
static ABORT: LazyLock<Script> =
    LazyLock::new(|| quota::script(include_str!("lua/claim_abort.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| scripts::clocked(include_str!("lua/claim_renew.lua")));

/// `claim_begin.lua`'s ARGV by name, the budget's first (`quota::argv`).
pub(super) static BEGIN_ARGV: ArgvLayout = ArgvLayout {
    script: "claim_begin",
    prefix: "ARG_",
    first: 1,
    names: &[
        "KV_PREFIX",
        "CLAIM_PREFIX",
        "BUDGET",
        "TOKEN",
        "TASK_ID",
        "ATTEMPT",
        "TTL",
        "LEASE",
        "EXTERNAL",
        "MAX_CLAIMS",
    ],
    rest: None,
};

/// `claim_commit.lua`'s ARGV by name, the budget's first; then, from
/// `WRITES`, each staged write's values ([`WRITE_ARGV`]).
pub(super) static COMMIT_ARGV: ArgvLayout = ArgvLayout {
    script: "claim_commit",
    prefix: "ARG_",
    first: 1,
    names: &["KV_PREFIX", "CLAIM_PREFIX", "BUDGET", "TOKEN", "RESULT"],
    rest: Some("WRITES"),
};

/// One staged write's values in `claim_commit.lua`'s ARGV, by their
/// offsets from where it starts.
pub(super) static WRITE_ARGV: ArgvLayout = ArgvLayout {
    script: "claim_commit",
    prefix: "W_",
    first: 0,
    names: &["OP", "VALUE", "NX", "EX"],
    rest: None,
};

/// `claim_abort.lua`'s ARGV by name, the budget's first.
pub(super) static ABORT_ARGV: ArgvLayout = ArgvLayout {
    script: "claim_abort",
    prefix: "ARG_",
    first: 1,
    names: &["KV_PREFIX", "CLAIM_PREFIX", "BUDGET", "TOKEN"],
    rest: None,
};

/// `claim_renew.lua`'s ARGV by name.
pub(super) static RENEW_ARGV: ArgvLayout = ArgvLayout {
    script: "claim_renew",
    prefix: "ARG_",
    first: 1,
    names: &["TOKEN", "LEASE"],
    rest: None,
};

/// A kv write staged by an open operation; the Redis key is already
/// namespaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Staged {
    Set {
        key: String,
        value: String,
        only_if_absent: bool,
        expire_seconds: Option<u32>,
    },
    /// `value` is what the guest was told the key holds afterwards; the
    /// commit adds `delta`, so increments made outside the operation
    /// meanwhile are kept.
    IncrBy {
        key: String,
        delta: i64,
        value: i64,
    },
    Del {
        key: String,
    },
    Expire {
        key: String,
        seconds: u32,
    },
}

impl Staged {
    fn key(&self) -> &str {
        match self {
            Staged::Set { key, .. }
            | Staged::IncrBy { key, .. }
            | Staged::Del { key }
            | Staged::Expire { key, .. } => key,
        }
    }

    /// The values `claim_commit.lua` takes per write ([`WRITE_ARGV`]),
    /// into `call`.
    fn put_args<S: ArgSink>(&self, call: &mut S) {
        let none = String::new;
        let (op, value, nx, ex) = match self {
            Staged::Set {
                value,
                only_if_absent,
                expire_seconds,
                ..
            } => (
                "set",
                value.clone(),
                if *only_if_absent { "nx" } else { "" },
                expire_seconds.map_or_else(none, |s| s.to_string()),
            ),
            Staged::IncrBy { delta, .. } => ("incrby", delta.to_string(), "", none()),
            Staged::Del { .. } => ("del", none(), "", none()),
            Staged::Expire { seconds, .. } => ("expire", seconds.to_string(), "", none()),
        };
        Argv::new(call, &WRITE_ARGV)
            .put("OP", op)
            .put("VALUE", value)
            .put("NX", nx)
            .put("EX", ex)
            .done();
    }
}

/// An open idempotent operation of one call.
#[derive(Debug)]
pub(crate) struct Operation {
    /// The guest's key of the operation.
    key: String,
    /// Its claim in Redis.
    claim: String,
    writes: Vec<Staged>,
    /// The value each written key holds as the writes leave it (`None`:
    /// deleted), so reads inside the operation see them.
    view: HashMap<String, Option<String>>,
    bytes: usize,
    /// The tasks the operation submits (flows, `tasks.rs`): staged into
    /// the task's outbox before the commit, applied once it committed.
    pub(crate) submissions: Vec<crate::store::Staged>,
    /// Renews the claim's lease until the operation closes or the call
    /// ends (dropped with it).
    _renewal: Option<AbortOnDrop>,
}

/// Aborts a spawned task when dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renew the lease of `claim` for `token` every fifth of `lease`, until the
/// claim is no longer this owner's running one.
async fn renew(mut redis: Conn, claim: String, token: String, lease: Duration) {
    let mut ticks = tokio::time::interval((lease / 5).max(Duration::from_millis(10)));
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let mut invocation = RENEW.prepare_invoke();
        invocation.key(&claim);
        Argv::new(&mut invocation, &RENEW_ARGV)
            .put("TOKEN", &token)
            .put("LEASE", lease.as_millis() as u64)
            .done();
        let renewed: Result<i64, _> = invocation.invoke_async(&mut redis).await;
        match renewed {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "claim lease renewal failed"),
        }
    }
}

impl Operation {
    fn new(key: String, claim: String) -> Self {
        Operation {
            key,
            claim,
            writes: Vec::new(),
            view: HashMap::new(),
            bytes: 0,
            submissions: Vec::new(),
            _renewal: None,
        }
    }

    /// The operation's key.
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// The staged value of `key`: `None` when no write touched it.
    pub(crate) fn value(&self, key: &str) -> Option<Option<&str>> {
        self.view.get(key).map(Option::as_deref)
    }

    /// Add `write`, unless the operation's writes would pass `max_bytes`.
    pub(crate) fn stage(&mut self, write: Staged, max_bytes: usize) -> Result<(), HostError> {
        let size = write.key().len()
            + match &write {
                Staged::Set { value, .. } => value.len(),
                _ => 20,
            };
        if self.bytes + size > max_bytes {
            return Err(HostError::ValueTooLarge((self.bytes + size) as u64));
        }
        self.bytes += size;
        let key = write.key().to_string();
        match &write {
            Staged::Set { value, .. } => {
                self.view.insert(key, Some(value.clone()));
            }
            Staged::IncrBy { value, .. } => {
                self.view.insert(key, Some(value.to_string()));
            }
            Staged::Del { .. } => {
                self.view.insert(key, None);
            }
            Staged::Expire { .. } => {}
        }
        self.writes.push(write);
        Ok(())
    }
}

impl HostCtx {
    /// Stage `op`'s submissions into the task's outbox, each naming the
    /// claim and `token`, before `op` commits (`store::stage_outbox`):
    /// they apply once it has. The completion's follow-up applies them (or
    /// drops them, if the commit did not happen).
    async fn stage_submissions(&mut self, op: &Operation, token: &str) -> Result<(), HostError> {
        let entries = op
            .submissions
            .iter()
            .map(|s| {
                let mut s = s.clone();
                s.claim = Some(op.claim.clone());
                s.owner = Some(token.to_owned());
                serde_json::to_string(&s).map_err(|e| HostError::InvalidArgument(e.to_string()))
            })
            .collect::<Result<Vec<String>, HostError>>()?;
        let (queue, id) = (self.caller.queue.clone(), self.caller.task_id.clone());
        let staged = crate::store::stage_outbox(self.redis(), &queue, &id, &entries).await;
        self.flow.get_or_insert_with(Default::default).op_staged = true;
        match staged {
            Ok(()) => Ok(()),
            Err(crate::store::StoreError::Redis(e)) => Err(super::imports::host_error(e, true)),
            Err(e) => Err(HostError::Unavailable(e.to_string())),
        }
    }

    fn token(&mut self) -> String {
        self.caller
            .token
            .get_or_insert_with(crate::base::unique_token)
            .clone()
    }

    /// The open operation on `key`, taken out of the call; an error when
    /// there is none.
    fn take_operation(&mut self, key: &str) -> Result<Box<Operation>, HostError> {
        match self.operation.take() {
            Some(op) if op.key == key => Ok(op),
            other => {
                self.operation = other;
                Err(HostError::InvalidArgument(format!(
                    "no operation on {key:?} is open"
                )))
            }
        }
    }
}

impl Host for HostCtx {
    async fn begin(&mut self, key: String, options: BeginOptions) -> HostResult<ClaimState> {
        self.count()?;
        guest_try!(self.check_key(&key));
        guest_try!(self.check_ttl(options.ttl_seconds));
        if let Some(open) = &self.operation {
            return Ok(Err(HostError::InvalidArgument(format!(
                "the operation on {:?} is still open: operations cannot nest",
                open.key
            ))));
        }
        let claim = format!("{}{key}", self.handler.claim_prefix);
        let token = self.token();
        let limits = &self.handler.limits;
        let mut invocation = quota::invocation(&BEGIN, &claim, &self.handler);
        quota::argv(&mut invocation, &BEGIN_ARGV, &self.handler)
            .put("TOKEN", &token)
            .put("TASK_ID", &self.caller.task_id)
            .put("ATTEMPT", self.caller.attempt)
            .put("TTL", options.ttl_seconds)
            .put("LEASE", limits.claim_lease.as_millis() as u64)
            .put("EXTERNAL", if options.external_effects { "1" } else { "0" })
            .put("MAX_CLAIMS", limits.max_live_claims)
            .done();
        let (state, value): (String, Option<String>) =
            guest_try!(self.repeatable(&invocation).await);
        Ok(Ok(match state.as_str() {
            "run" => {
                let lease = self.handler.limits.claim_lease;
                let renewal = tokio::spawn(renew(
                    self.handler.redis.clone(),
                    claim.clone(),
                    token,
                    lease,
                ));
                let mut op = Operation::new(key, claim);
                op._renewal = Some(AbortOnDrop(renewal));
                self.operation = Some(Box::new(op));
                ClaimState::Run(value.as_deref() == Some("1"))
            }
            "done" => ClaimState::Done(value),
            "busy" => ClaimState::InProgress,
            "abandoned" => ClaimState::Abandoned,
            "quota" => return Ok(Err(self.quota_exceeded(parse_count(value)))),
            "claims" => {
                return Ok(Err(HostError::QuotaExceeded(format!(
                    "the namespace holds {} live idempotency claims, the most it may \
                     ({}); nothing was claimed",
                    parse_count(value),
                    self.handler.limits.max_live_claims
                ))));
            }
            other => unknown_state("claim_begin", other)?,
        }))
    }

    async fn commit(&mut self, key: String, result: String) -> HostResult<()> {
        self.count()?;
        guest_try!(self.check_value(&result));
        let op = guest_try!(self.take_operation(&key));
        let token = self.token();
        if !op.submissions.is_empty() {
            guest_try!(self.stage_submissions(&op, &token).await);
        }
        let mut invocation = quota::invocation(&COMMIT, &op.claim, &self.handler);
        quota::argv(&mut invocation, &COMMIT_ARGV, &self.handler)
            .put("TOKEN", token)
            .put("RESULT", result)
            .done();
        for write in &op.writes {
            invocation.key(write.key());
            write.put_args(&mut invocation);
        }
        let (state, detail): (String, String) = guest_try!(self.repeatable(&invocation).await);
        Ok(match state.as_str() {
            "committed" => Ok(()),
            "lost" => Err(HostError::ClaimLost(format!(
                "the claim on {key:?} is no longer this attempt's ({detail}); nothing was applied"
            ))),
            "refused" => Err(HostError::WrongType(format!(
                "{detail}; nothing of the operation on {key:?} was applied"
            ))),
            "quota" => Err(self.quota_exceeded(parse_count(Some(detail)))),
            other => unknown_state("claim_commit", other)?,
        })
    }

    async fn abort(&mut self, key: String) -> HostResult<()> {
        self.count()?;
        let op = guest_try!(self.take_operation(&key));
        let token = self.token();
        let mut invocation = quota::invocation(&ABORT, &op.claim, &self.handler);
        quota::argv(&mut invocation, &ABORT_ARGV, &self.handler)
            .put("TOKEN", token)
            .done();
        // 0 (not this call's running claim any more) is fine too: the
        // staged writes are dropped either way.
        let _released: i64 = guest_try!(self.repeatable(&invocation).await);
        Ok(Ok(()))
    }

    async fn get_result(&mut self, key: String) -> HostResult<Option<String>> {
        self.count()?;
        guest_try!(self.check_key(&key));
        let claim = format!("{}{key}", self.handler.claim_prefix);
        let (state, result): (Option<String>, Option<String>) = guest_try!(
            self.read(redis::cmd("HMGET").arg(claim).arg("state").arg("result"))
                .await
        );
        Ok(Ok(result.filter(|_| state.as_deref() == Some("done"))))
    }
}

/// The count a script answered as text; 0 if it is not one (the count is
/// only told to the guest).
fn parse_count(value: Option<String>) -> i64 {
    value.and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// A script answered with a state its header does not list: a host bug,
/// which traps the call rather than guessing.
fn unknown_state<T>(script: &str, state: &str) -> wasmtime::Result<T> {
    Err(wasmtime::Error::msg(format!(
        "{script} answered with an unknown state {state:?}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(key: &str, value: &str) -> Staged {
        Staged::Set {
            key: key.into(),
            value: value.into(),
            only_if_absent: false,
            expire_seconds: None,
        }
    }

    #[test]
    fn reads_see_the_staged_writes_in_order() {
        let mut op = Operation::new("k".into(), "c".into());
        assert_eq!(op.value("a"), None);
        op.stage(set("a", "1"), 1 << 20).unwrap();
        assert_eq!(op.value("a"), Some(Some("1")));
        let incr = Staged::IncrBy {
            key: "a".into(),
            delta: 4,
            value: 5,
        };
        op.stage(incr, 1 << 20).unwrap();
        assert_eq!(op.value("a"), Some(Some("5")));
        op.stage(Staged::Del { key: "a".into() }, 1 << 20).unwrap();
        assert_eq!(op.value("a"), Some(None));
        assert_eq!(op.writes.len(), 3);
    }

    #[test]
    fn staged_bytes_are_bounded() {
        let mut op = Operation::new("k".into(), "c".into());
        op.stage(set("a", &"x".repeat(60)), 100).unwrap();
        let refused = op.stage(set("b", &"x".repeat(60)), 100);
        assert!(matches!(refused, Err(HostError::ValueTooLarge(_))));
        assert_eq!(op.value("b"), None, "a refused write is not staged");
    }

    /// The arguments a call was given, as text.
    #[derive(Default)]
    struct Args(Vec<String>);

    impl ArgSink for Args {
        fn push_arg<T: redis::ToRedisArgs>(&mut self, value: T) {
            let text = value.to_redis_args().into_iter();
            self.0
                .extend(text.map(|b| String::from_utf8(b).expect("text")));
        }
    }

    fn args_of(write: &Staged) -> Vec<String> {
        let mut args = Args::default();
        write.put_args(&mut args);
        args.0
    }

    #[test]
    fn each_write_gives_the_script_four_values() {
        let ex = Staged::Set {
            key: "k".into(),
            value: "v".into(),
            only_if_absent: true,
            expire_seconds: Some(9),
        };
        assert_eq!(args_of(&ex), ["set", "v", "nx", "9"].map(String::from));
        let incr = Staged::IncrBy {
            key: "k".into(),
            delta: -2,
            value: 0,
        };
        assert_eq!(args_of(&incr), ["incrby", "-2", "", ""].map(String::from));
    }
}
