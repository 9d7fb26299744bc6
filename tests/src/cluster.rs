//! A Redis Cluster of real `redis-server` processes on loopback ports,
//! created with `redis-cli --cluster create`, as the cluster tests and the
//! suites run in cluster mode (`DTQ_TEST_REDIS=cluster`) use it.
//!
//! Each node gets a free client port and a free cluster-bus port
//! (`--cluster-port`) and a directory of its own. A cluster with replicas
//! gets a short node timeout, so that a failover after a master is killed
//! takes a few seconds; one without keeps Redis's default, so that a node
//! starved of CPU on a busy machine is not marked failing (which would stop
//! the whole cluster: a replica-less cluster cannot fail a node over).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::{TempDir, free_port};

/// How long a node may stay unreachable before the others fail it over,
/// in a cluster with replicas.
const FAILOVER_NODE_TIMEOUT_MS: u64 = 1_000;

/// The same in a cluster without: Redis's default.
const DEFAULT_NODE_TIMEOUT_MS: u64 = 15_000;

/// One node of a [`RedisCluster`].
struct Node {
    child: Option<Child>,
    port: u16,
    _dir: TempDir,
}

impl Node {
    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

/// A running Redis Cluster; every node is killed on drop.
pub struct RedisCluster {
    nodes: Vec<Node>,
}

impl RedisCluster {
    /// Start `masters` primaries with `replicas` replicas each, create the
    /// cluster over them, and wait until every node sees every slot
    /// served.
    pub fn start(masters: usize, replicas: usize) -> Result<Self> {
        ensure!(
            masters >= 3,
            "redis-cli creates clusters of 3 masters or more"
        );
        let mut last_err = None;
        // Free ports may be taken before a node binds them: try again.
        for _ in 0..3 {
            match Self::try_start(masters, replicas) {
                Ok(cluster) => return Ok(cluster),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("the cluster did not start")))
    }

    fn try_start(masters: usize, replicas: usize) -> Result<Self> {
        let node_timeout = if replicas > 0 {
            FAILOVER_NODE_TIMEOUT_MS
        } else {
            DEFAULT_NODE_TIMEOUT_MS
        };
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            let dir = TempDir::new("redis-cluster")?;
            let (port, bus) = (free_port()?, free_port()?);
            let mut server = Command::new("redis-server");
            // To read the nodes' logs after a run (a failover's story):
            // `DTQ_TEST_CLUSTER_LOGS=<dir>`, one `<port>.log` per node.
            if let Some(logs) = std::env::var_os("DTQ_TEST_CLUSTER_LOGS") {
                let file = std::path::Path::new(&logs).join(format!("{port}.log"));
                server.arg("--logfile").arg(file);
            }
            let child = server
                .args(["--port", &port.to_string()])
                .args(["--cluster-port", &bus.to_string()])
                .args(["--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-node-timeout", &node_timeout.to_string()])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&dir.path)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context(
                    "cannot run `redis-server`: install it (Debian: `apt-get install \
                     redis-server`) or run the tests through .ci/run, which installs it",
                )?;
            nodes.push(Node {
                child: Some(child),
                port,
                _dir: dir,
            });
        }
        let cluster = RedisCluster { nodes };
        for node in &cluster.nodes {
            wait_for_ping(node.port, Duration::from_secs(10))?;
        }
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(
                cluster
                    .nodes
                    .iter()
                    .map(|n| format!("127.0.0.1:{}", n.port)),
            )
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .context("cannot run `redis-cli` (Debian: `apt-get install redis-tools`)")?;
        ensure!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_healthy(Duration::from_secs(30))?;
        if replicas > 0 {
            cluster.wait_replicas_in_sync(masters * replicas, Duration::from_secs(30))?;
        }
        Ok(cluster)
    }

    /// The URLs of every live node, comma-separated: a `--redis` value.
    pub fn urls(&self) -> String {
        self.live().map(Node::url).collect::<Vec<_>>().join(",")
    }

    fn live(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.child.is_some())
    }

    /// A cluster connection, as the host makes it.
    pub async fn conn(&self) -> Result<dtq_host::store::Conn> {
        let backend = dtq_host::store::Backend::open(&self.urls()).await?;
        ensure!(backend.is_cluster(), "the nodes are not a cluster");
        Ok(backend.connect(Duration::from_secs(5)).await?)
    }

    /// The port of the primary that serves `key`'s slot now.
    pub fn master_of(&self, key: &str) -> Result<u16> {
        let node = self.live().next().context("no live node")?;
        let mut conn = sync_conn(node.port)?;
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut conn)?;
        let ranges: Vec<redis::Value> = redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn)?;
        for range in ranges {
            // [start, end, [host, port, id], replicas...]
            let redis::Value::Array(items) = range else {
                continue;
            };
            let (start, end): (u16, u16) = (
                redis::from_redis_value_ref(&items[0])?,
                redis::from_redis_value_ref(&items[1])?,
            );
            if (start..=end).contains(&slot) {
                let redis::Value::Array(primary) = &items[2] else {
                    bail!("CLUSTER SLOTS: no primary for {start}-{end}");
                };
                return Ok(redis::from_redis_value_ref(&primary[1])?);
            }
        }
        bail!("no node serves slot {slot}")
    }

    /// `count` queue names whose keys are served by `count` different
    /// primaries, in the order of their primaries' ports.
    pub fn queues_on_distinct_shards(&self, count: usize) -> Result<Vec<String>> {
        let mut by_master = std::collections::BTreeMap::new();
        for i in 0..1000 {
            let queue = format!("q{i}");
            let master = self.master_of(&format!("dtq:stream:{{{queue}}}"))?;
            by_master.entry(master).or_insert(queue);
            if by_master.len() == count {
                return Ok(by_master.into_values().collect());
            }
        }
        bail!("fewer than {count} primaries serve the queues")
    }

    /// A queue name whose first `partitions` partitions are served by as
    /// many different primaries.
    pub fn queue_spanning_shards(&self, partitions: u32) -> Result<String> {
        for n in 0..10_000 {
            let queue = format!("spread-{n}");
            let mut masters = (0..partitions)
                .map(|i| {
                    let name = dtq_host::store::partition_queue(&queue, i);
                    self.master_of(&format!("dtq:stream:{{{name}}}"))
                })
                .collect::<Result<Vec<_>>>()?;
            masters.sort_unstable();
            masters.dedup();
            if masters.len() == partitions as usize {
                return Ok(queue);
            }
        }
        bail!("no queue name has {partitions} partitions on {partitions} primaries")
    }

    /// Kill the node on `port` with SIGKILL, as a crash looks.
    pub fn kill(&mut self, port: u16) -> Result<()> {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port)
            .context("no such node")?;
        let mut child = node.child.take().context("the node is already dead")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Stop every node (`SIGSTOP`): each keeps its connections open and
    /// answers nothing, as a host that hangs does. They are killed on drop
    /// as usual.
    pub fn freeze(&self) -> Result<()> {
        for node in self.live() {
            let child = node.child.as_ref().context("a live node")?;
            crate::process::send_signal(child.id(), libc::SIGSTOP)?;
        }
        Ok(())
    }

    /// Wait until a primary other than `old` serves `key`'s slot (its
    /// replica, promoted after `old` was killed) and the cluster is healthy
    /// again.
    pub fn wait_failover(&self, old: u16, key: &str, timeout: Duration) -> Result<u16> {
        let start = Instant::now();
        loop {
            match self.master_of(key) {
                Ok(now) if now != old => {
                    self.wait_healthy(timeout.saturating_sub(start.elapsed()))?;
                    return Ok(now);
                }
                _ if start.elapsed() > timeout => {
                    bail!("no replica took over from {old} within {timeout:?}")
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Wait until every live node says `cluster_state:ok`: every slot is
    /// served (after a failover, by a promoted replica).
    pub fn wait_healthy(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            let mut states = Vec::new();
            for node in self.live() {
                let info: Result<String> = sync_conn(node.port).and_then(|mut c| {
                    Ok(redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c)?)
                });
                states.push(info.is_ok_and(|i| i.contains("cluster_state:ok")));
            }
            if states.iter().all(|ok| *ok) {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!("the cluster is not healthy after {timeout:?}: {states:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait until `want` replicas report their link to their primary up.
    fn wait_replicas_in_sync(&self, want: usize, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            let mut synced = 0;
            for node in self.live() {
                if let Ok(info) = sync_conn(node.port).and_then(|mut c| {
                    Ok(redis::cmd("INFO")
                        .arg("replication")
                        .query::<String>(&mut c)?)
                }) && info.contains("role:slave")
                    && info.contains("master_link_status:up")
                {
                    synced += 1;
                }
            }
            if synced >= want {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!("{synced} of {want} replicas in sync after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait until the replicas of the primary on `port`, which serves
    /// `key`'s slot, have every write it has taken so far, for at most
    /// `timeout`: how many did. `key` has a hash tag (`{...}`).
    ///
    /// `WAIT` waits for the writes of its own connection only; on a
    /// connection that wrote nothing it returns at once, whatever the
    /// replicas hold. So this writes a marker in `key`'s slot first (`key`
    /// with a suffix: the same tag): once a replica has that write, it has
    /// every write the primary took before.
    pub fn wait_replicated(&self, port: u16, key: &str, timeout: Duration) -> Result<i64> {
        let mut conn = sync_conn(port)?;
        conn.set_read_timeout(Some(timeout + Duration::from_secs(2)))?;
        let () = redis::cmd("SET")
            .arg(format!("{key}:replicated"))
            .arg(1)
            .query(&mut conn)?;
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        Ok(redis::cmd("WAIT").arg(1).arg(ms).query(&mut conn)?)
    }

    /// What every live node answers to `cmd`, by port: each node is asked
    /// directly, so a node that does not serve the key answers `MOVED`.
    pub fn ask_each_node(&self, cmd: &redis::Cmd) -> Vec<(u16, Result<redis::Value>)> {
        self.live()
            .map(|n| {
                let answer =
                    sync_conn(n.port).and_then(|mut c| Ok(cmd.query::<redis::Value>(&mut c)?));
                (n.port, answer)
            })
            .collect()
    }

    /// `INFO <section>` of the node on `port`.
    pub fn info(&self, port: u16, section: &str) -> Result<String> {
        let mut conn = sync_conn(port)?;
        Ok(redis::cmd("INFO").arg(section).query(&mut conn)?)
    }

    /// The ports of the live primaries.
    pub fn master_ports(&self) -> Vec<u16> {
        self.live()
            .filter(|n| {
                self.info(n.port, "replication")
                    .is_ok_and(|i| i.contains("role:master"))
            })
            .map(|n| n.port)
            .collect()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

fn sync_conn(port: u16) -> Result<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    Ok(conn)
}

fn wait_for_ping(port: u16, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        let pong =
            sync_conn(port).and_then(|mut c| Ok(redis::cmd("PING").query::<String>(&mut c)?));
        if pong.is_ok() {
            return Ok(());
        }
        if start.elapsed() > timeout {
            bail!("redis-server on port {port} did not answer PING within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl RedisCluster {
    /// Stop the node on `port` gracefully, keep it down for `down`, and
    /// start it again on the same ports, directory and configuration; then
    /// wait until every node says the cluster is healthy. The nodes run
    /// without persistence, so the stop is `SHUTDOWN SAVE`: the node writes
    /// its data set to an RDB file in its directory, which it loads again
    /// (it answers `PING` once loaded), and its cluster configuration
    /// (`nodes.conf`, in the same directory) makes it the same node,
    /// serving the same slots. No acknowledged write is lost.
    ///
    /// Meanwhile the node's slots are not served: a client's commands for
    /// them fail, or wait. The other nodes do not mark it failing as long
    /// as `down` (and the restart) stays well under the node timeout (a
    /// cluster without replicas keeps Redis's 15 s, and has no replica to
    /// promote anyway). Blocks the calling thread.
    pub fn restart_node(&mut self, port: u16, down: Duration) -> Result<()> {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port)
            .context("no such node")?;
        ensure!(node.child.is_some(), "the node on port {port} is dead");
        let mut conn = sync_conn(port)?;
        let mut config = |name: &str| -> Result<String> {
            let pair: Vec<String> = redis::cmd("CONFIG").arg("GET").arg(name).query(&mut conn)?;
            pair.into_iter()
                .nth(1)
                .with_context(|| format!("CONFIG GET {name}: no value"))
        };
        let bus: u16 = config("cluster-port")?.parse()?;
        let node_timeout = config("cluster-node-timeout")?;
        let logfile = config("logfile")?;
        // A server that stops closes the connection instead of replying;
        // whether it stopped is told by its exit.
        let reply = redis::cmd("SHUTDOWN").arg("SAVE").query::<()>(&mut conn);
        let child = node.child.as_mut().context("the node is dead")?;
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                ensure!(
                    status.success(),
                    "redis-server on port {port} exited with {status} on SHUTDOWN SAVE ({reply:?})"
                );
                break;
            }
            if start.elapsed() > Duration::from_secs(30) {
                bail!("redis-server on port {port} did not exit after SHUTDOWN SAVE ({reply:?})");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        node.child = None;
        std::thread::sleep(down);
        let start = Instant::now();
        loop {
            let mut server = Command::new("redis-server");
            if !logfile.is_empty() {
                server.arg("--logfile").arg(&logfile);
            }
            let child = server
                .args(["--port", &port.to_string()])
                .args(["--cluster-port", &bus.to_string()])
                .args(["--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-node-timeout", &node_timeout])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&node._dir.path)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("cannot run `redis-server`")?;
            node.child = Some(child);
            // Up once it answers PING (after loading its data); a server
            // that exits meanwhile could not bind its port, which may
            // linger for a moment after the stop: start it again.
            let up = Instant::now();
            loop {
                let pong = sync_conn(port)
                    .and_then(|mut c| Ok(redis::cmd("PING").query::<String>(&mut c)?));
                if pong.is_ok() {
                    break;
                }
                let child = node.child.as_mut().context("the node is dead")?;
                if let Some(status) = child.try_wait()? {
                    node.child = None;
                    ensure!(
                        start.elapsed() < Duration::from_secs(20),
                        "redis-server on port {port} exited with {status} when started again"
                    );
                    break;
                }
                ensure!(
                    up.elapsed() < Duration::from_secs(30),
                    "redis-server on port {port} did not answer PING within 30 s of its restart"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            if node.child.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.wait_healthy(Duration::from_secs(30))
    }
}
