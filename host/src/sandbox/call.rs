//! One handler call: a fresh store and instance, run under the limits, torn
//! down afterwards.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use wasmtime::component::ResourceTable;
use wasmtime::{Store, UpdateDeadline};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpView};

use super::allow::AllowList;
use super::http::{Clients, OutboundHttp};
use super::imports::bindings::{self, HandlerError, HandlerPre};
use super::imports::{Caller, HostCtx};
use super::limits::{Limit, Limits, StoreLimiter};
use super::log::{StreamKind, TaskLog};
use super::outcome::{Interrupt, Outcome, Trap, classify, error_chain};

/// A request to run one task's handler once.
#[derive(Debug, Clone)]
pub struct Call {
    /// The task name; selects the handler.
    pub task: String,
    /// What the handler is told about the task.
    pub ctx: TaskContext,
    /// The JSON payload.
    pub payload: String,
    /// This task's own deadline, if it has one; capped at
    /// [`Limits::deadline`].
    pub deadline: Option<Duration>,
}

/// What the host tells a handler about the call it is running (the WIT
/// `task-context`; `deadline-ms` is filled in by the sandbox).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskContext {
    /// The task's id, stable across retries.
    pub task_id: String,
    /// The queue the task was submitted to.
    pub queue: String,
    /// The task name.
    pub task_name: String,
    /// This attempt, starting at 1.
    pub attempt: u32,
    /// Attempts the task has in all.
    pub max_attempts: u32,
    /// The submission's idempotency key, if it had one.
    pub idempotency_key: Option<String>,
}

/// Cancels a call from outside: the call returns
/// [`Trap::Cancelled`] within about one epoch tick, whether the guest is
/// running wasm or waiting in a host import.
///
/// Clones share one flag. Cancelling before the call starts makes it return
/// at once without instantiating anything.
#[derive(Debug, Clone, Default)]
pub struct CancelHandle(Arc<CancelInner>);

#[derive(Debug, Default)]
struct CancelInner {
    cancelled: AtomicBool,
    notify: Notify,
}

impl CancelHandle {
    /// A handle that is not cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancel every call using this handle (or a clone of it).
    pub fn cancel(&self) {
        self.0.cancelled.store(true, Ordering::Release);
        self.0.notify.notify_waiters();
    }

    /// Whether [`cancel`](Self::cancel) was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.cancelled.load(Ordering::Acquire)
    }

    /// Resolves once the handle is cancelled.
    pub async fn cancelled(&self) {
        loop {
            let notified = self.0.notify.notified();
            tokio::pin!(notified);
            // Register before checking the flag, so a `cancel` between the
            // check and the await is not missed.
            notified.as_mut().enable();
            if self.is_cancelled() {
                return;
            }
            notified.await;
        }
    }
}

/// The data of one call's store.
///
/// What the call shares with others (its handler's limits, namespace and
/// allow-list, the Redis connection, the HTTP clients) it reaches through
/// the one handle on its handler in [`HostCtx`], and what only some calls
/// use (WASI, outbound HTTP) is built on first use: a call that only
/// computes on its payload costs no more than its own instance.
pub(crate) struct TaskState {
    /// Built on the handler's first WASI call (see [`WasiView::ctx`]
    /// below): many calls make none.
    wasi: Option<WasiCtx>,
    table: ResourceTable,
    limiter: StoreLimiter,
    pub(crate) host: HostCtx,
    http: WasiHttpCtx,
    /// Built on the handler's first outbound request.
    outbound: Option<OutboundHttp>,
    deadline_at: Instant,
    cancel: CancelHandle,
}

impl WasiView for TaskState {
    /// The call's WASI context, built the first time the handler reaches
    /// WASI: building one costs a handful of allocations and seeding two
    /// random generators, which a handler that only computes on its
    /// payload never needs.
    fn ctx(&mut self) -> WasiCtxView<'_> {
        let log = &self.host.log;
        WasiCtxView {
            ctx: self.wasi.get_or_insert_with(|| locked_down_wasi(log)),
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for TaskState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        let host = &mut self.host;
        let outbound = self.outbound.get_or_insert_with(|| {
            let requests = host.http_requests.get_or_insert_with(Arc::default).clone();
            OutboundHttp::new(
                host.handler.clone(),
                host.log.clone(),
                self.deadline_at,
                requests,
            )
        });
        // What a request sent now needs to know of the other imports.
        outbound.other_calls = host.host_calls;
        outbound.operation = host.operation.as_ref().map(|op| op.key().to_owned());
        WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: outbound,
        }
    }
}

/// A loaded handler, ready to instantiate, with what all its calls share.
pub(crate) struct LoadedHandler {
    pub(crate) pre: HandlerPre<TaskState>,
    /// `dtq:guest:{<namespace>}:`
    pub(crate) kv_prefix: String,
    /// `dtq:claim:{<namespace>}:`
    pub(crate) claim_prefix: String,
    /// Its namespace's budget: count, kv TTL index, claims index
    /// ([`quota::keys`](super::quota::keys)).
    pub(crate) quota_keys: [String; 3],
    pub(crate) kv_quota_bytes: u64,
    /// SHA-256 of the module, lowercase hex.
    pub(crate) digest: Arc<str>,
    /// The sandbox's limits with the operator's settings of this handler.
    pub(crate) limits: Limits,
    /// The hosts it may send HTTP requests to.
    pub(crate) allow: AllowList,
    /// Its namespace.
    pub(crate) namespace: String,
    /// Its task name, shared by the reports of its calls.
    pub(crate) task: Arc<str>,
    /// The sandbox's connection to Redis, for its kv and operations.
    pub(crate) redis: crate::store::Conn,
    /// The sandbox's HTTP clients, for its outbound requests.
    pub(crate) http: Clients,
    /// The queues and tasks it may submit to (flows).
    pub(crate) submit_to: super::tasks::SubmitGrants,
    /// The cap of the events stream its progress reports are written to
    /// as `PROGRESS` events; 0 for none
    /// ([`SandboxConfig::progress_events_max_len`](super::SandboxConfig::progress_events_max_len)).
    pub(crate) progress_events_max_len: u64,
}

/// The outcome, log and host-call count of one call.
pub(crate) struct RunResult {
    pub(crate) outcome: Outcome,
    pub(crate) log: String,
    pub(crate) host_calls: u64,
    /// What the call staged (flows).
    pub(crate) flow: Option<Box<super::tasks::FlowCall>>,
}

/// A WASI context with nothing in it: no preopened directories, no
/// environment, no arguments, empty stdin, no network; stdout and stderr go
/// to the task log.
fn locked_down_wasi(log: &TaskLog) -> WasiCtx {
    WasiCtxBuilder::new()
        .stdout(log.stream(StreamKind::Stdout))
        .stderr(log.stream(StreamKind::Stderr))
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .socket_addr_check(|_, _| Box::pin(async { false }))
        .build()
}

/// Run `handler` once in a fresh store of `engine`; `call`'s strings move
/// into the record the guest is given.
pub(crate) async fn run(
    engine: &wasmtime::Engine,
    handler: &Arc<LoadedHandler>,
    call: Call,
    budget: Duration,
    cancel: &CancelHandle,
) -> RunResult {
    let limits = &handler.limits;
    let log = TaskLog::new(limits.max_log_bytes);
    let deadline_at = Instant::now() + budget;
    let state = TaskState::new(handler, &call.ctx, &log, deadline_at, cancel);
    let mut store = match new_store(engine, state, limits) {
        Ok(store) => store,
        Err(e) => {
            return RunResult {
                outcome: Outcome::Trapped(Trap::Other(e.to_string())),
                log: log.finish(),
                host_calls: 0,
                flow: None,
            };
        }
    };
    let Call { ctx, payload, .. } = call;
    let wit_ctx = wit_context(ctx, budget);
    // Pinned where it is made: a future passed by value to another is
    // stored twice in the caller's state (once as the argument, once in the
    // callee), and this one is the largest part of a call held in flight.
    let result = {
        let guest = std::pin::pin!(async {
            let instance = handler.pre.instantiate_async(&mut store).await?;
            instance.call_handle(&mut store, &wit_ctx, &payload).await
        });
        interruptible(guest, deadline_at, cancel).await
    };
    // The last progress report is written before the completion, which
    // would refuse it once the task no longer runs.
    if let Some(progress) = store.data_mut().host.progress.take() {
        (*progress).finish().await;
    }
    let denied = store
        .data()
        .outbound
        .as_ref()
        .and_then(|o| o.denied.as_deref());
    let outcome = match outcome_of(result, limits, &log).after_denial(denied) {
        Outcome::Fatal(msg) => Outcome::Fatal(truncate(msg, limits.max_result_bytes)),
        other => other,
    };
    RunResult {
        outcome,
        log: log.finish(),
        host_calls: store.data().host.calls(),
        flow: store.data_mut().host.flow.take(),
    }
}

impl TaskState {
    /// The state of a call of `handler` for the task of `ctx`, logging to
    /// `log`, to end by `deadline_at` or when `cancel` fires.
    fn new(
        handler: &Arc<LoadedHandler>,
        ctx: &TaskContext,
        log: &TaskLog,
        deadline_at: Instant,
        cancel: &CancelHandle,
    ) -> TaskState {
        TaskState {
            wasi: None,
            table: ResourceTable::new(),
            limiter: StoreLimiter::new(&handler.limits),
            host: HostCtx {
                handler: handler.clone(),
                redis: None,
                log: log.clone(),
                host_calls: 0,
                caller: Caller {
                    queue: ctx.queue.clone(),
                    task_id: ctx.task_id.clone(),
                    attempt: ctx.attempt,
                    token: None,
                },
                deadline_at,
                operation: None,
                http_requests: None,
                progress: None,
                flow: None,
            },
            http: WasiHttpCtx::new(),
            outbound: None,
            deadline_at,
            cancel: cancel.clone(),
        }
    }
}

/// A store of `engine` holding `state`, under `limits`: its memory and
/// tables, its host-call bytes, its fuel, and an epoch callback that
/// interrupts it.
fn new_store(
    engine: &wasmtime::Engine,
    state: TaskState,
    limits: &Limits,
) -> wasmtime::Result<Store<TaskState>> {
    let mut store = Store::new(engine, state);
    store.limiter(|state| &mut state.limiter);
    store.set_hostcall_fuel(limits.max_hostcall_bytes);
    if let Some(fuel) = limits.fuel {
        store.set_fuel(fuel)?;
    }
    // Checked on every epoch tick while wasm runs: stop on cancel or
    // deadline, otherwise yield to the executor so that `interruptible` below
    // (and other tasks on this thread) get a turn. Through tokio's
    // `yield_now`, which resumes the call only once the runtime has run its
    // other ready tasks and polled for I/O: a plain wake would requeue it
    // at once, and with every thread computing the runtime would look at
    // its sockets only every 61 polls (tokio's `event_interval`), each a
    // tick of some guest's compute, so the Redis replies the worker's loops
    // and other calls wait for would wait seconds.
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(|ctx| {
        let state = ctx.data();
        if state.cancel.is_cancelled() {
            Err(wasmtime::Error::new(Interrupt::Cancelled))
        } else if Instant::now() >= state.deadline_at {
            Err(wasmtime::Error::new(Interrupt::Deadline))
        } else {
            Ok(UpdateDeadline::YieldCustom(
                1,
                Box::pin(tokio::task::yield_now()),
            ))
        }
    });
    Ok(store)
}

/// The WIT `task-context` of `ctx`, with the call's `budget` as its
/// deadline.
fn wit_context(ctx: TaskContext, budget: Duration) -> bindings::TaskContext {
    bindings::TaskContext {
        task_id: ctx.task_id,
        queue: ctx.queue,
        task_name: ctx.task_name,
        attempt: ctx.attempt,
        max_attempts: ctx.max_attempts,
        idempotency_key: ctx.idempotency_key,
        deadline_ms: u64::try_from(budget.as_millis()).unwrap_or(u64::MAX),
    }
}

/// What the guest's return (or trap) makes of the call: a result over the
/// limit or not JSON fails the call, error messages are cut to the limit,
/// and a trap is classified by its type (an unclassified one goes to the
/// task log).
fn outcome_of(
    result: wasmtime::Result<Result<String, HandlerError>>,
    limits: &Limits,
    log: &TaskLog,
) -> Outcome {
    match result {
        Ok(Ok(value)) if value.len() > limits.max_result_bytes => {
            Outcome::Trapped(Trap::LimitExceeded(Limit::Result))
        }
        Ok(Ok(value)) => match serde_json::from_str::<serde::de::IgnoredAny>(&value) {
            Ok(_) => Outcome::Success(value),
            Err(e) => Outcome::Fatal(format!("the handler's result is not JSON: {e}")),
        },
        Ok(Err(HandlerError::Retryable(msg))) => {
            Outcome::Retryable(truncate(msg, limits.max_result_bytes))
        }
        Ok(Err(HandlerError::Fatal(msg))) => Outcome::Fatal(truncate(msg, limits.max_result_bytes)),
        Err(err) => {
            let trap = classify(&err, log);
            if let Trap::Other(_) = &trap {
                tracing::debug!(error = ?err, "unclassified guest trap");
                log.line(["[dtq] trap: ", &error_chain(&err)]);
            }
            Outcome::Trapped(trap)
        }
    }
}

/// Run `guest` until it finishes, the deadline passes or `cancel` fires,
/// whichever is first; an interrupted guest's future is dropped.
///
/// The epoch callback only runs while wasm runs; this is what interrupts a
/// guest suspended in an async host import (a Redis call, a WASI sleep). It
/// is a hand-written `select!` for one reason: the timer and the cancel
/// notification are armed only once the guest first waits, so the common
/// call that never waits pays for neither (arming a timer can wake the
/// runtime's timer driver, a system call and a context switch per call).
async fn interruptible<T>(
    mut guest: Pin<&mut impl Future<Output = wasmtime::Result<T>>>,
    deadline_at: Instant,
    cancel: &CancelHandle,
) -> wasmtime::Result<T> {
    let mut cancelled = std::pin::pin!(cancel.cancelled());
    let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
    std::future::poll_fn(|cx| {
        if cancel.is_cancelled() {
            return Poll::Ready(Err(wasmtime::Error::new(Interrupt::Cancelled)));
        }
        if let Poll::Ready(result) = guest.as_mut().poll(cx) {
            return Poll::Ready(result);
        }
        let timer =
            timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline_at.into())));
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(wasmtime::Error::new(Interrupt::Deadline)));
        }
        if cancelled.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(wasmtime::Error::new(Interrupt::Cancelled)));
        }
        Poll::Pending
    })
    .await
}

/// Cut `msg` to at most `max` bytes (on a character boundary) and say so.
fn truncate(mut msg: String, max: usize) -> String {
    if msg.len() <= max {
        return msg;
    }
    let mut end = max;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    msg.truncate(end);
    msg.push_str(" [truncated]");
    msg
}
