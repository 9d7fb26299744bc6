//! A queue's limits ([`Limits`]: a fleet-wide rate of starts, and running
//! tasks per group), kept in [`LIMITS`], and the admission of a batch of
//! fetched messages under them (`lua/include/admission.lua`).
//!
//! Workers read the limits of their queues with the pause state, every
//! [`PAUSE_POLL`](super::PAUSE_POLL). The fetch loop reads a queue that
//! has some with [`Store::read_admitted`], which admits what it reads in
//! the same round trip (`lua/read_admit.lua`); messages delivered another
//! way (a wait, a reclaim, a read back) are admitted by [`Store::admit`]
//! before they start (`lua/admit.lua`). A queue without limits pays
//! nothing. What the script counts lives in each partition's own slot, so
//! under Redis Cluster a queue's partitions count apart: a queue of one
//! partition is limited exactly, a partitioned one has its rate split
//! evenly among its partitions (rounded down, at least one start per window
//! each) and its group limit applied in each partition.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use redis::{ScriptInvocation, Value};

use super::scripts::{Argv, ArgvLayout};
use super::{Conn, Delivery, GROUP, LIMITS, QueueKeys, Store, StoreError, entries};

/// The longest `group` a submission may carry, in bytes.
pub const MAX_GROUP_BYTES: usize = 128;

/// How long a task held by its group waits before it is looked at again,
/// the first time; it doubles with each hold, up to 16 times this.
const GROUP_RETRY: Duration = Duration::from_millis(100);

/// At most `limit` task starts per window of `per_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// Starts per window.
    #[serde(deserialize_with = "whole")]
    pub limit: u32,
    /// The window (ms).
    #[serde(deserialize_with = "whole")]
    pub per_ms: u64,
}

/// A queue's limits; `None` for a limit it does not have.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Task starts across the fleet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// Running tasks of one `group` across the fleet.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole_or_null"
    )]
    pub group_concurrency: Option<u32>,
}

/// A whole number, also when written as one with a zero fraction (`20.0`,
/// which JSON Schema counts as an integer).
fn whole<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<u64>,
{
    let n = serde_json::Number::deserialize(d)?;
    let whole = n.as_u64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= u64::MAX as f64)
            .map(|f| f as u64)
    });
    whole
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| serde::de::Error::custom(format!("{n} is not a whole number in range")))
}

/// [`whole`], or `null`.
fn whole_or_null<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<u64>,
{
    #[derive(Deserialize)]
    struct Whole<T: TryFrom<u64>>(#[serde(deserialize_with = "whole")] T);
    Ok(Option::<Whole<T>>::deserialize(d)?.map(|Whole(n)| n))
}

impl Limits {
    /// Whether there is any limit at all.
    pub fn any(&self) -> bool {
        self.rate.is_some() || self.group_concurrency.is_some()
    }
}

/// What [`Store::admit`] decided for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// It may start.
    Admitted,
    /// Held until the rate limit's next window; out of the stream.
    HeldByRate,
    /// Held until a slot of its group may be free; out of the stream.
    HeldByGroup,
}

/// The ARGV names of `lua/include/admission.lua`, first in the layout of
/// each script that includes it, then `$rest`.
macro_rules! admission_names {
    ($($rest:literal),*) => {
        &[
            "GROUP",
            "NOW",
            "RATE_LIMIT",
            "RATE_PER_MS",
            "GROUP_LIMIT",
            "GROUP_PREFIX",
            "TASK_PREFIX",
            "GROUP_RETRY_MS",
            "ADMIT_GRACE_MS",
            $($rest),*
        ]
    };
}

/// `admit.lua`'s ARGV by name; then, from `DELIVERIES`, a message id and a
/// task id per delivery.
pub(super) static ADMIT_ARGV: ArgvLayout = ArgvLayout {
    script: "admit",
    prefix: "ARG_",
    first: 1,
    names: admission_names!(),
    rest: Some("DELIVERIES"),
};

/// `read_admit.lua`'s ARGV by name.
pub(super) static READ_ADMIT_ARGV: ArgvLayout = ArgvLayout {
    script: "read_admit",
    prefix: "ARG_",
    first: 1,
    names: admission_names!("CONSUMER", "COUNT"),
    rest: None,
};

/// What a read of new messages gave ([`Store::read_admitted`], or a plain
/// read): how many messages, and those to start.
#[derive(Debug, Default)]
pub struct ReadAdmitted {
    /// Messages the read delivered, admitted or held.
    pub read: usize,
    /// Those to start: for [`Store::read_admitted`], the admitted ones
    /// (those naming no task left out).
    pub deliveries: Vec<Delivery>,
}

/// The keys and the arguments of `lua/include/admission.lua` for partition
/// `queue` (its `keys`, one of `partitions`) under `limits` at `now`, into
/// `inv` under `layout`: the script's own arguments follow.
fn admission<'i, 's>(
    inv: &'i mut ScriptInvocation<'s>,
    layout: &'static ArgvLayout,
    keys: &QueueKeys,
    limits: &Limits,
    partitions: u32,
    grace: Duration,
    now: u64,
) -> Argv<'i, ScriptInvocation<'s>> {
    inv.key(&keys.stream).key(&keys.delayed).key(keys.rate());
    let (rate_limit, per_ms) = limits.rate.map_or((0, 1), |rate| {
        ((rate.limit / partitions.max(1)).max(1), rate.per_ms.max(1))
    });
    Argv::new(inv, layout)
        .put("GROUP", GROUP)
        .put("NOW", now)
        .put("RATE_LIMIT", rate_limit)
        .put("RATE_PER_MS", per_ms)
        .put("GROUP_LIMIT", limits.group_concurrency.unwrap_or(0))
        .put("GROUP_PREFIX", keys.group_prefix())
        .put("TASK_PREFIX", keys.task_prefix())
        .put("GROUP_RETRY_MS", GROUP_RETRY.as_millis() as u64)
        .put("ADMIT_GRACE_MS", grace.as_millis() as u64)
}

impl Store {
    /// Set `queue`'s limits (all of them: a limit not in `limits` is
    /// lifted).
    pub async fn set_limits(&self, queue: &str, limits: &Limits) -> Result<(), StoreError> {
        let json = serde_json::to_string(limits).expect("limits serialize");
        self.trip(
            "limits",
            redis::cmd("HSET")
                .arg(LIMITS)
                .arg(queue)
                .arg(json)
                .query_async::<()>(&mut self.conn.clone()),
        )
        .await?;
        Ok(())
    }

    /// Lift every limit of `queue`. Whether it had any.
    pub async fn delete_limits(&self, queue: &str) -> Result<bool, StoreError> {
        let removed: u32 = self
            .trip(
                "limits",
                redis::cmd("HDEL")
                    .arg(LIMITS)
                    .arg(queue)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(removed > 0)
    }

    /// The limits of each of `queues` that has some, in one round trip.
    /// A record that does not parse counts as no limits (and is logged by
    /// the caller's next set).
    pub async fn limits_of(
        &self,
        queues: &[String],
    ) -> Result<HashMap<String, Limits>, StoreError> {
        if queues.is_empty() {
            return Ok(HashMap::new());
        }
        let records: Vec<Option<String>> = self
            .trip(
                "limits",
                redis::cmd("HMGET")
                    .arg(LIMITS)
                    .arg(queues)
                    .query_async(&mut self.conn.clone()),
            )
            .await?;
        Ok(queues
            .iter()
            .zip(records)
            .filter_map(|(queue, record)| {
                let limits: Limits = serde_json::from_str(record.as_deref()?).ok()?;
                limits.any().then(|| (queue.clone(), limits))
            })
            .collect())
    }

    /// Admit `deliveries` of partition `queue` (one of `partitions`) under
    /// `limits` before they start; see `lua/admit.lua`. The held ones are
    /// out of the stream already. A task admitted but never started gives
    /// its group slot back after `grace`.
    pub async fn admit(
        &self,
        queue: &str,
        deliveries: &[Delivery],
        limits: &Limits,
        partitions: u32,
        grace: Duration,
        now: u64,
    ) -> Result<Vec<Admission>, StoreError> {
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.admit.prepare_invoke();
        admission(&mut inv, &ADMIT_ARGV, &keys, limits, partitions, grace, now).done();
        for d in deliveries {
            inv.key(keys.task(&d.task_id))
                .arg(&d.msg_id)
                .arg(&d.task_id);
        }
        let codes: Vec<i64> = self
            .trip("admit", inv.invoke_async(&mut self.conn.clone()))
            .await?;
        if codes.len() != deliveries.len() {
            return Err(StoreError::Protocol(format!(
                "admit answered {} decisions for {} messages",
                codes.len(),
                deliveries.len()
            )));
        }
        codes
            .into_iter()
            .map(|code| match code {
                1 => Ok(Admission::Admitted),
                2 => Ok(Admission::HeldByRate),
                3 => Ok(Admission::HeldByGroup),
                other => Err(StoreError::Protocol(format!("admit answered code {other}"))),
            })
            .collect()
    }

    /// Read up to `count` new messages of partition `queue` (one of
    /// `partitions`) for `consumer` on `conn` and admit them under
    /// `limits`, in one round trip (`lua/read_admit.lua`): what
    /// [`Store::admit`] decides of a batch [`Store::read`] delivered,
    /// without the second round trip. Never blocks. `conn` is a dedicated
    /// connection, as for [`Store::read`]; not to be cancelled, as a read.
    #[allow(
        clippy::too_many_arguments,
        reason = "a read's and an admission's inputs"
    )]
    pub async fn read_admitted(
        &self,
        conn: &mut Conn,
        queue: &str,
        consumer: &str,
        count: usize,
        limits: &Limits,
        partitions: u32,
        grace: Duration,
        now: u64,
    ) -> Result<ReadAdmitted, StoreError> {
        let keys = QueueKeys::new(queue);
        let mut inv = self.scripts.read_admit.prepare_invoke();
        admission(
            &mut inv,
            &READ_ADMIT_ARGV,
            &keys,
            limits,
            partitions,
            grace,
            now,
        )
        .put("CONSUMER", consumer)
        .put("COUNT", count)
        .done();
        let reply: Vec<Value> = self.trip("read_admit", inv.invoke_async(conn)).await?;
        let mut reply = reply.into_iter();
        let read = match reply.next() {
            Some(Value::Int(n)) => usize::try_from(n).ok(),
            _ => None,
        }
        .ok_or_else(|| StoreError::Protocol("read_admit answered no count".into()))?;
        Ok(ReadAdmitted {
            read,
            deliveries: entries::flat_deliveries(queue, reply)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Limits, Rate};

    #[test]
    fn limits_read_whole_numbers_written_either_way() {
        let read = |text: &str| serde_json::from_str::<Limits>(text);
        let want = Limits {
            rate: Some(Rate {
                limit: 20,
                per_ms: 1000,
            }),
            group_concurrency: Some(2),
        };
        for text in [
            r#"{"rate": {"limit": 20, "per_ms": 1000}, "group_concurrency": 2}"#,
            r#"{"rate": {"limit": 20.0, "per_ms": 1000.0}, "group_concurrency": 2.0}"#,
        ] {
            assert_eq!(read(text).expect(text), want);
        }
        assert_eq!(
            read(r#"{"group_concurrency": null}"#).expect("null"),
            Limits::default()
        );
        for bad in [
            r#"{"rate": {"limit": 2.5, "per_ms": 1000}}"#,
            r#"{"rate": {"limit": -1, "per_ms": 1000}}"#,
            r#"{"rate": {"limit": 5000000000, "per_ms": 1000}}"#,
            r#"{"group_concurrency": "2"}"#,
            r#"{"rate": {"limit": 1, "per_ms": 1, "burst": 1}}"#,
        ] {
            assert!(read(bad).is_err(), "{bad}");
        }
    }
}
