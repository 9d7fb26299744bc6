//! What dtq connects to: one Redis server, a Redis Cluster, or a master
//! behind Redis Sentinel.
//!
//! [`Backend::open`] takes the `--redis` setting: a `redis+sentinel://`
//! URL (see [`super::sentinel`]), or one `redis://` URL or several
//! separated by commas, in which case it asks the first node that answers
//! whether it runs in cluster mode (`INFO cluster`). From then on it hands
//! out [`Conn`]s of the matching kind. Everything above speaks to a [`Conn`]
//! through [`redis::aio::ConnectionLike`], so a script, a command or a
//! pipeline is written once:
//!
//! - single node: a [`ConnectionManager`] (multiplexed, reconnects by
//!   itself), with the server's address, which a refusal names;
//! - Sentinel: a [`SentinelConn`], a connection manager to the master the
//!   Sentinels name, which asks them again after a failure a failover
//!   explains and moves to the new master;
//! - cluster: a [`ClusterConnection`], which routes each command and each
//!   script by its first key's slot, follows MOVED and ASK, and refreshes
//!   its slot map after a failover. A pipeline is sent to one node, so
//!   every command of one pipeline must be in one slot (dtq's pipelines
//!   each touch one queue, or are split per queue in cluster mode). It is
//!   watched ([`WatchedCluster`]): one that stops answering for good is
//!   replaced.
//!
//! Notices (a cancel of a running task, a registry change) travel over
//! pub/sub. On a single node that is plain `PUBLISH`/`SUBSCRIBE`; on a
//! cluster it is sharded pub/sub (`SPUBLISH`/`SSUBSCRIBE`): each channel
//! carries a hash tag and lives on the shard of the keys it is about, so a
//! notice costs one shard, not a broadcast over the cluster bus. The
//! scripts that publish are told which command to use
//! ([`Conn::publish_command`]), and [`Backend::subscribe`] subscribes the
//! matching way.
//!
//! # A Redis that is not there
//!
//! A refused connection is said as such, with the address and what to
//! check ([`explain_refusal`]), whether at start or while running. While
//! running, a command on a broken connection waits for the manager's
//! reconnection, whose tries ([`RECONNECT_TRIES`]) all end well within
//! the API's deadline for a Redis call (`--api-redis-timeout-ms`, 1 s by
//! default) when nothing listens: so a refusal is answered as a refusal,
//! and "did not answer within ..." is left to a Redis that is there and
//! does not answer.

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt as _, TryFutureExt as _};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use super::StoreError;
use super::sentinel::{self, SentinelConn, Sentinels};
use super::watched::WatchedCluster;

/// How long a new connection may take to be established.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest pause between two tries to reconnect a dropped connection. The
/// client's default doubles from 100 ms over its six tries, so a link that
/// broke a few times in a row could stay down for seconds after Redis was
/// reachable again: heartbeats and reads waited behind it, and a live
/// worker risked looking dead. Capped, it is back within this of Redis
/// answering.
const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(250);

/// Tries after the first of one reconnection, before a command waiting on
/// it fails (the next command starts another). Each pause is 100 ms, then
/// doubled, capped at [`RECONNECT_MAX_DELAY`], plus jitter of up to as
/// much again: two keep a refused reconnection under 600 ms, where the
/// client's six took 1.3 to 2.6 s, past the API's deadline, which then
/// reported a refusal as a Redis that did not answer.
const RECONNECT_TRIES: usize = 2;

/// How long a cluster connection may go without answering while calls
/// wait, beyond twice its response timeout, before it is replaced
/// ([`WatchedCluster`]): a failover's retries end well within it.
const CLUSTER_STALL_FLOOR: Duration = Duration::from_secs(20);

/// The Redis deployment a process talks to.
#[derive(Clone)]
pub enum Backend {
    /// One server (or a primary behind a fixed address).
    Single(redis::Client),
    /// The master a set of Sentinels watches, wherever it is now.
    Sentinel(std::sync::Arc<Sentinels>),
    /// A Redis Cluster, reached through any of `nodes`.
    Cluster {
        /// The URLs given, each a node to discover the cluster from.
        nodes: Vec<String>,
    },
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Single(_) => f.write_str("Backend::Single"),
            Backend::Sentinel(sentinels) => write!(f, "Backend::{sentinels:?}"),
            Backend::Cluster { nodes } => write!(f, "Backend::Cluster({} nodes)", nodes.len()),
        }
    }
}

impl Backend {
    /// Parse `urls` (comma-separated `redis://` URLs) and find out, from
    /// the first node that answers, whether it is a cluster node. Several
    /// URLs name nodes of one cluster; they are tried in order.
    pub async fn open(urls: &str) -> Result<Backend, StoreError> {
        if urls.trim_start().starts_with(sentinel::SCHEME) {
            let sentinels = Sentinels::from_url(urls.trim())?;
            // Fail now, as a bad `redis://` URL does, if no Sentinel answers.
            sentinels.master().await?;
            return Ok(Backend::Sentinel(std::sync::Arc::new(sentinels)));
        }
        let nodes: Vec<String> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        if nodes.is_empty() {
            return Err(StoreError::Protocol("no Redis URL given".into()));
        }
        let mut last_err = None;
        for url in &nodes {
            let client = redis::Client::open(url.as_str())?;
            let probe = async {
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(
                        &redis::AsyncConnectionConfig::new()
                            .set_connection_timeout(Some(CONNECT_TIMEOUT))
                            .set_response_timeout(Some(CONNECT_TIMEOUT)),
                    )
                    .await?;
                redis::cmd("INFO")
                    .arg("cluster")
                    .query_async::<String>(&mut conn)
                    .await
            };
            match probe.await {
                Ok(info) if cluster_enabled(&info) => {
                    return Ok(Backend::Cluster { nodes });
                }
                Ok(_) if nodes.len() > 1 => {
                    return Err(StoreError::Protocol(format!(
                        "{} Redis URLs were given, but {url} is not a cluster node; \
                         give one URL for a single server",
                        nodes.len()
                    )));
                }
                Ok(_) => return Ok(Backend::Single(client)),
                Err(e) => last_err = Some(explain_refusal(e, &address(&client))),
            }
        }
        Err(last_err.map_or_else(
            || StoreError::Protocol("no Redis node answered".into()),
            StoreError::Redis,
        ))
    }

    /// Whether this is a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Backend::Cluster { .. })
    }

    /// A new connection whose replies may take up to `response_timeout`.
    /// Each call opens connections of its own: one for a blocking read
    /// stalls nothing else (on a cluster, one connection per shard).
    pub async fn connect(&self, response_timeout: Duration) -> Result<Conn, StoreError> {
        let config = ConnectionManagerConfig::new()
            .set_max_delay(RECONNECT_MAX_DELAY)
            .set_number_of_retries(RECONNECT_TRIES)
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(response_timeout));
        match self {
            Backend::Single(client) => {
                let addr: Arc<str> = address(client).into();
                let manager = client
                    .get_connection_manager_with_config(config)
                    .await
                    .map_err(|e| explain_refusal(e, &addr))?;
                Ok(Conn::Server(manager, addr))
            }
            Backend::Sentinel(sentinels) => Ok(Conn::Sentinel(
                SentinelConn::connect(sentinels.clone(), config).await?,
            )),
            Backend::Cluster { nodes } => {
                let client = self.cluster_client(nodes, response_timeout, None)?;
                let stall = CLUSTER_STALL_FLOOR + 2 * response_timeout;
                Ok(Conn::Cluster(WatchedCluster::connect(client, stall).await?))
            }
        }
    }

    /// Subscribe to `channels`, the way [`Conn::publish_command`] publishes
    /// (`SUBSCRIBE` or `SSUBSCRIBE`).
    pub async fn subscribe(&self, channels: &[String]) -> Result<Subscription, StoreError> {
        let client = match self {
            Backend::Single(client) => client.clone(),
            // Resubscribing after the stream ends asks again, so a
            // subscription follows a failover too.
            Backend::Sentinel(sentinels) => sentinels.master().await?,
            Backend::Cluster { nodes } => return self.subscribe_sharded(nodes, channels).await,
        };
        let mut pubsub = client.get_async_pubsub().await?;
        for channel in channels {
            pubsub.subscribe(channel).await?;
        }
        Ok(Subscription::Single(Box::new(pubsub.into_on_message())))
    }

    /// Sharded pub/sub on a cluster.
    async fn subscribe_sharded(
        &self,
        nodes: &[String],
        channels: &[String],
    ) -> Result<Subscription, StoreError> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        // Pushes need RESP3; the client resubscribes by itself after a
        // reconnection or a failover.
        let client = self.cluster_client(nodes, CONNECT_TIMEOUT, Some(tx))?;
        let mut conn = client.get_async_connection().await?;
        for channel in channels {
            conn.ssubscribe(channel).await?;
        }
        Ok(Subscription::Cluster { _conn: conn, rx })
    }

    fn cluster_client(
        &self,
        nodes: &[String],
        response_timeout: Duration,
        pushes: Option<tokio::sync::mpsc::UnboundedSender<redis::PushInfo>>,
    ) -> Result<ClusterClient, StoreError> {
        let mut builder = ClusterClientBuilder::new(nodes.to_vec())
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(response_timeout)
            // A failover takes the cluster a few node timeouts; a command
            // retried through it (MOVED, CLUSTERDOWN, a dropped link) waits
            // up to about this long in all before it fails.
            .retries(8)
            .min_retry_wait(50)
            .max_retry_wait(2_000);
        if let Some(tx) = pushes {
            builder = builder
                .use_protocol(redis::ProtocolVersion::RESP3)
                .push_sender(tx);
        }
        Ok(builder.build()?)
    }
}

/// The address of `client`'s server, as a refusal names it
/// (`127.0.0.1:6379`, or a socket's path).
fn address(client: &redis::Client) -> String {
    client.get_connection_info().addr().to_string()
}

/// A refused connection (nothing listens at `address`), said with the
/// address and what to check; any other error as it is. It stays an I/O
/// error of kind `ConnectionRefused`, so whatever classifies errors sees
/// the same error.
pub(super) fn explain_refusal(error: redis::RedisError, address: &str) -> redis::RedisError {
    if !error.is_connection_refusal() {
        return error;
    }
    std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!(
            "Redis at {address} refused the connection: nothing accepts connections \
             there; is redis-server running, and is {address} its address (--redis, \
             DTQ_REDIS_URL)?"
        ),
    )
    .into()
}

/// Whether `INFO cluster` says the node runs in cluster mode.
fn cluster_enabled(info: &str) -> bool {
    info.lines().any(|l| l.trim() == "cluster_enabled:1")
}

/// A connection to the [`Backend`]: multiplexed, cheap to clone (clones
/// share it), reconnecting by itself.
#[derive(Clone)]
pub enum Conn {
    /// To a single server, its address unknown (a connection made by
    /// hand: [`Backend::connect`] makes a [`Conn::Server`]).
    Single(ConnectionManager),
    /// To a single server at the address it holds, which a refused
    /// connection's error names (`explain_refusal`).
    Server(ConnectionManager, Arc<str>),
    /// To the master behind Sentinel.
    Sentinel(SentinelConn),
    /// To a cluster: one link per node, commands routed by slot, replaced
    /// if it stalls.
    Cluster(WatchedCluster),
}

impl Conn {
    /// The command the scripts publish notices with: `PUBLISH` on a
    /// single node, `SPUBLISH` (sharded, to the channel's own shard) on a
    /// cluster. Channels carry a hash tag, so they share the slot of the
    /// keys of the script that publishes.
    pub fn publish_command(&self) -> &'static str {
        match self {
            Conn::Single(_) | Conn::Server(..) | Conn::Sentinel(_) => "PUBLISH",
            Conn::Cluster(_) => "SPUBLISH",
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Server(c, address) => {
                let address = address.clone();
                Box::pin(
                    c.req_packed_command(cmd)
                        .map_err(move |e| explain_refusal(e, &address)),
                )
            }
            Conn::Sentinel(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Server(c, address) => {
                let address = address.clone();
                Box::pin(
                    c.req_packed_commands(pipeline, offset, count)
                        .map_err(move |e| explain_refusal(e, &address)),
                )
            }
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) | Conn::Server(c, _) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Messages of the channels [`Backend::subscribe`] subscribed to.
pub enum Subscription {
    /// Plain pub/sub on one server.
    Single(Box<redis::aio::PubSubStream>),
    /// Sharded pub/sub on a cluster: pushes of the subscribing connection.
    Cluster {
        /// Held so that the subscription lives as long as this value.
        _conn: ClusterConnection,
        /// Every push the connection receives (confirmations too).
        rx: tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>,
    },
}

impl Subscription {
    /// The next message's payload, or `None` once the subscription is
    /// gone (the connection dropped for good: subscribe again).
    pub async fn next_payload(&mut self) -> Option<Vec<u8>> {
        match self {
            Subscription::Single(stream) => {
                let msg = stream.next().await?;
                Some(msg.get_payload_bytes().to_vec())
            }
            Subscription::Cluster { rx, .. } => loop {
                let push = rx.recv().await?;
                // `smessage` pushes are [channel, payload]; the rest
                // (subscribe confirmations, disconnections) carry none.
                if push.kind == redis::PushKind::SMessage
                    && let Some(Value::BulkString(payload)) = push.data.into_iter().nth(1)
                {
                    return Some(payload);
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_the_address_and_the_setting_and_stays_a_refusal() {
        let refused: redis::RedisError =
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        let explained = explain_refusal(refused, "127.0.0.1:1");
        let text = explained.to_string();
        assert!(
            text.contains("127.0.0.1:1 refused the connection") && text.contains("DTQ_REDIS_URL"),
            "{text}"
        );
        assert!(explained.is_connection_refusal() && explained.is_io_error());
        // Anything else is left as it is.
        let timeout: redis::RedisError = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        let same = explain_refusal(timeout, "127.0.0.1:1").to_string();
        assert!(!same.contains("refused"), "{same}");
    }

    #[test]
    fn cluster_mode_is_read_from_info() {
        assert!(cluster_enabled("# Cluster\r\ncluster_enabled:1\r\n"));
        assert!(!cluster_enabled("# Cluster\r\ncluster_enabled:0\r\n"));
        assert!(!cluster_enabled(""));
    }
}
