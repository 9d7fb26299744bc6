//! Submitting a task: the one store call of the submission path. It
//! routes the task to its partition, runs `lua/ingest.lua` there, and
//! reads what the script answered, routing again when the partition count
//! changed under it or the key's records were forwarded (see
//! `partitions.rs`, `dlq.rs`). A batch (`batch.rs`) makes the very same
//! call for each of its tasks, in one pipeline.
//!
//! # The script's arguments
//!
//! `ingest.lua` reads its ARGV by name: [`argv`] numbers each argument as
//! Lua counts them, the script opens with a local of the same name and
//! number for each, and [`ingest_argv`] is the one place that builds them,
//! each put at its name's index. The test below holds the two lists to
//! each other, so no argument reaches the script at a position that only
//! happens to be right.

mod batch;
mod route;

pub use route::place_of_key;

use std::borrow::Cow;

use redis::Value;

use super::{
    Code, NewTask, QueueKeys, Store, StoreError, SubmitOutcome, TaskRecord, carried, code_of, flag,
    from_value, partition_of_id, unexpected,
};

/// The index of each of `ingest.lua`'s arguments, `ARGV[i]` as Lua counts
/// (from 1); the script's header says what each one is.
mod argv {
    /// The new task's id.
    pub(super) const TASK_ID: usize = 1;
    /// The submission time, ms since the epoch.
    pub(super) const NOW: usize = 2;
    /// `"1"` when the submission has an idempotency key, else `"0"`.
    pub(super) const HAS_KEY: usize = 3;
    /// The payload's fingerprint.
    pub(super) const FINGERPRINT: usize = 4;
    /// The idempotency records' TTL, s.
    pub(super) const IDEM_TTL: usize = 5;
    /// The queue's depth limit, 0 for none.
    pub(super) const MAX_DEPTH: usize = 6;
    /// When the task may run, ms since the epoch.
    pub(super) const RUN_AT: usize = 7;
    /// The events stream's approximate cap.
    pub(super) const EVENTS_MAX_LEN: usize = 8;
    /// The prefix of the queue's task hashes.
    pub(super) const TASK_PREFIX: usize = 9;
    /// The oldest submission index entry to keep, or `""` not to trim.
    pub(super) const INDEX_MIN_ID: usize = 10;
    /// The expiry, ms since the epoch, or `""` for none.
    pub(super) const EXPIRES_AT: usize = 11;
    /// The partition count the task was routed by.
    pub(super) const PARTITIONS: usize = 12;
    /// The head of a carried message's `run` field, or `""`.
    pub(super) const RUN_HEAD: usize = 13;
    /// The submission's W3C `traceparent`, or `""`.
    pub(super) const TRACEPARENT: usize = 14;
    /// The first of the task hash's fields, as name, value pairs to the
    /// end; [`LEADING_FIELDS`](super::LEADING_FIELDS) first.
    pub(super) const FIELDS: usize = 15;
    /// The payload: the value of the pair `payload`, fifth of the
    /// leading fields, which the script also appends to a carried
    /// message's `run` field.
    pub(super) const PAYLOAD: usize = FIELDS + 2 * 4 + 1;
}

/// The hash fields that go first, in this order, after `status`: the hash
/// is a listpack while small, where a field is found by a scan from the
/// front, and these are the fields the worker's scripts read and write on
/// every attempt. The payload is the fifth ([`argv::PAYLOAD`]).
const LEADING_FIELDS: [&str; 5] = ["attempts", "updated_at", "max_attempts", "task", "payload"];

/// What `ingest.lua`'s arguments take from the store and the route rather
/// than from the task.
struct IngestContext {
    idem_ttl_s: u64,
    max_depth: u64,
    events_max_len: u64,
    index_min_id: String,
    partitions: u32,
}

impl Store {
    /// Submit a task: one script, one round trip (plus, once per queue and
    /// process, the queue's entry in [`QUEUES`](super::QUEUES) and its partition count;
    /// plus, within the idempotency TTL after a raise of the count, one
    /// read per replaced count that moved the task's key). Routes `new` to
    /// its partition, which its id then names (see `partitions.rs`).
    pub async fn submit(
        &self,
        new: &mut NewTask,
        max_depth: u64,
    ) -> Result<SubmitOutcome, StoreError> {
        self.submit_preferring(new, max_depth, None).await
    }

    /// [`Store::submit`], routing a keyed task to partition `preferred`
    /// while the key's places include it and its record is not in another
    /// (see [`place_of_key`]): how a handler's staged submission keeps the
    /// id the sandbox gave it.
    pub async fn submit_preferring(
        &self,
        new: &mut NewTask,
        max_depth: u64,
        preferred: Option<u32>,
    ) -> Result<SubmitOutcome, StoreError> {
        self.register_queue(&new.queue).await?;
        let mut part = self.known_partitioning(&new.queue).await?;
        let (mut pinned, mut forwards) = (None, 0);
        for round in 0.. {
            self.route(new, &part, pinned, preferred).await?;
            let inv = self.ingest_call(new, part.count, max_depth);
            let reply: Vec<Value> = self
                .trip("submit", inv.invoke_async(&mut self.conn.clone()))
                .await?;
            match ingested(reply)? {
                Ingested::Done(outcome) => return Ok(outcome),
                Ingested::Repartitioned(found) => {
                    part = self
                        .reread_partitioning(&new.queue, &part, found, round)
                        .await?;
                }
                Ingested::Forwarded(to) => {
                    pinned = Some(follow_forward(new, to, &mut forwards)?);
                }
            }
        }
        unreachable!("the reroutes are bounded")
    }

    /// The ingest script's call for `new`, routed by a count of
    /// `partitions` (see `lua/ingest.lua`).
    fn ingest_call(
        &self,
        new: &NewTask,
        partitions: u32,
        max_depth: u64,
    ) -> redis::ScriptInvocation<'_> {
        let keys = QueueKeys::of_task(&new.queue, &new.id);
        let mut inv = self.scripts.ingest.prepare_invoke();
        inv.key(keys.idempotency(new.idempotency_key.as_deref()))
            .key(keys.task(&new.id))
            .key(&keys.stream)
            .key(&keys.delayed)
            .key(&keys.events)
            .key(&keys.index)
            .key(&keys.expiry)
            .key(&keys.partitions);
        let context = IngestContext {
            idem_ttl_s: self.settings.idem_ttl_s,
            max_depth,
            events_max_len: self.settings.events_max_len,
            index_min_id: self.index_trim_bound(keys.queue(), new.now),
            partitions,
        };
        for arg in ingest_argv(new, &keys, context) {
            inv.arg(arg.as_ref());
        }
        inv
    }
}

/// `ingest.lua`'s ARGV for `new`, each argument at its [`argv`] index.
fn ingest_argv<'a>(
    new: &'a NewTask,
    keys: &'a QueueKeys,
    context: IngestContext,
) -> Vec<Cow<'a, str>> {
    let mut args: Vec<Cow<'a, str>> = vec![Cow::Borrowed(""); argv::FIELDS - 1];
    let mut set = |at: usize, value: Cow<'a, str>| args[at - 1] = value;
    set(argv::TASK_ID, Cow::Borrowed(&new.id));
    set(argv::NOW, new.now.to_string().into());
    set(argv::HAS_KEY, flag(new.idempotency_key.is_some()).into());
    set(argv::FINGERPRINT, Cow::Borrowed(&new.fingerprint));
    set(argv::IDEM_TTL, context.idem_ttl_s.to_string().into());
    set(argv::MAX_DEPTH, context.max_depth.to_string().into());
    set(argv::RUN_AT, new.run_at.to_string().into());
    set(
        argv::EVENTS_MAX_LEN,
        context.events_max_len.to_string().into(),
    );
    set(argv::TASK_PREFIX, keys.task_prefix().into());
    set(argv::INDEX_MIN_ID, context.index_min_id.into());
    let expires_at = new.expires_at.map(|at| at.to_string());
    set(argv::EXPIRES_AT, expires_at.unwrap_or_default().into());
    set(argv::PARTITIONS, context.partitions.to_string().into());
    set(
        argv::RUN_HEAD,
        carried::run_head(new).unwrap_or_default().into(),
    );
    let traceparent = new.traceparent.as_deref().unwrap_or_default();
    set(argv::TRACEPARENT, Cow::Borrowed(traceparent));
    for (name, value) in hash_fields(new) {
        args.push(Cow::Borrowed(name));
        args.push(value);
    }
    debug_assert_eq!(
        args.get(argv::PAYLOAD - 1).map(AsRef::as_ref),
        Some(new.payload.as_str()),
        "the payload is where ingest.lua reads it"
    );
    args
}

/// The fields of `new`'s hash as `ingest.lua` writes them (besides
/// `status` and `msg_id`, which the script sets): [`LEADING_FIELDS`]
/// first, in their order, then the others.
fn hash_fields(new: &NewTask) -> Vec<(&'static str, Cow<'_, str>)> {
    let (now, max_attempts) = (new.now.to_string(), new.max_attempts.to_string());
    let [attempts, updated_at, max_attempts_field, task, payload] = LEADING_FIELDS;
    let mut fields = vec![
        (attempts, Cow::Borrowed("0")),
        (updated_at, Cow::Owned(now.clone())),
        (max_attempts_field, Cow::Owned(max_attempts.clone())),
        (task, Cow::Borrowed(new.task.as_str())),
        (payload, Cow::Borrowed(new.payload.as_str())),
    ];
    if let Some(t) = new.timeout_ms {
        fields.push(("timeout_ms", t.to_string().into()));
    }
    if let Some(key) = &new.idempotency_key {
        fields.push(("idempotency_key", Cow::Borrowed(key)));
    }
    if let Some(at) = new.expires_at {
        fields.push(("expires_at", at.to_string().into()));
    }
    if new.run_at > new.now {
        fields.push(("run_at", new.run_at.to_string().into()));
    }
    if let Some(group) = &new.group {
        fields.push(("group", Cow::Borrowed(group)));
    }
    if let Some(traceparent) = &new.traceparent {
        fields.push((carried::TRACEPARENT, Cow::Borrowed(traceparent)));
    }
    if let Some(parent) = &new.parent {
        fields.push(("parent", Cow::Borrowed(parent)));
    }
    fields.push(("budget", max_attempts.into()));
    fields.push(("created_at", now.into()));
    fields.push(("id", Cow::Borrowed(&new.id)));
    fields.push(("queue", Cow::Borrowed(&new.queue)));
    fields.push(("fingerprint", Cow::Borrowed(&new.fingerprint)));
    fields
}

/// What one ingest call did.
enum Ingested {
    /// What the submission came to.
    Done(SubmitOutcome),
    /// Nothing: the queue's partition count, as the partition's slot holds
    /// it, is not the one the task was routed by (see `partitions.rs`).
    Repartitioned(u32),
    /// Nothing: the key's records live in this partition, to which a DLQ
    /// requeue forwarded the key (see `dlq.rs`).
    Forwarded(u32),
}

/// Most forwards one submission follows: a forward leads to the partition
/// of a task, whose record is a plain one, so one is the most a
/// submission meets unless records were written by hand.
const MAX_FORWARDS: u32 = 4;

/// The partition a submission forwarded to `to` goes to (`followed`
/// counts the forwards it met): `to`, unless it is where the submission
/// was (a forward to itself, which no script writes) or forwards keep
/// coming.
fn follow_forward(new: &NewTask, to: u32, followed: &mut u32) -> Result<u32, StoreError> {
    *followed += 1;
    if to == partition_of_id(&new.id) || *followed > MAX_FORWARDS {
        return Err(StoreError::Corrupt(format!(
            "the idempotency key of a submission to {} forwards in a loop (partition {to})",
            new.queue
        )));
    }
    Ok(to)
}

/// What the ingest script's `reply` says.
fn ingested(reply: Vec<Value>) -> Result<Ingested, StoreError> {
    let mut reply = reply.into_iter();
    let code = code_of(reply.next())?;
    let second = reply.next();
    Ok(Ingested::Done(match code {
        Code::Ok => {
            let status: String = from_value(reply.next())?;
            SubmitOutcome::Created {
                status: status.parse()?,
            }
        }
        Code::Replay => {
            SubmitOutcome::Replay(Box::new(TaskRecord::from_flat(from_value(reply.next())?)?))
        }
        Code::InProgress => SubmitOutcome::InProgress {
            task_id: from_value(second)?,
        },
        Code::KeyMismatch => SubmitOutcome::KeyMismatch {
            task_id: from_value(second)?,
        },
        Code::QueueFull => SubmitOutcome::QueueFull {
            depth: from_value(second)?,
        },
        Code::Repartitioned => return Ok(Ingested::Repartitioned(from_value(second)?)),
        Code::Forwarded => return Ok(Ingested::Forwarded(from_value(second)?)),
        other => return Err(unexpected("ingest", other)),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every [`argv`] constant, by the name `ingest.lua` gives it.
    const NAMED: [(&str, usize); 16] = [
        ("TASK_ID", argv::TASK_ID),
        ("NOW", argv::NOW),
        ("HAS_KEY", argv::HAS_KEY),
        ("FINGERPRINT", argv::FINGERPRINT),
        ("IDEM_TTL", argv::IDEM_TTL),
        ("MAX_DEPTH", argv::MAX_DEPTH),
        ("RUN_AT", argv::RUN_AT),
        ("EVENTS_MAX_LEN", argv::EVENTS_MAX_LEN),
        ("TASK_PREFIX", argv::TASK_PREFIX),
        ("INDEX_MIN_ID", argv::INDEX_MIN_ID),
        ("EXPIRES_AT", argv::EXPIRES_AT),
        ("PARTITIONS", argv::PARTITIONS),
        ("RUN_HEAD", argv::RUN_HEAD),
        ("TRACEPARENT", argv::TRACEPARENT),
        ("FIELDS", argv::FIELDS),
        ("PAYLOAD", argv::PAYLOAD),
    ];

    fn task(key: Option<&str>, expires_at: Option<u64>) -> NewTask {
        NewTask {
            id: "0190-a.2".into(),
            queue: "q".into(),
            task: "echo".into(),
            payload: r#"{"n":1}"#.into(),
            fingerprint: "f00d".into(),
            idempotency_key: key.map(str::to_owned),
            max_attempts: 3,
            timeout_ms: Some(500),
            now: 1_000,
            run_at: 1_000,
            expires_at,
            group: None,
            traceparent: None,
            parent: None,
        }
    }

    fn argv_of(new: &NewTask) -> Vec<String> {
        let keys = QueueKeys::of_task(&new.queue, &new.id);
        let context = IngestContext {
            idem_ttl_s: 86_400,
            max_depth: 7,
            events_max_len: 10_000,
            index_min_id: String::new(),
            partitions: 4,
        };
        ingest_argv(new, &keys, context)
            .into_iter()
            .map(Cow::into_owned)
            .collect()
    }

    #[test]
    fn the_script_names_each_argument_as_the_host_numbers_it() {
        let script = include_str!("lua/ingest.lua");
        for (name, index) in NAMED {
            let local = format!("local {name} = {index}\n");
            assert!(
                script.contains(&local),
                "ingest.lua lacks `{}`",
                local.trim()
            );
        }
        let header = &script[..script.find("]]").expect("a header")];
        for (name, _) in NAMED {
            assert!(
                header.contains(name),
                "ingest.lua's header does not list {name}"
            );
        }
    }

    #[test]
    fn each_argument_is_at_its_index() {
        for new in [task(None, None), task(Some("k"), Some(9_000))] {
            let args = argv_of(&new);
            let at = |i: usize| args[i - 1].as_str();
            assert_eq!(at(argv::TASK_ID), new.id);
            assert_eq!(at(argv::NOW), "1000");
            assert_eq!(at(argv::HAS_KEY), flag(new.idempotency_key.is_some()));
            assert_eq!(at(argv::FINGERPRINT), "f00d");
            assert_eq!(at(argv::IDEM_TTL), "86400");
            assert_eq!(at(argv::MAX_DEPTH), "7");
            assert_eq!(at(argv::RUN_AT), "1000");
            assert_eq!(at(argv::EVENTS_MAX_LEN), "10000");
            assert!(at(argv::TASK_PREFIX).ends_with(':'));
            assert_eq!(at(argv::INDEX_MIN_ID), "");
            let expires = new.expires_at.map(|e| e.to_string()).unwrap_or_default();
            assert_eq!(at(argv::EXPIRES_AT), expires);
            assert_eq!(at(argv::PARTITIONS), "4");
            let head = carried::run_head(&new).unwrap_or_default();
            assert_eq!(at(argv::RUN_HEAD), head);
            assert_eq!(at(argv::TRACEPARENT), "");
            assert_eq!(at(argv::PAYLOAD - 1), "payload");
            assert_eq!(at(argv::PAYLOAD), new.payload);
            let names: Vec<&str> = args[argv::FIELDS - 1..]
                .iter()
                .step_by(2)
                .map(String::as_str)
                .collect();
            assert_eq!(names[..LEADING_FIELDS.len()], LEADING_FIELDS);
            assert_eq!(
                (args.len() - argv::FIELDS + 1) % 2,
                0,
                "fields come in pairs"
            );
        }
    }
}
