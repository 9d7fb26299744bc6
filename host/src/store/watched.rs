//! A Redis Cluster connection that is replaced when it stops answering.
//!
//! The cluster client repairs its links in the background: a node that
//! restarts is reconnected, a slot map that changed is read again. Most of
//! the time that is all it takes. But its recovery can itself get stuck (a
//! slot refresh waiting forever on a lock a parked reconnection holds):
//! then every command waits behind it, with every node of the cluster up
//! and healthy, and nothing in the client will ever end the wait. A dtq
//! process on that connection would stop doing anything, for good.
//!
//! [`WatchedCluster`] puts a deadline on each call and keeps count of the
//! connection's health: when it has had calls waiting, or failing, with
//! no answer at all for a whole [stall window](WatchedCluster::connect),
//! a watchdog builds a new connection from the configured nodes and sends
//! every later call there. The stall window is longer than any call on a
//! healthy cluster can take (the response timeout plus the client's
//! retries through a failover), so a slow cluster is waited for, not
//! abandoned; a cluster that is down is tried again every window, and the
//! old connection is kept until a new one is made.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, Value};

/// How often the watchdog looks at the connection's health.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// How long building a new connection may take before the watchdog gives
/// up on it until the next window.
const REBUILD_TIMEOUT: Duration = Duration::from_secs(10);

/// How long after a call got no answer the connection counts as failing,
/// with nothing in flight: a call given up on before a quiet time (a
/// request its client dropped) is no evidence of a stall.
const FAILING_FOR: Duration = Duration::from_secs(5);

/// A cluster connection with a deadline on each call and a watchdog that
/// replaces it when it stalls. Cheap to clone: clones share it.
#[derive(Clone)]
pub struct WatchedCluster {
    shared: Arc<Shared>,
}

struct Shared {
    /// What a new connection is made from.
    client: ClusterClient,
    /// How long calls may go unanswered before the connection is replaced,
    /// and each call's deadline.
    stall: Duration,
    state: Mutex<State>,
}

struct State {
    conn: ClusterConnection,
    health: Health,
}

/// What the watchdog knows of the connection's calls.
struct Health {
    /// Counts replacements; a call's outcome counts only for the
    /// connection it was made on.
    generation: u64,
    /// Calls sent on this connection and not yet ended.
    in_flight: usize,
    /// Since when the connection has not answered: its last answer, or the
    /// start of the first call after a quiet time, or its making.
    quiet_since: Instant,
    /// When the last call to end got no answer (an error of the link or
    /// the cluster, its deadline, or its caller giving up), if none has
    /// been answered since.
    failed_at: Option<Instant>,
}

impl Health {
    fn new(now: Instant) -> Health {
        Health {
            generation: 0,
            in_flight: 0,
            quiet_since: now,
            failed_at: None,
        }
    }

    /// Whether the connection has had calls waiting or failing, and no
    /// answer, for `stall` or longer.
    fn stalled(&self, now: Instant, stall: Duration) -> bool {
        let failing = self
            .failed_at
            .is_some_and(|at| now.duration_since(at) < FAILING_FOR);
        (self.in_flight > 0 || failing) && now.duration_since(self.quiet_since) >= stall
    }

    /// A call starts; returns the generation it belongs to.
    fn begin(&mut self, now: Instant) -> u64 {
        if self.in_flight == 0 && self.failed_at.is_none() {
            self.quiet_since = now;
        }
        self.in_flight += 1;
        self.generation
    }

    /// A call of `generation` ends, `answered` or not.
    fn end(&mut self, generation: u64, answered: bool, now: Instant) {
        if generation != self.generation {
            return;
        }
        self.in_flight -= 1;
        if answered {
            self.quiet_since = now;
            self.failed_at = None;
        } else {
            self.failed_at = Some(now);
        }
    }

    /// A new connection took over.
    fn replaced(&mut self, now: Instant) {
        self.generation += 1;
        self.in_flight = 0;
        self.quiet_since = now;
        self.failed_at = None;
    }

    /// A try to replace the connection failed: wait a whole window before
    /// the next.
    fn retry_later(&mut self, now: Instant) {
        self.quiet_since = now;
    }
}

impl WatchedCluster {
    /// Connect through `client`, and watch the connection: a call gets no
    /// answer within `stall` fails, and a connection that has answered
    /// nothing for `stall` while calls waited or failed is replaced.
    pub async fn connect(client: ClusterClient, stall: Duration) -> RedisResult<WatchedCluster> {
        let conn = client.get_async_connection().await?;
        Ok(Self::watch(client, conn, stall))
    }

    /// Watch `conn`, replacing it with connections made through `client`.
    fn watch(client: ClusterClient, conn: ClusterConnection, stall: Duration) -> WatchedCluster {
        let shared = Arc::new(Shared {
            client,
            stall,
            state: Mutex::new(State {
                conn,
                health: Health::new(Instant::now()),
            }),
        });
        tokio::spawn(watchdog(Arc::downgrade(&shared)));
        WatchedCluster { shared }
    }

    /// How many times the connection was replaced.
    pub fn replacements(&self) -> u64 {
        self.shared.state().health.generation
    }

    /// The connection to send a call on, and the call's record.
    fn begin(&self) -> (ClusterConnection, Call) {
        let mut state = self.shared.state();
        let generation = state.health.begin(Instant::now());
        let call = Call {
            shared: self.shared.clone(),
            generation,
            ended: false,
        };
        (state.conn.clone(), call)
    }
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a few counters, whole after any panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One call on the connection: its outcome is recorded when it ends, or
/// as unanswered if it is dropped first (its caller gave up on it).
struct Call {
    shared: Arc<Shared>,
    generation: u64,
    ended: bool,
}

impl Call {
    /// Run `call` within the stall window and record how it ended.
    async fn run<T>(mut self, call: impl Future<Output = RedisResult<T>>) -> RedisResult<T> {
        let result = match tokio::time::timeout(self.shared.stall, call).await {
            Ok(result) => result,
            Err(_) => Err(timed_out(format!(
                "the Redis Cluster did not answer within {:?} \
                 (the connection is replaced if this goes on)",
                self.shared.stall
            ))),
        };
        self.end(answered(&result));
        result
    }

    fn end(&mut self, answered: bool) {
        self.ended = true;
        self.shared
            .state()
            .health
            .end(self.generation, answered, Instant::now());
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.ended {
            self.end(false);
        }
    }
}

/// Whether a call's result is an answer from the cluster: a reply, or an
/// error the server sent (a script's error is an answer). The link's
/// errors, timeouts and the cluster's own refusals (down, no node for a
/// slot) are not.
fn answered<T>(result: &RedisResult<T>) -> bool {
    match result {
        Ok(_) => true,
        Err(e) => {
            !(e.is_io_error()
                || e.is_timeout()
                || e.is_cluster_error()
                || e.kind() == ErrorKind::ClusterConnectionNotFound)
        }
    }
}

/// Replace the connection whenever it is stalled, until it is dropped.
async fn watchdog(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let (stalled, quiet) = {
            let health = &shared.state().health;
            let now = Instant::now();
            (
                health.stalled(now, shared.stall),
                now.duration_since(health.quiet_since),
            )
        };
        if !stalled {
            continue;
        }
        tracing::warn!(
            quiet_secs = quiet.as_secs(),
            "the Redis Cluster connection has answered nothing for {}s while calls waited; \
             making a new one",
            quiet.as_secs()
        );
        let made = tokio::time::timeout(REBUILD_TIMEOUT, shared.client.get_async_connection())
            .await
            .unwrap_or_else(|_| Err(timed_out(format!("not made within {REBUILD_TIMEOUT:?}"))));
        let mut state = shared.state();
        match made {
            Ok(conn) => {
                state.conn = conn;
                state.health.replaced(Instant::now());
                tracing::info!(
                    replacements = state.health.generation,
                    "a new Redis Cluster connection took over"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "no new Redis Cluster connection: {e}; trying again");
                state.health.retry_later(Instant::now());
            }
        }
    }
}

/// An I/O time-out saying `what`.
fn timed_out(what: String) -> RedisError {
    std::io::Error::new(std::io::ErrorKind::TimedOut, what).into()
}

impl ConnectionLike for WatchedCluster {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let (mut conn, call) = self.begin();
        Box::pin(call.run(async move { conn.req_packed_command(cmd).await }))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let (mut conn, call) = self.begin();
        Box::pin(call.run(async move { conn.req_packed_commands(pipeline, offset, count).await }))
    }

    fn get_db(&self) -> i64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(30);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn an_idle_connection_never_stalls() {
        let t0 = Instant::now();
        let health = Health::new(t0);
        assert!(!health.stalled(t0 + secs(3600), STALL));
    }

    #[test]
    fn a_call_unanswered_for_the_window_is_a_stall_and_an_answer_ends_it() {
        let t0 = Instant::now();
        let mut health = Health::new(t0);
        // A first call after an hour's quiet starts the clock at its start.
        let generation = health.begin(t0 + secs(3600));
        assert!(!health.stalled(t0 + secs(3600) + STALL - secs(1), STALL));
        assert!(health.stalled(t0 + secs(3600) + STALL, STALL));
        health.end(generation, true, t0 + secs(3600) + STALL);
        assert!(!health.stalled(t0 + secs(7200), STALL));
    }

    #[test]
    fn answers_to_other_calls_keep_a_long_call_from_counting_as_a_stall() {
        let t0 = Instant::now();
        let mut health = Health::new(t0);
        let long = health.begin(t0);
        for s in (5..=60).step_by(5) {
            let short = health.begin(t0 + secs(s));
            health.end(short, true, t0 + secs(s));
            assert!(!health.stalled(t0 + secs(s) + secs(4), STALL), "at {s}s");
        }
        health.end(long, true, t0 + secs(61));
    }

    #[test]
    fn failures_without_an_answer_for_the_window_are_a_stall() {
        let t0 = Instant::now();
        let mut health = Health::new(t0);
        for s in 0..=30 {
            let call = health.begin(t0 + secs(s));
            health.end(call, false, t0 + secs(s));
        }
        // Nothing in flight, but the last call failed, and none answered.
        assert!(health.stalled(t0 + secs(30), STALL));
        // One answer and it is healthy again.
        let call = health.begin(t0 + secs(31));
        health.end(call, true, t0 + secs(31));
        assert!(!health.stalled(t0 + secs(100), STALL));
    }

    #[test]
    fn a_call_given_up_on_before_a_quiet_time_is_no_stall() {
        let t0 = Instant::now();
        let mut health = Health::new(t0);
        let call = health.begin(t0);
        health.end(call, true, t0);
        // A request its client dropped, then nothing for an hour.
        let dropped = health.begin(t0 + secs(1));
        health.end(dropped, false, t0 + secs(1));
        assert!(!health.stalled(t0 + secs(3600), STALL));
        // Failing again after the window with no answer is a stall.
        let call = health.begin(t0 + secs(3600));
        health.end(call, false, t0 + secs(3600));
        assert!(health.stalled(t0 + secs(3601), STALL));
    }

    #[test]
    fn calls_of_a_replaced_connection_count_for_nothing() {
        let t0 = Instant::now();
        let mut health = Health::new(t0);
        let old = health.begin(t0);
        assert!(health.stalled(t0 + STALL, STALL));
        health.replaced(t0 + STALL);
        assert!(
            !health.stalled(t0 + STALL * 3, STALL),
            "nothing waits on the new one"
        );
        // The old call's failure, arriving late, neither fails the new
        // connection nor unbalances its count.
        health.end(old, false, t0 + STALL + secs(1));
        assert!(health.failed_at.is_none() && health.in_flight == 0);
        let new = health.begin(t0 + STALL * 3);
        health.end(new, true, t0 + STALL * 3);
        assert_eq!(health.in_flight, 0);
    }

    #[test]
    fn a_failed_replacement_waits_a_window_before_the_next() {
        let t0 = Instant::now();
        let mut health = Health::new(t0);
        let _stuck = health.begin(t0);
        assert!(health.stalled(t0 + STALL, STALL));
        health.retry_later(t0 + STALL);
        assert!(!health.stalled(t0 + STALL + secs(1), STALL));
        assert!(health.stalled(t0 + STALL * 2, STALL));
    }

    #[test]
    fn a_script_error_is_an_answer_and_a_broken_link_is_not() {
        let script: RedisResult<()> = Err((
            ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "ERR boom",
        )
            .into());
        assert!(answered(&script));
        let down: RedisResult<()> = Err((
            ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
            "CLUSTERDOWN",
        )
            .into());
        assert!(!answered(&down));
        let io: RedisResult<()> =
            Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset).into());
        assert!(!answered(&io));
        let timeout: RedisResult<()> =
            Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into());
        assert!(!answered(&timeout));
        let no_node: RedisResult<()> = Err((ErrorKind::ClusterConnectionNotFound, "none").into());
        assert!(!answered(&no_node));
        assert!(answered(&Ok(())));
    }

    /// A connection whose cluster hangs for good (every node stopped, so
    /// the client's own recovery never ends) is replaced by one made
    /// through the client, and calls go through again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_that_answers_nothing_for_good_is_replaced() {
        use dtq_tests::cluster::RedisCluster;

        let healthy = RedisCluster::start(3, 0).unwrap();
        let hung = RedisCluster::start(3, 0).unwrap();
        let client = |cluster: &RedisCluster| {
            let nodes: Vec<String> = cluster.urls().split(',').map(str::to_owned).collect();
            ClusterClient::builder(nodes)
                .response_timeout(Duration::from_millis(500))
                .retries(1)
                .build()
                .unwrap()
        };
        let stall = Duration::from_secs(2);
        let stuck = client(&hung).get_async_connection().await.unwrap();
        let mut conn = WatchedCluster::watch(client(&healthy), stuck, stall);
        let _: () = redis::cmd("SET")
            .arg("k")
            .arg("before")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(conn.replacements(), 0);

        hung.freeze().unwrap();
        let started = Instant::now();
        let mut failures = 0;
        loop {
            let set = redis::cmd("SET")
                .arg("k")
                .arg("after")
                .query_async::<()>(&mut conn)
                .await;
            match set {
                Ok(()) => break,
                Err(e) => {
                    assert!(!answered::<()>(&Err(e)));
                    failures += 1;
                }
            }
            assert!(
                started.elapsed() < stall * 10,
                "no call went through after {:?} ({failures} failed)",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(failures > 0, "the frozen cluster answered");
        assert_eq!(conn.replacements(), 1);
        // The write went to the cluster the client names.
        let mut direct = client(&healthy).get_async_connection().await.unwrap();
        let value: String = redis::cmd("GET")
            .arg("k")
            .query_async(&mut direct)
            .await
            .unwrap();
        assert_eq!(value, "after");
    }
}
