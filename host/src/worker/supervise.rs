//! Supervision of the worker's loops.
//!
//! Every loop of a worker runs until it is told to stop. One that ends on
//! its own (a panic, or a return it should never make) would leave the
//! process up and doing nothing, and no supervisor would restart it; so
//! [`Loops`] names each loop, and [`super::run`] stops the worker with an
//! error naming the first loop that ended unasked.
//!
//! No loop has a natural way to die, so tests make one with
//! [`inject_fault`], a hidden hook.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::task::{Id, JoinError, JoinSet};

/// How a loop ended when it should not have.
#[derive(Debug)]
pub struct LoopEnd {
    /// The loop's name, such as `fetch` or `delayed mover of queue q`.
    pub name: String,
    /// `None` when it returned; the panic's message when it panicked.
    pub panic: Option<String>,
}

impl std::fmt::Display for LoopEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.panic {
            Some(message) => write!(f, "worker loop `{}` panicked: {message}", self.name),
            None => write!(f, "worker loop `{}` ended unexpectedly", self.name),
        }
    }
}

impl std::error::Error for LoopEnd {}

/// Named loops, aborted together when this is dropped (a worker dropped
/// without a shutdown stops at once, as a crashed process does).
#[derive(Default)]
pub(super) struct Loops {
    set: JoinSet<()>,
    names: HashMap<Id, String>,
}

impl Loops {
    pub(super) fn spawn(
        &mut self,
        name: impl Into<String>,
        run: impl Future<Output = ()> + Send + 'static,
    ) {
        self.spawn_on(name, run, &tokio::runtime::Handle::current());
    }

    /// [`spawn`](Self::spawn) onto `runtime` rather than the current one.
    pub(super) fn spawn_on(
        &mut self,
        name: impl Into<String>,
        run: impl Future<Output = ()> + Send + 'static,
        runtime: &tokio::runtime::Handle,
    ) {
        let handle = self.set.spawn_on(run, runtime);
        self.names.insert(handle.id(), name.into());
    }

    /// Wait for the next loop to end; `None` once none is left.
    pub(super) async fn next_end(&mut self) -> Option<LoopEnd> {
        let ended = self.set.join_next_with_id().await?;
        Some(match ended {
            Ok((id, ())) => LoopEnd {
                name: self.name(id),
                panic: None,
            },
            Err(e) => LoopEnd {
                name: self.name(e.id()),
                panic: Some(panic_message(e)),
            },
        })
    }

    /// Wait for every loop to end (they were told to stop); the first that
    /// panicked, if any.
    pub(super) async fn join(&mut self) -> Option<LoopEnd> {
        let mut first = None;
        while let Some(end) = self.next_end().await {
            if end.panic.is_some() {
                tracing::error!(error = %end, "worker loop failed while stopping");
                first = first.or(Some(end));
            }
        }
        first
    }

    fn name(&mut self, id: Id) -> String {
        self.names.remove(&id).unwrap_or_else(|| "unknown".into())
    }
}

fn panic_message(e: JoinError) -> String {
    if e.is_cancelled() {
        return "aborted".into();
    }
    let payload = e.into_panic();
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}

/// A fault [`inject_fault`] makes a loop commit.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The loop panics.
    Panic,
    /// The loop returns, as if it were done.
    Return,
}

/// Whether any fault is waiting: the loops' check costs one atomic load.
static ANY_FAULT: AtomicBool = AtomicBool::new(false);
static FAULTS: Mutex<Vec<(String, String, Fault)>> = Mutex::new(Vec::new());

/// Test hook: the next time loop `name` (`fetch`, `delayed`) of a worker
/// consuming `queue` checks, it commits `fault`, once. Process-wide, keyed
/// by queue, so tests with queues of their own do not disturb each other.
#[doc(hidden)]
pub fn inject_fault(name: &str, queue: &str, fault: Fault) {
    let mut faults = FAULTS.lock().unwrap_or_else(|p| p.into_inner());
    faults.push((name.to_owned(), queue.to_owned(), fault));
    ANY_FAULT.store(true, Ordering::Release);
}

/// Commit a fault injected for loop `name` of `queue`: panic here, or
/// `true` when the loop must return.
pub(super) fn injected(name: &str, queue: &str) -> bool {
    if !ANY_FAULT.load(Ordering::Acquire) {
        return false;
    }
    let fault = {
        let mut faults = FAULTS.lock().unwrap_or_else(|p| p.into_inner());
        let at = faults.iter().position(|(n, q, _)| n == name && q == queue);
        at.map(|at| faults.remove(at).2)
    };
    match fault {
        Some(Fault::Panic) => panic!("injected fault in loop `{name}` of queue {queue}"),
        Some(Fault::Return) => true,
        None => false,
    }
}
