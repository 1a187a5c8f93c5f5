//! The issuing thread of a rank and the queue of tickets it serves: positions taken in program
//! order, filled from any thread, issued strictly in ticket order (see the parent module).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use burn_zero_launch::sync::lock;

use crate::counters::RankCounters;
use crate::error::CommError;
use crate::parked::{Parked, Unfinished};

/// A collective waiting for the issuing thread, with the group it runs on. It may leave work
/// behind that finishes once its collective has ([`Parked`]).
pub(super) type Call = Box<dyn FnOnce() -> Option<Box<dyn Unfinished>> + Send>;

/// The calls of one ticket. A ticket may carry several calls (they run back to back, in the
/// order they were submitted); it is done once its reservation is dropped.
struct Slot {
    calls: VecDeque<Call>,
    closed: bool,
}

struct Queue {
    /// The next ticket to hand out.
    next_ticket: u64,
    /// Tickets handed out and not yet done, by number.
    slots: BTreeMap<u64, Slot>,
    /// No handle is left: the thread ends once every reservation is done.
    stopping: bool,
}

/// The queue of tickets, shared by the issuing thread and every handle that takes or fills a
/// ticket.
pub(super) struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        lock(&self.queue)
    }

    /// Takes the next ticket: the next position in the rank's order.
    pub(super) fn take_ticket(&self) -> u64 {
        let mut queue = self.lock();
        let ticket = queue.next_ticket;
        queue.next_ticket += 1;
        queue.slots.insert(
            ticket,
            Slot {
                calls: VecDeque::new(),
                closed: false,
            },
        );
        ticket
    }

    /// Queues `call` in `ticket`'s position; an error when the position is already done.
    pub(super) fn push(&self, ticket: u64, call: Call) -> Result<(), CommError> {
        {
            let mut queue = self.lock();
            match queue.slots.get_mut(&ticket) {
                Some(slot) => slot.calls.push_back(call),
                None => return Err(stopped()),
            }
        }
        self.changed.notify_all();
        Ok(())
    }

    /// Closes `ticket`'s position: no call is added to it from now on.
    pub(super) fn close(&self, ticket: u64) {
        let mut queue = self.lock();
        match queue.slots.get_mut(&ticket) {
            // A position with nothing left to issue is done now (the issuing thread passes
            // over a ticket it no longer finds), so positions answered in place, or never
            // used, do not pile up while no issuing thread runs.
            Some(slot) if slot.calls.is_empty() => {
                queue.slots.remove(&ticket);
            }
            Some(slot) => slot.closed = true,
            None => {}
        }
        drop(queue);
        self.changed.notify_all();
    }
}

/// The issuing thread, started by the first collective and stopped when the last handle goes.
pub(super) struct Issuer {
    shared: Arc<Shared>,
    /// The rank's collectives and device synchronisations, counted as they are issued.
    counters: Arc<RankCounters>,
    /// The name the thread gets (it carries the rank).
    name: String,
    thread: Mutex<Started>,
}

/// Whether the issuing thread runs.
enum Started {
    /// No collective has been queued yet.
    Not,
    /// Running.
    Running(JoinHandle<()>),
    /// The system refused a thread: every collective fails with this reason.
    Failed(String),
    /// Stopped and joined.
    Joined,
}

impl Issuer {
    /// The issuing thread of a rank, not started yet, counting into `counters`; `name` is the
    /// name the thread will get.
    pub(super) fn new(counters: Arc<RankCounters>, name: String) -> Self {
        Issuer {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue {
                    next_ticket: 0,
                    slots: BTreeMap::new(),
                    stopping: false,
                }),
                changed: Condvar::new(),
            }),
            counters,
            name,
            thread: Mutex::new(Started::Not),
        }
    }

    /// The queue of tickets this thread serves.
    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The rank's counts.
    pub(super) fn counters(&self) -> &Arc<RankCounters> {
        &self.counters
    }

    /// Starts the thread unless it runs: a rank that never issues a collective costs no
    /// thread.
    pub(super) fn ensure_started(&self) -> Result<(), CommError> {
        let mut thread = lock(&self.thread);
        match &*thread {
            Started::Running(_) => Ok(()),
            Started::Failed(reason) => Err(CommError::InvalidGroup(reason.clone())),
            Started::Joined => Err(stopped()),
            Started::Not => {
                let serving = self.shared.clone();
                match std::thread::Builder::new()
                    .name(self.name.clone())
                    .spawn(move || issue(&serving))
                {
                    Ok(handle) => {
                        *thread = Started::Running(handle);
                        Ok(())
                    }
                    Err(error) => {
                        let reason =
                            format!("could not start the collective issuing thread: {error}");
                        *thread = Started::Failed(reason.clone());
                        Err(CommError::InvalidGroup(reason))
                    }
                }
            }
        }
    }
}

impl Drop for Issuer {
    fn drop(&mut self) {
        self.shared.lock().stopping = true;
        self.shared.changed.notify_all();
        let thread = std::mem::replace(&mut *lock(&self.thread), Started::Joined);
        if let Started::Running(thread) = thread
            && thread.join().is_err()
        {
            tracing::error!("the collective issuing thread panicked");
        }
    }
}

/// The error of a call on an issuing thread that has stopped.
pub(super) fn stopped() -> CommError {
    CommError::InvalidGroup("the collective issuing thread has stopped".into())
}

/// The issuing thread's loop: the calls of ticket 0, then of ticket 1, …, finishing the work
/// kept aside ([`Parked`]) between them as its collectives complete.
fn issue(shared: &Shared) {
    let mut serving = 0u64;
    let mut parked = Parked::default();
    loop {
        parked.finish_done();
        match next_call(shared, &mut serving, parked.is_empty()) {
            Next::Call(call) => {
                if let Some(work) = call() {
                    parked.park(work);
                }
            }
            Next::Idle => parked.idle(),
            Next::Stop => {
                parked.finish_all();
                return;
            }
        }
    }
}

/// What the issuing thread does next.
enum Next {
    Call(Call),
    /// Nothing to issue for [`Parked::POLL`], with work kept aside.
    Idle,
    Stop,
}

/// The next call in ticket order, waiting for one; with work kept aside (`!nothing_parked`),
/// waits at most [`Parked::POLL`].
fn next_call(shared: &Shared, serving: &mut u64, nothing_parked: bool) -> Next {
    let idle_from = Instant::now() + Parked::POLL;
    let mut queue = shared.lock();
    loop {
        let stopped = queue.stopping && queue.slots.is_empty();
        if *serving < queue.next_ticket && !queue.slots.contains_key(serving) {
            // Done before the thread came to it, as is every ticket before the first one
            // still open.
            let first_open = queue.slots.keys().next().copied();
            *serving = first_open.unwrap_or(queue.next_ticket).max(*serving + 1);
            continue;
        }
        match queue.slots.get_mut(serving) {
            Some(slot) => {
                if let Some(call) = slot.calls.pop_front() {
                    return Next::Call(call);
                }
                if slot.closed {
                    queue.slots.remove(serving);
                    *serving += 1;
                    continue;
                }
            }
            None if stopped => return Next::Stop,
            None => {}
        }
        if nothing_parked {
            queue = shared
                .changed
                .wait(queue)
                .unwrap_or_else(|p| p.into_inner());
        } else {
            // Woken for another ticket's change, it still turns idle at `idle_from`.
            let left = idle_from.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Next::Idle;
            }
            queue = shared
                .changed
                .wait_timeout(queue, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
