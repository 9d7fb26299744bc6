//! Redis behind Sentinel: `--redis redis+sentinel://…`.
//!
//! The URL names the Sentinels and the master they watch:
//!
//! ```text
//! redis+sentinel://[user:password@]host:port[,host:port…]/<master>[/<db>][?sentinel_username=…&sentinel_password=…]
//! ```
//!
//! The user and password are the master's (and its replicas'); the
//! Sentinels' own, when they ask for one, go in the query. A Sentinel's
//! port defaults to 26379.
//!
//! Which server is the master is asked of the Sentinels (the first that
//! answers names it, and the server must say `ROLE` master: redis-rs's
//! [`SentinelClient`] follows the Sentinel client protocol). A
//! [`SentinelConn`] holds a connection to that server and asks again when
//! a command fails the way a failover makes it fail: the link drops or is
//! refused, a reply times out, or the server answers `READONLY` (a former
//! master that came back as a replica). If the Sentinels name another
//! server, later commands go there. The failed command itself is not
//! retried here: it fails like any command on a broken link, and its caller
//! (the API's 503, the worker's backoff) tries again.

use std::sync::{Arc, Mutex};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

use super::StoreError;

/// The URL scheme of a Redis behind Sentinel.
pub const SCHEME: &str = "redis+sentinel://";

/// A Sentinel's port when the URL names none.
const SENTINEL_PORT: u16 = 26379;

/// The Sentinels of one master, shared by every connection to it.
pub struct Sentinels {
    /// Asked for the master; one query at a time.
    client: tokio::sync::Mutex<SentinelClient>,
    /// The master's name, for messages.
    master: String,
}

impl std::fmt::Debug for Sentinels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sentinels({})", self.master)
    }
}

/// What a `redis+sentinel://` URL says.
#[derive(Debug)]
struct SentinelUrl {
    /// `redis://…` URLs of the Sentinels, with their own credentials.
    sentinels: Vec<String>,
    /// The name the Sentinels know the master by.
    master: String,
    /// The master's database and credentials.
    node: redis::RedisConnectionInfo,
}

impl Sentinels {
    /// The Sentinels `url` names; nothing is connected yet.
    pub fn from_url(url: &str) -> Result<Sentinels, StoreError> {
        let parsed = parse(url).map_err(|why| {
            StoreError::Protocol(format!(
                "{why}: expected {SCHEME}[user:password@]host:port[,host:port...]/<master>[/<db>]"
            ))
        })?;
        let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(parsed.node);
        let client = SentinelClient::build(
            parsed.sentinels,
            parsed.master.clone(),
            Some(node),
            SentinelServerType::Master,
        )?;
        Ok(Sentinels {
            client: tokio::sync::Mutex::new(client),
            master: parsed.master,
        })
    }

    /// A client of the server the Sentinels name as the master now.
    pub async fn master(&self) -> Result<redis::Client, StoreError> {
        let mut sentinels = self.client.lock().await;
        sentinels.async_get_client().await.map_err(|e| {
            StoreError::Protocol(format!(
                "no Sentinel named a master for {:?}: {e}",
                self.master
            ))
        })
    }
}

/// A connection to the master of [`Sentinels`], moving to the new master
/// after a failover. Clones share the connection.
#[derive(Clone)]
pub struct SentinelConn {
    sentinels: Arc<Sentinels>,
    config: ConnectionManagerConfig,
    /// The master's address and the connection to it.
    current: Arc<Mutex<(String, ConnectionManager)>>,
    /// Held while the Sentinels are asked again, so that one failover is
    /// followed once, not by every command that saw it.
    following: Arc<tokio::sync::Mutex<()>>,
}

impl SentinelConn {
    /// Connect to the master the Sentinels name.
    pub async fn connect(
        sentinels: Arc<Sentinels>,
        config: ConnectionManagerConfig,
    ) -> Result<SentinelConn, StoreError> {
        let (addr, conn) = open(&sentinels, &config).await?;
        Ok(SentinelConn {
            sentinels,
            config,
            current: Arc::new(Mutex::new((addr, conn))),
            following: Arc::new(tokio::sync::Mutex::new(())),
        })
    }

    fn conn(&self) -> (String, ConnectionManager) {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// After a failure on the connection to `seen`: ask the Sentinels which
    /// server is the master, and move there if it is another.
    async fn follow(&self, seen: &str) {
        let _one = self.following.lock().await;
        if self.conn().0 != seen {
            return; // another command has followed already
        }
        match open(&self.sentinels, &self.config).await {
            Ok((addr, conn)) if addr != seen => {
                tracing::warn!(from = seen, to = %addr, master = %self.sentinels.master,
                    "the Sentinels name a new Redis master");
                *self.current.lock().unwrap_or_else(|p| p.into_inner()) = (addr, conn);
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "asking the Sentinels for the master"),
        }
    }

    async fn run<T>(
        &self,
        call: impl AsyncFnOnce(&mut ConnectionManager) -> RedisResult<T>,
    ) -> RedisResult<T> {
        let (addr, mut conn) = self.conn();
        let result = call(&mut conn).await;
        if let Err(e) = &result
            && after_failover(e)
        {
            self.follow(&addr).await;
        }
        result
    }
}

/// The master's address and a connection to it.
async fn open(
    sentinels: &Sentinels,
    config: &ConnectionManagerConfig,
) -> Result<(String, ConnectionManager), StoreError> {
    let client = sentinels.master().await?;
    let addr = client.get_connection_info().addr().to_string();
    let conn = client
        .get_connection_manager_with_config(config.clone())
        .await?;
    Ok((addr, conn))
}

/// Whether `e` is how a command fails when its server stopped being the
/// master.
fn after_failover(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"))
}

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move { self.run(async |c| c.req_packed_command(cmd).await).await })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            self.run(async |c| c.req_packed_commands(pipeline, offset, count).await)
                .await
        })
    }

    fn get_db(&self) -> i64 {
        self.conn().1.get_db()
    }
}

/// Read a `redis+sentinel://` URL.
fn parse(url: &str) -> Result<SentinelUrl, String> {
    let rest = url
        .strip_prefix(SCHEME)
        .ok_or_else(|| format!("{url:?} does not start with {SCHEME}"))?;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (format!("{userinfo}@"), hosts),
        None => (String::new(), authority),
    };
    // Past the host list, the URL reads as one of a single server, which
    // `Url` splits and redis-rs decodes (credentials, database).
    let single = reqwest::Url::parse(&format!("redis://{userinfo}master/{path}"))
        .map_err(|e| format!("{url:?}: {e}"))?;
    let mut segments = single.path_segments().into_iter().flatten();
    let master = segments
        .next()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| format!("{url:?} names no master"))?;
    let master = percent_encoding::percent_decode_str(master)
        .decode_utf8()
        .map_err(|e| format!("{url:?}: the master's name: {e}"))?
        .into_owned();
    let mut node_url = single.clone();
    node_url.set_path(segments.next().unwrap_or(""));
    node_url.set_query(None);
    let node = redis::IntoConnectionInfo::into_connection_info(node_url.as_str())
        .map_err(|e| format!("{url:?}: {e}"))?
        .redis_settings()
        .clone();
    let mut sentinel = reqwest::Url::parse("redis://sentinel").expect("a fixed URL parses");
    for (key, value) in single.query_pairs() {
        let set = match &*key {
            "sentinel_username" => sentinel.set_username(&value),
            "sentinel_password" => sentinel.set_password(Some(&value)),
            other => return Err(format!("{url:?}: unknown parameter {other:?}")),
        };
        set.map_err(|()| format!("{url:?}: {key}"))?;
    }
    let sentinels = hosts
        .split(',')
        .map(|host| {
            let mut at = sentinel.clone();
            let host = host.trim();
            let (name, port) = match host.rsplit_once(':') {
                Some((name, port)) if !host.ends_with(']') => (name, port.parse().ok()),
                _ => (host, Some(SENTINEL_PORT)),
            };
            let port = port.ok_or_else(|| format!("{url:?}: the port of {host:?}"))?;
            at.set_host(Some(name))
                .map_err(|e| format!("{url:?}: Sentinel {host:?}: {e}"))?;
            at.set_port(Some(port))
                .map_err(|()| format!("{url:?}: {host:?}"))?;
            Ok(at.to_string())
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(SentinelUrl {
        sentinels,
        master,
        node,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_url_names_sentinels_master_db_and_credentials() {
        let url = parse(
            "redis+sentinel://app:p%40ss@10.0.0.1:26380,sentinel-b,[::1]:5000/my%20master/2\
             ?sentinel_password=s3cret",
        )
        .expect("parses");
        assert_eq!(
            url.sentinels,
            [
                "redis://:s3cret@10.0.0.1:26380",
                "redis://:s3cret@sentinel-b:26379",
                "redis://:s3cret@[::1]:5000",
            ]
        );
        assert_eq!(url.master, "my master");
        assert_eq!(url.node.db(), 2);
        assert_eq!(url.node.username(), Some("app"));
        assert_eq!(url.node.password(), Some("p@ss"));
        let plain = parse("redis+sentinel://127.0.0.1:26379/m").expect("parses");
        assert_eq!(plain.sentinels, ["redis://127.0.0.1:26379"]);
        assert_eq!(plain.master, "m");
        assert_eq!((plain.node.db(), plain.node.password()), (0, None));
    }

    #[test]
    fn a_sentinel_url_without_a_master_or_with_junk_is_refused() {
        for bad in [
            "redis+sentinel://127.0.0.1:26379",
            "redis+sentinel://127.0.0.1:26379/",
            "redis+sentinel://127.0.0.1:26379/m/zero",
            "redis+sentinel://127.0.0.1:26379/m?colour=red",
            "redis+sentinel://,/m",
        ] {
            assert!(parse(bad).is_err(), "{bad} parsed");
        }
    }
}
