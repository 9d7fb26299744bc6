//! The fetch loop's wait, once a whole round found nothing: the two ways it
//! waits for a new message (see `fetch.rs` for when each is used).
//!
//! - [`read_waiting`]: one blocking `XREADGROUP` on every stream, holding
//!   the free slots, which returns with the message that ended it: the
//!   wake-up is that one round trip, and the payload crosses the wire once.
//! - [`any`]: a plain `XREAD` from each group's last delivered id, holding
//!   no slot, after which a round reads what arrived: `XINFO GROUPS`, the
//!   wait, then the read, and the payload twice. It delivers nothing, so it
//!   may be dropped at any time.

use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use redis::streams::StreamInfoGroupsReply;
use tokio::sync::OwnedSemaphorePermit;

use super::fetch::spawn_dispatch;
use super::shared::Admit;
use super::{READ_BLOCK, Shared};
use crate::store::{Conn, GROUP, QueueKeys, StoreError, fresh_deliveries};

/// The stream of each of `queues`, and how the waits group them: one call
/// for all on a single server; on a cluster, one per stream (each its own
/// slot).
pub(super) fn groups(shared: &Shared, queues: &[String]) -> (Vec<String>, Vec<Vec<String>>) {
    let streams: Vec<String> = queues.iter().map(|q| QueueKeys::new(q).stream).collect();
    let waits = if shared.store.backend().is_cluster() {
        streams.iter().map(|s| vec![s.clone()]).collect()
    } else {
        vec![streams.clone()]
    };
    (streams, waits)
}

/// Whether the wait can be [`read_waiting`]: every stream in one call, and
/// at least one of `free` slots for each, so that the read, which takes
/// `COUNT` messages of each stream, cannot deliver more than `free`.
pub(super) fn can_read_waiting(waits: &[Vec<String>], free: usize) -> bool {
    matches!(waits, [streams] if streams.len() <= free)
}

/// Wait up to [`READ_BLOCK`] for a new message of any of `streams` (those
/// of `queues`) with one blocking group read holding `permits` (at least
/// one per stream), and dispatch what it delivers: `free / streams` of
/// each stream at most. The permits it did not use are released on
/// return.
///
/// Not to be cancelled: the server goes on blocking for a dropped read
/// and would deliver into its lost reply, and the message would wait,
/// pending on this worker, for a reclaim. A read that failed may have
/// delivered too, its reply lost: the caller reads back this worker's
/// pending messages.
pub(super) async fn read_waiting(
    shared: &Arc<Shared>,
    conn: &mut Conn,
    queues: &[String],
    streams: &[String],
    mut permits: Vec<OwnedSemaphorePermit>,
) -> Result<(), StoreError> {
    let each = permits.len() / streams.len().max(1);
    let reply: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg(&shared.consumer)
        .arg("COUNT")
        .arg(each)
        .arg("BLOCK")
        .arg(block_ms(READ_BLOCK))
        .arg("STREAMS")
        .arg(streams)
        .arg(vec![">"; streams.len()])
        .query_async(conn)
        .await?;
    for (stream, part) in by_stream(reply)? {
        let Some(at) = streams.iter().position(|s| *s == stream) else {
            return Err(StoreError::Protocol(format!(
                "XREADGROUP answered for stream {stream:?}, not asked"
            )));
        };
        let queue = &queues[at];
        let deliveries = fresh_deliveries(queue, part)?;
        if deliveries.is_empty() {
            continue;
        }
        let batch = permits.split_off(permits.len().saturating_sub(deliveries.len()));
        let holds = shared.running.hold(&queue.as_str().into(), &deliveries);
        spawn_dispatch(shared, queue, deliveries, Admit::Due, holds, batch);
    }
    Ok(())
}

/// The part of a reply of a read of several streams that each stream
/// answered, as a reply of its own (`[[stream, entries]]` in RESP2, a map
/// of one stream in RESP3), with the stream's name. Nothing when the read
/// timed out.
fn by_stream(reply: Value) -> Result<Vec<(String, Value)>, StoreError> {
    let unexpected = |what: &Value| StoreError::Protocol(format!("XREADGROUP answered {what:?}"));
    let name = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).map_err(|_| unexpected(v)),
        Value::SimpleString(s) => Ok(s.clone()),
        other => Err(unexpected(other)),
    };
    match reply {
        Value::Nil => Ok(Vec::new()),
        Value::Map(pairs) => pairs
            .into_iter()
            .map(|(k, v)| Ok((name(&k)?, Value::Map(vec![(k, v)]))))
            .collect(),
        Value::Array(streams) => streams
            .into_iter()
            .map(|stream| {
                let named = match &stream {
                    Value::Array(pair) => pair.first().map(name),
                    _ => None,
                };
                match named {
                    Some(named) => Ok((named?, Value::Array(vec![stream]))),
                    None => Err(unexpected(&stream)),
                }
            })
            .collect(),
        other => Err(unexpected(&other)),
    }
}

/// Wait on every group of `waits` at once ([`for_messages`]): on `conn`
/// when there is one group (a single server), else each on its own
/// connection of `wait_conns` (opened when missing), until the first
/// returns.
pub(super) async fn any(
    shared: &Shared,
    conn: &mut Conn,
    wait_conns: &mut [Option<Conn>],
    waits: &[Vec<String>],
) -> Result<(), StoreError> {
    if let [streams] = waits {
        return for_messages(conn, streams, READ_BLOCK).await;
    }
    for slot in wait_conns.iter_mut().filter(|c| c.is_none()) {
        *slot = Some(
            shared
                .store
                .dedicated_connection(READ_BLOCK + Duration::from_secs(5))
                .await?,
        );
    }
    let calls = wait_conns
        .iter_mut()
        .zip(waits)
        .filter_map(|(c, streams)| Some(Box::pin(for_messages(c.as_mut()?, streams, READ_BLOCK))));
    let (first, _, _) = futures::future::select_all(calls).await;
    first
}

/// Wait until one of `streams` has a message its group has not delivered,
/// or `block` has passed; delivers nothing, so it may be dropped at any
/// time. All `streams` are waited on in one call: under Redis Cluster they
/// must share a slot.
async fn for_messages(
    conn: &mut Conn,
    streams: &[String],
    block: Duration,
) -> Result<(), StoreError> {
    let mut pipe = redis::pipe();
    for stream in streams {
        pipe.cmd("XINFO").arg("GROUPS").arg(stream);
    }
    let infos: Vec<StreamInfoGroupsReply> = pipe.query_async(conn).await?;
    let mut read = redis::cmd("XREAD");
    read.arg("COUNT")
        .arg(1)
        .arg("BLOCK")
        .arg(block_ms(block))
        .arg("STREAMS")
        .arg(streams);
    for info in &infos {
        let last = info
            .groups
            .iter()
            .find(|g| g.name == GROUP)
            .map_or("$", |g| g.last_delivered_id.as_str());
        read.arg(last);
    }
    let _: Value = read.query_async(conn).await?;
    Ok(())
}

/// `BLOCK`'s argument: milliseconds, at least one (0 blocks forever).
fn block_ms(block: Duration) -> u64 {
    block.as_millis().max(1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn entry(id: &str, task: &str) -> Value {
        Value::Array(vec![bulk(id), Value::Array(vec![bulk("id"), bulk(task)])])
    }

    #[test]
    fn a_read_of_several_streams_is_split_by_stream_in_either_protocol() {
        let a = Value::Array(vec![entry("1-0", "t1"), entry("2-0", "t2")]);
        let b = Value::Array(vec![entry("1-0", "t3")]);
        let resp2 = Value::Array(vec![
            Value::Array(vec![bulk("sa"), a.clone()]),
            Value::Array(vec![bulk("sb"), b.clone()]),
        ]);
        let resp3 = Value::Map(vec![(bulk("sa"), a), (bulk("sb"), b)]);
        for reply in [resp2, resp3] {
            let parts = by_stream(reply).expect("a well-formed reply");
            let tasks: Vec<(String, Vec<String>)> = parts
                .into_iter()
                .map(|(stream, part)| {
                    let ids = fresh_deliveries("q", part)
                        .expect("entries")
                        .into_iter()
                        .map(|d| d.task_id)
                        .collect();
                    (stream, ids)
                })
                .collect();
            assert_eq!(
                tasks,
                [
                    ("sa".to_owned(), vec!["t1".to_owned(), "t2".to_owned()]),
                    ("sb".to_owned(), vec!["t3".to_owned()]),
                ]
            );
        }
        assert!(by_stream(Value::Nil).expect("a timeout").is_empty());
        assert!(by_stream(Value::Int(1)).is_err());
    }

    #[test]
    fn the_read_waits_only_when_it_cannot_deliver_more_than_the_free_slots() {
        let one = vec![vec!["a".to_owned(), "b".to_owned()]];
        assert!(can_read_waiting(&one, 2));
        assert!(can_read_waiting(&one, 64));
        assert!(!can_read_waiting(&one, 1));
        // A cluster: a call per stream.
        let per_stream = vec![vec!["a".to_owned()], vec!["b".to_owned()]];
        assert!(!can_read_waiting(&per_stream, 64));
        let one_stream = vec![vec!["a".to_owned()]];
        assert!(can_read_waiting(&one_stream, 1));
    }
}
