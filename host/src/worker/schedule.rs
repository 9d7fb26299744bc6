//! The scheduler: fires the periodic tasks of the worker's queues.
//!
//! Every worker runs one scheduler loop per queue it consumes, and they all
//! race; nothing but Redis coordinates them, and the fleet still makes one
//! task per tick:
//!
//! 1. read the due schedules (`dtq:schedule-due:{q}`, name → next tick);
//! 2. for each, pick the tick to fire: the latest tick of its expression at
//!    or before now. A schedule that missed ticks while no worker ran fires
//!    once, for the latest of them, never a burst;
//! 3. submit its task through the normal submission path
//!    ([`crate::ingest::submit`]: every submission rule, the handler check
//!    and the idempotency record apply) with the idempotency key
//!    `schedule:<name>:<tick>` ([`crate::store::tick_key`]). Schedulers
//!    that fire the same tick submit the same key, so they make one task;
//! 4. move the due time to the first tick after now, with a compare-and-set
//!    on the due time read in step 1 (`lua/schedule_advance.lua`): only the
//!    first scheduler moves it.
//!
//! A scheduler that dies between 3 and 4 leaves the due time unmoved; the
//! next one fires the same tick again, which the key makes the same task.
//!
//! A tick whose submission is refused (its handler undeployed, a setting
//! the worker refuses) makes no task: it is passed, and the refusal kept as
//! the schedule's last tick. A full queue holds the schedule instead: it is
//! fired again after [`HOLD`] (for the latest tick then, so a queue full for
//! several ticks gets one task once it has room).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Shared, supervise};
use crate::base::now_ms;
use crate::deploy::{Registry, RegistryError};
use crate::ingest::{self, IngestError, IngestSettings};
use crate::sandbox::Sandbox;
use crate::store::{CronExpr, FiredTick, ScheduleDef, Store, StoreError, tick_key};

/// Longest sleep between two looks at the due schedules: a schedule set by
/// another process while this loop sleeps fires at most this late.
const MAX_IDLE: Duration = Duration::from_millis(250);

/// How long a schedule that could not fire (a full queue, Redis failing)
/// waits before it is tried again.
pub const HOLD: Duration = Duration::from_secs(1);

/// Schedules fired per pass.
const BATCH: usize = 64;

/// What submitting one tick's task did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickSubmission {
    /// The tick's task: new, or the one another scheduler (or an earlier
    /// try of this tick) submitted (`duplicate`).
    Task {
        /// The task.
        task_id: String,
        /// Whether the task existed already.
        duplicate: bool,
    },
    /// The submission was refused; the tick makes no task. The error's
    /// code and message.
    Refused(String),
    /// The queue is full: the tick waits.
    Held,
}

/// What firing one due schedule did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fired {
    /// This call moved the schedule's due time to `next` (`None`: the
    /// expression has no tick left).
    Advanced {
        /// The schedule's next tick.
        next: Option<u64>,
    },
    /// Another scheduler moved it first, or it was deleted: nothing moved.
    Raced,
    /// The queue is full: the schedule waits, its due time unmoved.
    Held,
}

/// What one pass over a queue's due schedules did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Schedules whose due time this pass moved.
    pub advanced: usize,
    /// Whether a due schedule could not fire and waits for a later pass.
    pub held: bool,
    /// The next due time after the pass's `now`, if any: of the schedules
    /// not due, and of those this pass advanced.
    pub next: Option<u64>,
}

/// Fires the due schedules of queues: the steps of the module doc, for the
/// worker's loop and for tests that drive a pass at a time of their choice.
#[derive(Clone)]
pub struct Scheduler {
    store: Store,
    registry: Registry,
    /// The handlers this process loaded (from `--handlers`, or the
    /// registry): a task known here needs no registry look-up to be known.
    sandbox: Option<Sandbox>,
    ingest: IngestSettings,
}

impl Scheduler {
    /// A scheduler submitting through `store` with `ingest`'s limits.
    pub fn new(store: Store, sandbox: Option<Sandbox>, ingest: IngestSettings) -> Scheduler {
        Scheduler {
            registry: Registry::new(store.connection()),
            store,
            sandbox,
            ingest,
        }
    }

    /// One pass: fire every schedule of `queue` due at `now` (up to a
    /// batch; `next` is `now` when more are due).
    pub async fn pass(&self, queue: &str, now: u64) -> Result<Pass, StoreError> {
        let (due, next) = self.store.due_schedules(queue, now, BATCH).await?;
        let mut pass = Pass {
            advanced: 0,
            held: false,
            next,
        };
        for (name, read) in due {
            match self.fire(queue, &name, read, now).await {
                Ok(Fired::Advanced { next }) => {
                    pass.advanced += 1;
                    pass.next = match (pass.next, next) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
                Ok(Fired::Raced) => {}
                Ok(Fired::Held) => pass.held = true,
                Err(e) => {
                    warn!(queue, schedule = %name, error = %e, "firing a schedule failed");
                    pass.held = true;
                }
            }
        }
        Ok(pass)
    }

    /// Fire schedule `name` of `queue`, read due at `read`, at `now`: submit
    /// its tick's task and advance it.
    pub async fn fire(
        &self,
        queue: &str,
        name: &str,
        read: u64,
        now: u64,
    ) -> Result<Fired, StoreError> {
        let Some(def) = self.store.schedule_def(queue, name).await? else {
            // Deleted since it was read (the delete took its due time too):
            // this drops a due time left without a definition, if any.
            self.store
                .advance_schedule(queue, name, read, None, None)
                .await?;
            return Ok(Fired::Raced);
        };
        let cron = match CronExpr::parse(&def.cron) {
            Ok(cron) => cron,
            Err(e) => {
                // Checked when it was set; a definition written otherwise.
                warn!(queue, schedule = name, error = %e, "a schedule's expression does not parse: it stops");
                let fired = FiredTick {
                    tick: read,
                    task_id: None,
                    fired_at: now,
                    error: Some(format!("INVALID_CRON: {e}")),
                };
                return self.advance(queue, name, read, None, &fired).await;
            }
        };
        // The latest tick at or before now, never one before the due time
        // read (which a schedule replaced since may have).
        let tick = cron
            .latest_at_or_before(now)
            .filter(|t| *t >= read)
            .unwrap_or(read);
        let (task_id, error) = match self.submit_tick(queue, name, &def, tick).await? {
            TickSubmission::Task { task_id, duplicate } => {
                debug!(queue, schedule = name, tick, %task_id, duplicate, "schedule fired");
                (Some(task_id), None)
            }
            TickSubmission::Refused(error) => {
                warn!(queue, schedule = name, tick, %error, "a schedule's tick was refused: it makes no task");
                (None, Some(error))
            }
            TickSubmission::Held => {
                debug!(
                    queue,
                    schedule = name,
                    tick,
                    "queue full: the schedule waits"
                );
                return Ok(Fired::Held);
            }
        };
        let fired = FiredTick {
            tick,
            task_id,
            fired_at: now,
            error,
        };
        let next = cron.next_after(now.max(tick));
        self.advance(queue, name, read, next, &fired).await
    }

    /// Step 4: the compare-and-set of the due time.
    async fn advance(
        &self,
        queue: &str,
        name: &str,
        read: u64,
        next: Option<u64>,
        fired: &FiredTick,
    ) -> Result<Fired, StoreError> {
        let moved = self
            .store
            .advance_schedule(queue, name, read, next, Some(fired))
            .await?;
        Ok(if moved {
            Fired::Advanced { next }
        } else {
            Fired::Raced
        })
    }

    /// Submit the task of schedule `name`'s `tick` (the step a crash can
    /// repeat): with the tick's idempotency key, so submitting it again
    /// finds the same task.
    pub async fn submit_tick(
        &self,
        queue: &str,
        name: &str,
        def: &ScheduleDef,
        tick: u64,
    ) -> Result<TickSubmission, StoreError> {
        let (known, default_attempts) = self.handler(&def.task).await?;
        let mut body = json!({"task": def.task, "payload": def.payload});
        if let Some(n) = def.max_attempts.or(default_attempts) {
            body["max_attempts"] = json!(n);
        }
        if let Some(t) = def.timeout_ms {
            body["timeout_ms"] = json!(t);
        }
        // A store failure is returned before this, so the text is the
        // API's own for the refusal.
        let refused = |e: IngestError| TickSubmission::Refused(format!("{}: {e}", e.code()));
        let req = match ingest::parse_submit_body(body.to_string().as_bytes()) {
            Ok(req) => req,
            Err(e) => return Ok(refused(e)),
        };
        let key = tick_key(name, tick);
        let submitted =
            ingest::submit(&self.store, &self.ingest, queue, Some(&key), req, |_| known).await;
        Ok(match submitted {
            Ok(done) => TickSubmission::Task {
                task_id: done.task_id,
                duplicate: done.duplicate,
            },
            // The tick's task exists: in flight, or submitted with the
            // schedule's earlier payload (it was replaced since).
            Err(IngestError::InProgress { task_id } | IngestError::KeyMismatch { task_id }) => {
                TickSubmission::Task {
                    task_id,
                    duplicate: true,
                }
            }
            Err(IngestError::QueueFull { .. }) => TickSubmission::Held,
            Err(IngestError::Store(e)) => return Err(e),
            Err(e) => refused(e),
        })
    }

    /// Whether `task` has a handler, and its deploy default of attempts: the
    /// registry decides, as for a submission through the API; a handler
    /// this process loaded from a directory counts too.
    async fn handler(&self, task: &str) -> Result<(bool, Option<u32>), StoreError> {
        let entry = match self.registry.active_entry(task).await {
            Ok(entry) => entry,
            Err(RegistryError::Redis(e)) => return Err(e.into()),
            Err(e) => return Err(StoreError::Corrupt(e.to_string())),
        };
        let local = self.sandbox.as_ref().is_some_and(|s| s.has_handler(task));
        Ok(match entry {
            Some(entry) => (true, entry.version.and_then(|v| v.settings.max_attempts)),
            None => (local, None),
        })
    }
}

/// Fire the due schedules of `queue` until `stop`.
pub(super) async fn run(shared: Arc<Shared>, queue: String, stop: CancellationToken) {
    let scheduler = Scheduler::new(
        shared.store.clone(),
        Some(shared.sandbox.clone()),
        shared.config.ingest_settings(),
    );
    loop {
        if supervise::injected("schedule", &queue) {
            return;
        }
        let now = now_ms();
        let wait = match scheduler.pass(&queue, now).await {
            Ok(pass) if pass.held => HOLD,
            Ok(Pass {
                next: Some(next), ..
            }) if next <= now => Duration::ZERO,
            Ok(Pass {
                next: Some(next), ..
            }) => Duration::from_millis(next - now).min(MAX_IDLE),
            Ok(Pass { next: None, .. }) => MAX_IDLE,
            Err(e) => {
                warn!(queue, error = %e, "reading due schedules failed");
                HOLD
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => return,
        }
    }
}
