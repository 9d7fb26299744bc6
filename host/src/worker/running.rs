//! The messages a worker holds ([`Running`]), each from just before its
//! `start` until its completion is written, and the guard that releases
//! one ([`Registration`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::gauge::Gauge;

use crate::sandbox::CancelHandle;
use crate::store::Delivery;

/// A message this worker holds, and the attempt it runs.
struct Held {
    /// Shared by the messages of one batch.
    queue: Arc<str>,
    delivery: Delivery,
    /// The attempt `start` counted; `None` before `start` has answered, and
    /// for a message it decided not to run (whose completion is on its way).
    attempt: Option<u32>,
    cancel: CancelHandle,
    /// Where the attempt is ([`RUNNING`], [`STALE`], [`COMPLETING`]),
    /// shared with its registration.
    phase: Arc<AtomicU8>,
}

/// Where a held attempt is ([`Held::phase`]), as the heartbeat and its
/// executor see it. The two race (a beat may read the task hash just after
/// the attempt's own completion was written), and whichever moves it first
/// decides.
///
/// Held: starting or running its call.
const RUNNING: u8 = 0;
/// Found stale by the heartbeat (its task reclaimed elsewhere, or ended)
/// while running: interrupted, it writes nothing.
const STALE: u8 = 1;
/// Its call is over and its completion is on the way to the completer,
/// which writes it unless the completion script finds the attempt no longer
/// the task's. A beat that then finds the task ended has most likely met
/// that very completion (a carried attempt's leaves no trace of its
/// worker), and there is nothing left to stop.
const COMPLETING: u8 = 2;

/// [`Held`] messages by registration id; foldhash: the ids are this
/// process's own, and the map is hashed into three times per task.
type HeldById = HashMap<u64, Held, foldhash::fast::RandomState>;

/// The messages this worker holds: each from just before its `start` until
/// its completion is written. The heartbeat keeps those of started attempts
/// and stamps each attempt still the task's; reclaim leaves alone this
/// worker's own idle messages that are held here; a cancel request finds
/// the attempt's handle here.
///
/// Entries are keyed by a registration id, not by task id: one task can have
/// two attempts here for a moment (a stale one being stopped and the next),
/// and ending the old one must not remove the new one's entry (its
/// heartbeats would stop, and a live attempt would be reclaimed as lost).
#[derive(Default)]
pub(super) struct Running {
    held: Mutex<HeldById>,
    next_id: AtomicU64,
    /// `dtq_worker_tasks_in_flight`: one per registration alive.
    in_flight: Gauge,
}

impl Running {
    /// An empty set that counts its registrations in `in_flight`.
    pub(super) fn counted(in_flight: Gauge) -> Running {
        Running {
            in_flight,
            ..Running::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HeldById> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hold each message of `deliveries` of `queue` until its returned
    /// guard is dropped (one guard per message, in order). One counts as a
    /// running attempt once [`Running::started_as`] says which.
    pub(super) fn hold(
        self: &Arc<Self>,
        queue: &Arc<str>,
        deliveries: &[Delivery],
    ) -> Vec<Registration> {
        let mut held = self.lock();
        self.hold_locked(&mut held, queue, deliveries)
    }

    /// [`Running::hold`], the set already locked.
    fn hold_locked(
        self: &Arc<Self>,
        held: &mut HeldById,
        queue: &Arc<str>,
        deliveries: &[Delivery],
    ) -> Vec<Registration> {
        let registrations = deliveries
            .iter()
            .map(|delivery| {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let cancel = CancelHandle::new();
                let phase = Arc::new(AtomicU8::new(RUNNING));
                held.insert(
                    id,
                    Held {
                        queue: queue.clone(),
                        // The message, not the task it may carry (its payload).
                        delivery: Delivery {
                            msg_id: delivery.msg_id.clone(),
                            task_id: delivery.task_id.clone(),
                            carried: None,
                        },
                        attempt: None,
                        cancel: cancel.clone(),
                        phase: phase.clone(),
                    },
                );
                Registration {
                    running: self.clone(),
                    id,
                    cancel,
                    phase,
                }
            })
            .collect();
        self.in_flight.inc_by(deliveries.len() as i64);
        registrations
    }

    /// Hold each message of `deliveries` of `queue` that is not held yet,
    /// at most `max` of them, in one step: the messages taken, each with
    /// its guard. Two loops that find the same pending message (the
    /// reclaim of this worker's own, and the fetch loop reading them back)
    /// cannot both take it, so one delivery never runs twice at once.
    pub(super) fn hold_unheld(
        self: &Arc<Self>,
        queue: &Arc<str>,
        deliveries: Vec<Delivery>,
        max: usize,
    ) -> (Vec<Delivery>, Vec<Registration>) {
        let mut held = self.lock();
        let mut taken = Vec::new();
        for delivery in deliveries {
            if taken.len() == max {
                break;
            }
            let dup = |h: &Held| h.queue == *queue && h.delivery.msg_id == delivery.msg_id;
            if held.values().any(dup)
                || taken.iter().any(|d: &Delivery| d.msg_id == delivery.msg_id)
            {
                continue;
            }
            taken.push(delivery);
        }
        let registrations = self.hold_locked(&mut held, queue, &taken);
        (taken, registrations)
    }

    /// Each registration of `started` runs its task as the attempt given,
    /// from now on.
    pub(super) fn started_as<'a>(
        &self,
        started: impl IntoIterator<Item = (&'a Registration, u32)>,
    ) {
        let mut held = self.lock();
        for (registration, attempt) in started {
            if let Some(h) = held.get_mut(&registration.id) {
                h.attempt = Some(attempt);
            }
        }
    }

    /// Whether message `msg_id` of `queue` is held.
    #[cfg(test)]
    fn holds(&self, queue: &str, msg_id: &str) -> bool {
        self.lock()
            .values()
            .any(|h| &*h.queue == queue && h.delivery.msg_id == msg_id)
    }

    /// Interrupt every attempt of task `task_id` of `queue` held here;
    /// whether there was one.
    pub(super) fn cancel_task(&self, queue: &str, task_id: &str) -> bool {
        let held = self.lock();
        let mut found = false;
        for h in held
            .values()
            .filter(|h| &*h.queue == queue && h.delivery.task_id == task_id)
        {
            h.cancel.cancel();
            found = true;
        }
        found
    }

    /// Interrupt the attempt registered as `id`, if it is still held.
    pub(super) fn cancel(&self, id: u64) {
        if let Some(h) = self.lock().get(&id) {
            h.cancel.cancel();
        }
    }

    /// Stop the attempt registered as `id` as stale: interrupted, and it
    /// hands over no completion. Returns it the first time only, and only
    /// while its call runs: one whose completion is already on its way is
    /// left to it (the completion script refuses one that is not the
    /// task's attempt).
    pub(super) fn stop_stale(&self, id: u64) -> Option<(Delivery, u32)> {
        let held = self.lock();
        let h = held.get(&id)?;
        h.phase
            .compare_exchange(RUNNING, STALE, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        h.cancel.cancel();
        Some((h.delivery.clone(), h.attempt.unwrap_or(0)))
    }

    /// The started attempts, by queue: registration id, delivery, attempt.
    pub(super) fn started(&self) -> HashMap<String, Vec<(u64, Delivery, u32)>> {
        let mut by_queue: HashMap<String, Vec<_>> = HashMap::new();
        for (id, h) in self.lock().iter() {
            if let Some(attempt) = h.attempt {
                by_queue.entry(h.queue.to_string()).or_default().push((
                    *id,
                    h.delivery.clone(),
                    attempt,
                ));
            }
        }
        by_queue
    }

    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// A message's entry in [`Running`], removed when this is dropped however
/// its task ends (even by a panic): an entry left behind would keep the
/// heartbeat refreshing a message nobody holds, and it would never be
/// reclaimed.
pub(super) struct Registration {
    running: Arc<Running>,
    id: u64,
    cancel: CancelHandle,
    phase: Arc<AtomicU8>,
}

impl Registration {
    /// The handle that interrupts the attempt's sandbox call.
    pub(super) fn cancel_handle(&self) -> &CancelHandle {
        &self.cancel
    }

    /// Whether the attempt was found stale: its task was reclaimed by
    /// another worker, and it must write nothing.
    #[cfg(test)]
    fn is_stale(&self) -> bool {
        self.phase.load(Ordering::Acquire) == STALE
    }

    /// The attempt's call is over: its completion goes to the completer,
    /// and from now on a beat that finds the task not this attempt's stops
    /// nothing. `false` when a beat found it stale first: it must write
    /// nothing.
    pub(super) fn begin_completion(&self) -> bool {
        self.phase
            .compare_exchange(RUNNING, COMPLETING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.running.lock().remove(&self.id);
        self.running.in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(msg_id: &str, task_id: &str) -> Delivery {
        Delivery {
            msg_id: msg_id.into(),
            task_id: task_id.into(),
            carried: None,
        }
    }

    /// Hold `deliveries` of queue `q`.
    fn hold<const N: usize>(
        running: &Arc<Running>,
        deliveries: [Delivery; N],
    ) -> [Registration; N] {
        let held = running.hold(&"q".into(), &deliveries);
        held.try_into().ok().expect("one registration per delivery")
    }

    #[test]
    fn a_new_attempt_of_a_task_outlives_the_old_ones_registration() {
        let running = Arc::new(Running::default());
        // Attempt 1 of task t, then attempt 2 of the same task (reclaimed
        // here, on another message, while attempt 1 is still being ended).
        let [old] = hold(&running, [delivery("1-0", "t")]);
        running.started_as([(&old, 1)]);
        let [new] = hold(&running, [delivery("2-0", "t")]);
        running.started_as([(&new, 2)]);
        drop(old);

        // The new attempt is still held, still beaten for, and a cancel of
        // the task still finds it.
        assert!(running.holds("q", "2-0"));
        assert!(!running.holds("q", "1-0"));
        let started = running.started();
        assert_eq!(started.len(), 1);
        let beats: Vec<(&str, u32)> = started["q"]
            .iter()
            .map(|(_, d, attempt)| (d.msg_id.as_str(), *attempt))
            .collect();
        assert_eq!(beats, [("2-0", 2)]);
        assert!(running.cancel_task("q", "t"));
        assert!(new.cancel_handle().is_cancelled());

        drop(new);
        assert_eq!(running.len(), 0);
        assert!(!running.cancel_task("q", "t"));
    }

    #[test]
    fn the_same_message_held_twice_is_released_once_per_registration() {
        let running = Arc::new(Running::default());
        let [first, second] = hold(&running, [delivery("1-0", "t"), delivery("1-0", "t")]);
        drop(first);
        assert!(running.holds("q", "1-0"));
        drop(second);
        assert!(!running.holds("q", "1-0"));
    }

    #[test]
    fn a_message_held_already_is_not_taken_again() {
        let running = Arc::new(Running::default());
        // Being run here, then read back (or reclaimed) with two others,
        // one of them twice, and room for one only at first.
        let [_run] = hold(&running, [delivery("1-0", "a")]);
        let pending = || {
            vec![
                delivery("1-0", "a"),
                delivery("2-0", "b"),
                delivery("2-0", "b"),
            ]
        };
        let (taken, holds) = running.hold_unheld(&"q".into(), pending(), 1);
        let ids: Vec<&str> = taken.iter().map(|d| d.msg_id.as_str()).collect();
        assert_eq!((ids, holds.len()), (vec!["2-0"], 1));
        // Read back again while those run: nothing left to take.
        let (taken, holds) = running.hold_unheld(&"q".into(), pending(), 8);
        assert!(taken.is_empty() && holds.is_empty(), "{taken:?}");
        assert_eq!(running.len(), 2);
    }

    #[test]
    fn only_started_attempts_are_beaten_for_and_a_stale_one_is_stopped_once() {
        let running = Arc::new(Running::default());
        let [starting, run] = hold(&running, [delivery("1-0", "a"), delivery("2-0", "b")]);
        assert_eq!(running.in_flight.get(), 2);
        running.started_as([(&run, 3)]);
        let started = running.started();
        let ids: Vec<u64> = started["q"].iter().map(|(id, _, _)| *id).collect();
        assert_eq!(ids.len(), 1);

        let stopped = running.stop_stale(ids[0]);
        assert_eq!(
            stopped.map(|(d, attempt)| (d.task_id, attempt)),
            Some(("b".to_owned(), 3))
        );
        assert!(run.is_stale() && run.cancel_handle().is_cancelled());
        assert!(running.stop_stale(ids[0]).is_none(), "reported twice");
        assert!(!starting.is_stale() && !starting.cancel_handle().is_cancelled());

        // Once its registration is gone, a late report touches nothing.
        drop(run);
        assert!(running.stop_stale(ids[0]).is_none());
    }

    #[test]
    fn an_attempt_whose_completion_is_on_its_way_is_not_stopped_as_stale() {
        let running = Arc::new(Running::default());
        let [done, stale] = hold(&running, [delivery("1-0", "a"), delivery("2-0", "b")]);
        running.started_as([(&done, 1), (&stale, 1)]);
        let id = |msg_id: &str| {
            running.started()["q"]
                .iter()
                .find(|(_, d, _)| d.msg_id == msg_id)
                .map(|(id, _, _)| *id)
                .expect("beaten for")
        };
        let (done_id, stale_id) = (id("1-0"), id("2-0"));

        // Its call ended and its completion went to the completer; a beat
        // that then finds the task ended (that very completion, written)
        // stops nothing and reports nothing. It is still beaten for until
        // its completion is written.
        assert!(done.begin_completion());
        assert!(running.stop_stale(done_id).is_none(), "reported");
        assert!(!done.is_stale() && !done.cancel_handle().is_cancelled());
        assert_eq!(running.started()["q"].len(), 2);

        // Found stale first: it may not hand over a completion.
        assert!(running.stop_stale(stale_id).is_some());
        assert!(!stale.begin_completion());
        assert!(stale.is_stale());
    }
}
