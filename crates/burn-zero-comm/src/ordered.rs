//! `OrderedComm`: every collective of a rank issued from one thread, in one order that the
//! submitting threads fix, whatever thread does the work around it.
//!
//! # Why
//!
//! A rank of a ZeRO job has two streams of collectives: the training thread's (parameter
//! gathers in forward and backward, the optimizer's reductions) and the gradient reductions of
//! the communication thread that overlaps backward. NCCL collectives block on the device until
//! every rank has joined the same one; with two communicators driven from two threads, rank 0
//! may issue `gather, reduce` while rank 1 issues `reduce, gather`, and each waits forever
//! for the other. The order in which the communication thread gets to a reduction depends on
//! timing (how long packing took), so it differs between ranks even when their programs do
//! not.
//!
//! # The ordering argument
//!
//! 1. A collective's *position* is a ticket, taken by [`OrderedComm::reserve`] (or implicitly
//!    by a direct call). Tickets are numbered from one counter per rank.
//! 2. Tickets are taken on the training thread only, in program order: forward ops, then the
//!    backward hooks in autodiff's deterministic order, then the end of backward and the
//!    optimizer. A hook that completes a gradient bucket takes the bucket's ticket right
//!    there, before returning; the communication thread fills it later (after packing). So the
//!    sequence of tickets is a function of the program and the hook order alone, the same on
//!    every rank whose graph is the same; no thread timing enters it.
//! 3. One issuing thread runs the collectives strictly in ticket order: it waits for the call
//!    of ticket `n` (however late its submitter is) before it looks at ticket `n + 1`, and it
//!    runs one collective at a time on one communicator.
//!
//! Hence every rank issues the same collectives in the same order from one thread, which is
//! what NCCL requires; a rank whose program differs (a rank-dependent parameter use at stage 3)
//! issues a different sequence, which the engine's schedule check reports as a mismatch
//! naming both calls instead of hanging.
//!
//! Liveness: the submitter of a reserved ticket needs nothing from later tickets to fill it
//! (a bucket's gradients are all handed over before its ticket is taken), so the issuing
//! thread never waits on a ticket that waits on it. A gather's submitter waits for its
//! result; a bucket reduction's submitter does not (its reservation is filled and waited on
//! by the communication thread).
//!
//! # Who waits for the device
//!
//! The issuing thread issues a data collective ([`Communicator::issue`]) and goes on to the
//! next ticket; the thread that asked for the result waits for the device to finish it
//! ([`Issued::wait`]), on engines that can defer that wait (NCCL). A gather issued ahead of use
//! is then usually complete when the training thread reads it. Work run with
//! [`Reservation::run`] reads its results on the issuing thread, which waits there; work run
//! with [`Reservation::run_deferred`] (a bucket's pack and reduction, then its unpack) is kept
//! aside on the issuing thread while its collective runs and finished there once the device
//! says it is done, asked between positions (`parked`).
//!
//! # Whose device queue
//!
//! On cubecl backends (plain or under Burn's fusion layer) each thread queues its device work
//! on its own stream, with its own memory pools, and a buffer's memory is reused in the order
//! of the stream that allocated it.
//! The issuing thread therefore runs a position's device work in the queue of the thread that
//! took the position and reads its results ([`burn_zero_kernels::ThreadQueue`]): allocated
//! there, a gathered block or an unpacked gradient shard is reused there once dropped, after
//! the reader's kernels that read it. (Allocated in the issuing thread's queue, its memory
//! could go to that thread's next collective while the reader's kernels still read it.)
//!
//! # One rank
//!
//! A group of one rank needs no engine for its data collectives: a gather of one block, a
//! reduction over one rank (sum, mean, maximum or minimum) and a broadcast from rank 0 all
//! return their input, bit for bit. A reservation on such a group answers them in place, on
//! the calling thread: no engine call, no copy, no device synchronisation, and no issuing
//! thread (a single-GPU run never starts one). They keep their positions, so a position that
//! also carries another group's collective ([`Reservation::on_group`]) keeps its order, and
//! they are counted by kind and as answered in place.
//!
//! The layer is engine-agnostic: it wraps any [`Communicator`], so the order it enforces is
//! tested on CPU with [`crate::LocalGroup`] and used unchanged with NCCL.

use std::collections::{BTreeMap, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use burn_zero_launch::sync::lock;
use std::thread::JoinHandle;
use std::time::Instant;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_kernels::{QueueMark, ThreadQueue};

use crate::call::ReduceOp;
use crate::communicator::Communicator;
use crate::communicator::DataOp;
use crate::counters::{CollectiveKind, RankCounters};
use crate::error::CommError;
use crate::issued::Issued;
use crate::parked::{Parked, Unfinished};

/// A collective waiting for the issuing thread, with the group it runs on. It may leave work
/// behind that finishes once its collective has ([`Parked`]).
type Call = Box<dyn FnOnce() -> Option<Box<dyn Unfinished>> + Send>;

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

struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        lock(&self.queue)
    }
}

/// The issuing thread, started by the first collective and stopped when the last handle goes.
struct Issuer {
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
    /// Starts the thread unless it runs: a rank that never issues a collective costs no
    /// thread.
    fn ensure_started(&self) -> Result<(), CommError> {
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

fn stopped() -> CommError {
    CommError::InvalidGroup("the collective issuing thread has stopped".into())
}

/// A rank's communicator behind its issuing thread: every collective of every clone (and of
/// every [`Reservation`]) runs on that one thread, in ticket order.
///
/// A direct call ([`Communicator::all_gather`] and the others) takes the next ticket and waits
/// for its result. [`OrderedComm::reserve`] takes a ticket now and lets any thread fill it
/// later. [`Communicator::abort`] goes straight to the engine: it must reach a collective that
/// is running. A group [`Communicator::split`] from it is ordered by the same thread, so the
/// collectives of the rank's groups together keep one order.
pub struct OrderedComm<B: Backend> {
    /// The group this handle's collectives run on.
    inner: Arc<dyn Communicator<B>>,
    issuer: Arc<Issuer>,
}

impl<B: Backend> Clone for OrderedComm<B> {
    fn clone(&self) -> Self {
        OrderedComm {
            inner: self.inner.clone(),
            issuer: self.issuer.clone(),
        }
    }
}

impl<B: Backend> OrderedComm<B> {
    /// The ordered handle of `inner`'s rank. The issuing thread starts with the first
    /// collective and ends when the last handle (clones, split groups, reservations) goes.
    pub fn new(inner: Arc<dyn Communicator<B>>) -> Self {
        let counters = Arc::new(RankCounters::default());
        inner.count_into(&counters);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                next_ticket: 0,
                slots: BTreeMap::new(),
                stopping: false,
            }),
            changed: Condvar::new(),
        });
        OrderedComm {
            issuer: Arc::new(Issuer {
                shared,
                counters,
                name: format!("burn-zero-issue-{}", inner.rank()),
                thread: Mutex::new(Started::Not),
            }),
            inner,
        }
    }

    /// The rank's counts: every collective issued through this thread, by kind, and the
    /// device synchronisation before each. Other parts of the rank (the gradient reducer, the
    /// optimizer) count theirs here too.
    pub fn counters(&self) -> &Arc<RankCounters> {
        &self.issuer.counters
    }

    /// Whether `other` is a handle on the same issuing thread (a clone, or a group split from
    /// this one).
    pub fn same_order(&self, other: &OrderedComm<B>) -> bool {
        Arc::ptr_eq(&self.issuer, &other.issuer)
    }

    /// The engine underneath.
    pub fn inner(&self) -> &Arc<dyn Communicator<B>> {
        &self.inner
    }

    /// This handle with its engine wrapped by `wrap` (a [`crate::RankOrderReduction`]): the
    /// same rank's one order and issuing thread, the same group, another way of running its
    /// collectives. Groups split from the result are wrapped as the wrapper splits them.
    pub fn with_engine(
        &self,
        wrap: impl FnOnce(Arc<dyn Communicator<B>>) -> Arc<dyn Communicator<B>>,
    ) -> OrderedComm<B> {
        let inner = wrap(self.inner.clone());
        inner.count_into(&self.issuer.counters);
        OrderedComm {
            inner,
            issuer: self.issuer.clone(),
        }
    }

    /// [`Communicator::split`], keeping the type: the new group's collectives take tickets
    /// from this rank's one counter, and one position can carry collectives of several such
    /// groups ([`Reservation::on_group`]).
    pub fn split_ordered(&self, color: usize) -> Result<OrderedComm<B>, CommError> {
        let inner = self.reserve().split(color)?;
        inner.count_into(&self.issuer.counters);
        Ok(OrderedComm {
            inner,
            issuer: self.issuer.clone(),
        })
    }

    /// Takes the next position in this rank's order of collectives. The reservation's calls,
    /// from whatever thread, run in that position; the position is done when the reservation
    /// is dropped (with no call, it is skipped).
    pub fn reserve(&self) -> Reservation<B> {
        let mut queue = self.issuer.shared.lock();
        let ticket = queue.next_ticket;
        queue.next_ticket += 1;
        queue.slots.insert(
            ticket,
            Slot {
                calls: VecDeque::new(),
                closed: false,
            },
        );
        drop(queue);
        Reservation {
            ticket,
            rank: self.inner.rank(),
            world_size: self.inner.world_size(),
            inner: self.inner.clone(),
            shared: self.issuer.shared.clone(),
            open: Arc::new(Open {
                ticket,
                shared: self.issuer.shared.clone(),
                issuer: self.issuer.clone(),
                spans_groups: AtomicBool::new(false),
            }),
            // The thread taking the position is the one that reads its results.
            reader: ThreadQueue::current::<B>(),
        }
    }
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

/// A position in a rank's order of collectives, taken with [`OrderedComm::reserve`]. Its
/// collectives run there, on the issuing thread; the calling thread waits for each result.
pub struct Reservation<B: Backend> {
    ticket: u64,
    rank: usize,
    world_size: usize,
    inner: Arc<dyn Communicator<B>>,
    shared: Arc<Shared>,
    /// The position stays open while any handle on it ([`Self::on_group`]) lives.
    open: Arc<Open>,
    /// The device queue the position's device work runs in (see [`Self::run`]).
    reader: ThreadQueue,
}

/// Closes a position when its last handle goes.
struct Open {
    ticket: u64,
    shared: Arc<Shared>,
    /// Keeps the issuing thread alive while the reservation is open.
    issuer: Arc<Issuer>,
    /// Whether a handle on another group shares the position ([`Reservation::on_group`]).
    spans_groups: AtomicBool,
}

impl Drop for Open {
    fn drop(&mut self) {
        let mut queue = self.shared.lock();
        match queue.slots.get_mut(&self.ticket) {
            // A position with nothing left to issue is done now (the issuing thread passes
            // over a ticket it no longer finds), so positions answered in place, or never
            // used, do not pile up while no issuing thread runs.
            Some(slot) if slot.calls.is_empty() => {
                queue.slots.remove(&self.ticket);
            }
            Some(slot) => slot.closed = true,
            None => {}
        }
        drop(queue);
        self.shared.changed.notify_all();
    }
}

impl<B: Backend> Reservation<B> {
    /// The reservation's position (0-based) in the rank's order.
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// A handle on this same position whose collectives run on `group`, another group of
    /// this rank behind the same issuing thread (split from it with
    /// [`OrderedComm::split_ordered`]). The position's calls on both run back to back in the
    /// order they are made, and it closes when both handles are gone: a hybrid-sharded bucket
    /// is reduce-scattered in its shard group and all-reduced across the groups in one
    /// position.
    pub fn on_group(&self, group: &OrderedComm<B>) -> Result<Reservation<B>, CommError> {
        if !Arc::ptr_eq(&self.shared, &group.issuer.shared) {
            return Err(CommError::InvalidGroup(
                "a reservation can carry the collectives of groups behind its own issuing \
                 thread only"
                    .into(),
            ));
        }
        self.open.spans_groups.store(true, Ordering::Relaxed);
        Ok(Reservation {
            ticket: self.ticket,
            rank: group.inner.rank(),
            world_size: group.inner.world_size(),
            inner: group.inner.clone(),
            shared: self.shared.clone(),
            open: self.open.clone(),
            reader: self.reader,
        })
    }

    /// This position's results are read to host memory by the work given to [`Self::run`] or
    /// [`Self::run_deferred`] itself, on the issuing thread (a gradient shard the optimizer
    /// steps on the host): its device work then runs in the issuing thread's own queue, as
    /// nothing of it is handed to another thread's. In the taker's queue, the read would wait
    /// for everything that thread had queued by then (backward's kernels).
    pub fn read_on_issuing_thread(mut self) -> Self {
        self.reader = ThreadQueue::none();
        self
    }

    /// Finishes this thread's pending work on `input`'s device before another thread reads
    /// it, or marks it for that thread to be ordered after ([`settle`]).
    fn settle(&self, input: &Tensor<B, 1>) -> Result<QueueMark, CommError> {
        settle(self.inner.as_ref(), &self.open.issuer.counters, input)
    }

    /// The engine this reservation's collectives run on (for [`Self::run`]'s work).
    pub fn engine(&self) -> &Arc<dyn Communicator<B>> {
        &self.inner
    }

    /// Whether this reservation's group has one rank, so its data collectives are answered
    /// in place (see the module's documentation).
    pub fn is_alone(&self) -> bool {
        self.world_size == 1
    }

    /// Whether work given to [`Self::run`] or [`Self::run_deferred`] runs here, on the calling
    /// thread: a group of one rank whose position carries no other group's collectives.
    fn runs_here(&self) -> bool {
        self.is_alone() && !self.open.spans_groups.load(Ordering::Relaxed)
    }

    /// Answers a data collective of a group of one rank in place: counted, and `result` (the
    /// input) returned as it is.
    fn in_place<T>(&self, kind: CollectiveKind, result: T) -> Result<T, CommError> {
        self.count(kind);
        self.open.issuer.counters.in_place();
        Ok(result)
    }

    /// A collective of `kind` on `input`: answered in place on a group of one rank; otherwise
    /// `input` is finished on the device, then `op` is issued on the issuing thread, which
    /// goes on to the next position at once; this thread waits for the device to finish it
    /// ([`Issued::wait`]) just before it takes the result.
    fn data_collective(
        &self,
        kind: CollectiveKind,
        input: Tensor<B, 1>,
        op: DataOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        if self.is_alone() {
            return self.in_place(kind, input);
        }
        self.count(kind);
        let written = self.settle(&input)?;
        let reader = self.reader;
        self.submit(move |comm| {
            reader.run(|| {
                written.order_here();
                comm.issue(op, input)
            })
        })?
        .wait()
    }

    /// Runs `work` on the issuing thread in this reservation's position and returns its
    /// result: work that prepares a collective's input, issues the collective on the engine it
    /// is given, and takes the output apart, all on one thread — so the input it prepares
    /// needs no device synchronisation before the collective reads it (what it receives from
    /// other threads must be finished for any thread already). `kinds` are the collectives
    /// `work` issues, counted as if issued here.
    ///
    /// The device work of a position runs on the issuing thread but in the device queue of
    /// the thread that took the position ([`ThreadQueue`]), which reads the results: the
    /// buffers it allocates (a collective's output, a packed or unpacked bucket) belong to
    /// that queue, so that when the reader drops them their memory is reused after the
    /// reader's kernels, not in the issuing thread's queue while those kernels may still read
    /// it. Only an uploaded block ([`Self::all_gather_later_from`]) stays in the issuing
    /// thread's queue (the collective alone reads it), and so does the work of a position
    /// whose results the work reads to host memory itself ([`Self::read_on_issuing_thread`]).
    ///
    /// On a group of one rank whose position carries no other group's collectives, `work`
    /// runs here, on the calling thread, given this reservation, which answers its data
    /// collectives in place (and counts them itself).
    pub fn run<T: Send + 'static>(
        self,
        kinds: &[CollectiveKind],
        work: impl FnOnce(&dyn Communicator<B>) -> Result<T, CommError> + Send + 'static,
    ) -> Result<T, CommError> {
        if self.runs_here() {
            return work(&self);
        }
        for &kind in kinds {
            self.count(kind);
        }
        let reader = self.reader;
        self.submit(move |comm| reader.run(|| work(comm)))
    }

    /// [`Self::run`] for work whose collective the issuing thread need not wait for before
    /// it goes on: `start` prepares the input and issues the collective on the engine it is
    /// given, returning it with whatever `then` needs; `then` takes the collective's result
    /// apart on the issuing thread once the device has finished it, asked between later
    /// positions (`parked`). Returns at once; the result arrives in the [`Deferred`].
    /// `kinds` are counted as in [`Self::run`].
    ///
    /// On a group of one rank whose position carries no other group's collectives, both run
    /// here, on the calling thread, given this reservation.
    ///
    /// When `start` fails on the issuing thread, the group is ended: the position's collective
    /// may not have been issued, and no rank may pair its next collective with a wrong one.
    pub fn run_deferred<U, T, E>(
        self,
        kinds: &[CollectiveKind],
        start: impl FnOnce(&dyn Communicator<B>) -> Result<(Issued<B>, U), E> + Send + 'static,
        then: impl FnOnce(Tensor<B, 1>, U) -> Result<T, E> + Send + 'static,
    ) -> Result<Deferred<T, E>, CommError>
    where
        U: Send + 'static,
        T: Send + 'static,
        E: From<CommError> + std::fmt::Display + Send + 'static,
    {
        let (answer, result) = sync_channel(1);
        if self.runs_here() {
            let outcome = start(&self).and_then(|(issued, state)| then(issued.wait()?, state));
            let _ = answer.send(outcome);
            return Ok(Deferred(result));
        }
        for &kind in kinds {
            self.count(kind);
        }
        let comm = self.inner.clone();
        let reader = self.reader;
        self.queue(Box::new(move || {
            match guarded::<B, _, E>(comm.as_ref(), || reader.run(|| start(comm.as_ref()))) {
                Ok((issued, state)) => Some(Box::new(AfterCollective {
                    issued,
                    state,
                    then,
                    answer,
                    comm,
                    reader,
                }) as Box<dyn Unfinished>),
                Err(error) => {
                    // The position's collective may not have been issued: no other rank may
                    // pair its own with this rank's next one.
                    comm.abort(&format!("work before a collective failed: {error}"));
                    let _ = answer.send(Err(error));
                    None
                }
            }
        }))?;
        Ok(Deferred(result))
    }

    /// All-gathers `block` in this reservation's position without waiting for it: the
    /// caller goes on and takes the result later ([`Pending::wait`]). A prefetch: the
    /// position is taken now, in program order, so every rank issues it at the same point of
    /// its order however late it reads the result. Dropping the [`Pending`] discards the
    /// result (the collective still runs, as on every other rank).
    pub fn all_gather_later(self, block: Tensor<B, 1>) -> Result<Pending<B>, CommError> {
        if self.is_alone() {
            let gathered = self.in_place(CollectiveKind::AllGather, block)?;
            return Ok(Pending(Answer::Ready(Issued::ready(gathered))));
        }
        self.count(CollectiveKind::AllGather);
        let written = self.settle(&block)?;
        let reader = self.reader;
        let result = self.push(move |comm| {
            reader.run(|| {
                written.order_here();
                comm.issue(DataOp::AllGather, block)
            })
        })?;
        Ok(Pending(Answer::Queued(result)))
    }

    /// [`Self::all_gather_later`] of the block `prepare` makes, on the issuing thread, just
    /// before the gather: a block uploaded there from host memory is copied in the issuing
    /// thread's stream, beside the caller's work rather than in front of it, and an engine
    /// that orders its inputs on the device ([`Communicator::orders_inputs_on_device`]) runs
    /// the gather after the copy in that stream. Nothing the caller queued is read, so the
    /// caller's work is not finished first; for another engine the block is finished on the
    /// issuing thread instead (the other ranks' threads read it). On a group of one rank
    /// `prepare` runs here and the gather is answered in place.
    pub fn all_gather_later_from(
        self,
        prepare: impl FnOnce() -> Tensor<B, 1> + Send + 'static,
    ) -> Result<Pending<B>, CommError> {
        if self.is_alone() {
            let gathered = self.in_place(CollectiveKind::AllGather, prepare())?;
            return Ok(Pending(Answer::Ready(Issued::ready(gathered))));
        }
        self.count(CollectiveKind::AllGather);
        let counters = self.open.issuer.counters.clone();
        let reader = self.reader;
        let result = self.push(move |comm| {
            let block = prepare();
            // Made on this thread: an engine that orders on the device needs no mark of it.
            if !comm.orders_inputs_on_device() {
                settle(comm, &counters, &block)?;
            }
            // The output is the reader's (see `Reservation::run`); the block stays this
            // thread's, read by the collective only.
            reader.run(|| comm.issue(DataOp::AllGather, block))
        })?;
        Ok(Pending(Answer::Queued(result)))
    }

    fn count(&self, kind: CollectiveKind) {
        self.open.issuer.counters.collective(kind);
    }

    /// Queues `collective` on the issuing thread, in this reservation's position; its result
    /// arrives on the returned channel.
    fn push<T: Send + 'static>(
        &self,
        collective: impl FnOnce(&dyn Communicator<B>) -> Result<T, CommError> + Send + 'static,
    ) -> Result<Receiver<Result<T, CommError>>, CommError> {
        let (answer, result) = sync_channel(1);
        let comm = self.inner.clone();
        self.queue(Box::new(move || {
            let comm = comm.as_ref();
            let _ = answer.send(guarded(comm, || collective(comm)));
            None
        }))?;
        Ok(result)
    }

    /// Queues `call` on the issuing thread, in this reservation's position.
    fn queue(&self, call: Call) -> Result<(), CommError> {
        self.open.issuer.ensure_started()?;
        {
            let mut queue = self.shared.lock();
            match queue.slots.get_mut(&self.ticket) {
                Some(slot) => slot.calls.push_back(call),
                None => return Err(stopped()),
            }
        }
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Runs `collective` on the issuing thread, in this reservation's position, and returns
    /// its result.
    fn submit<T: Send + 'static>(
        &self,
        collective: impl FnOnce(&dyn Communicator<B>) -> Result<T, CommError> + Send + 'static,
    ) -> Result<T, CommError> {
        self.push(collective)?
            .recv()
            .unwrap_or_else(|_| Err(stopped()))
    }
}

/// Runs `work` on the issuing thread; a panic in it ends `comm`'s group (the position's
/// collective may not have run) and is returned as the rank's failure.
fn guarded<B: Backend, T, E: From<CommError>>(
    comm: &dyn Communicator<B>,
    work: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|_| {
        let reason = "a collective panicked on the issuing thread".to_string();
        comm.abort(&reason);
        Err(E::from(CommError::PeerFailed {
            rank: comm.rank(),
            reason,
        }))
    })
}

/// Work of [`Reservation::run_deferred`] kept aside while its collective runs.
struct AfterCollective<B: Backend, U, F, T, E> {
    issued: Issued<B>,
    state: U,
    then: F,
    answer: SyncSender<Result<T, E>>,
    comm: Arc<dyn Communicator<B>>,
    /// Where `then` runs its device work (see [`Reservation::run`]).
    reader: ThreadQueue,
}

impl<B, U, F, T, E> Unfinished for AfterCollective<B, U, F, T, E>
where
    B: Backend,
    U: Send,
    F: FnOnce(Tensor<B, 1>, U) -> Result<T, E> + Send,
    T: Send,
    E: From<CommError> + Send,
{
    /// An engine that cannot tell without waiting is treated as done: its work finishes at
    /// once, waiting, as [`Reservation::run`]'s would.
    fn is_done(&self) -> bool {
        self.issued.is_done().unwrap_or(true)
    }

    fn finish(self: Box<Self>) {
        let AfterCollective {
            issued,
            state,
            then,
            answer,
            comm,
            reader,
        } = *self;
        let outcome = guarded(comm.as_ref(), || reader.run(|| then(issued.wait()?, state)));
        let _ = answer.send(outcome);
    }
}

/// The result of work run with [`Reservation::run_deferred`].
pub struct Deferred<T, E = CommError>(Receiver<Result<T, E>>);

impl<T, E: From<CommError>> Deferred<T, E> {
    /// Waits for the result.
    pub fn wait(self) -> Result<T, E> {
        self.0.recv().unwrap_or_else(|_| Err(E::from(stopped())))
    }

    /// The result once it has arrived; `None` while the work is still to finish.
    pub fn try_take(&self) -> Option<Result<T, E>> {
        match self.0.try_recv() {
            Ok(result) => Some(result),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Err(E::from(stopped()))),
        }
    }
}

/// Finishes the calling thread's pending work on `input`'s device before another thread reads
/// it: on backends with a queue per thread (cubecl's wgpu and CUDA streams) a thread must not
/// read a buffer that is still being written. A no-op on CPU backends (counted all the same).
///
/// For an engine that orders its reads after the writers on the device itself
/// ([`Communicator::orders_inputs_on_device`]) nothing is finished: the calling thread's queue
/// is marked instead, and the thread that issues the collective orders its own queue after
/// the mark ([`QueueMark::order_here`]) before it touches `input`. cubecl would order it after
/// `input`'s allocation by itself, but not after a later write into it (an optimizer's step in
/// place). On failure `engine`'s group is ended: the position's collective will not run, and
/// no other rank may pair its own with this rank's next one.
fn settle<B: Backend>(
    engine: &dyn Communicator<B>,
    counters: &RankCounters,
    input: &Tensor<B, 1>,
) -> Result<QueueMark, CommError> {
    if engine.orders_inputs_on_device() {
        return Ok(QueueMark::here::<B>(&input.device()));
    }
    counters.sync();
    B::sync(&input.device()).map_err(|error| {
        let reason = format!("could not finish a collective's input: {error}");
        engine.abort(&reason);
        CommError::Device {
            rank: engine.rank(),
            reason,
        }
    })?;
    Ok(QueueMark::none())
}

/// The result of a gather queued with [`Reservation::all_gather_later`].
pub struct Pending<B: Backend>(Answer<B>);

/// Where a [`Pending`] result comes from.
enum Answer<B: Backend> {
    /// From the issuing thread, once it has issued the collective.
    Queued(Receiver<Result<Issued<B>, CommError>>),
    /// Answered in place (a group of one rank).
    Ready(Issued<B>),
}

impl<B: Backend> Pending<B> {
    /// Waits for the issuing thread to issue the gather, then for the device to finish it,
    /// and returns the gathered tensor.
    pub fn wait(self) -> Result<Tensor<B, 1>, CommError> {
        match self.0 {
            Answer::Queued(issued) => issued.recv().unwrap_or_else(|_| Err(stopped()))?.wait(),
            Answer::Ready(issued) => issued.wait(),
        }
    }
}

impl<B: Backend> Communicator<B> for Reservation<B> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.data_collective(CollectiveKind::AllGather, block, DataOp::AllGather)
    }

    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.data_collective(
            CollectiveKind::ReduceScatter,
            input,
            DataOp::ReduceScatter(op),
        )
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.data_collective(CollectiveKind::AllReduce, input, DataOp::AllReduce(op))
    }

    /// Counted with the other collectives ([`CollectiveKind::Other`]): the rank-order
    /// reductions it serves run inside the engine and count as the reductions they are.
    fn all_to_all(&self, input: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.data_collective(CollectiveKind::Other, input, DataOp::AllToAll)
    }

    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        if self.is_alone() && root != 0 {
            return Err(CommError::InvalidRoot {
                root,
                world_size: 1,
            });
        }
        self.data_collective(CollectiveKind::Other, buffer, DataOp::Broadcast { root })
    }

    fn barrier(&self) -> Result<(), CommError> {
        if self.is_alone() {
            return self.in_place(CollectiveKind::Other, ());
        }
        self.count(CollectiveKind::Other);
        self.submit(|comm| comm.barrier())
    }

    /// A duplicate runs in this reservation's position on the engine; its own collectives
    /// are then outside the ordering (the engine's duplicate is returned).
    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.count(CollectiveKind::Other);
        self.submit(|comm| comm.duplicate())
    }

    /// The split runs in this reservation's position on the engine; the engine's new group is
    /// returned (outside the ordering; [`OrderedComm`]'s split orders it).
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.count(CollectiveKind::Other);
        self.submit(move |comm| comm.split(color))
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    fn report_failure(&self, reason: &str) {
        self.inner.report_failure(reason);
    }

    fn first_failure(&self) -> Option<(usize, String)> {
        self.inner.first_failure()
    }

    fn orders_inputs_on_device(&self) -> bool {
        self.inner.orders_inputs_on_device()
    }

    fn count_into(&self, counters: &Arc<RankCounters>) {
        self.inner.count_into(counters);
    }
}

impl<B: Backend> Communicator<B> for OrderedComm<B> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.reserve().all_gather(block)
    }

    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.reserve().reduce_scatter(input, op)
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.reserve().all_reduce(input, op)
    }

    fn all_to_all(&self, input: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.reserve().all_to_all(input)
    }

    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.reserve().broadcast(buffer, root)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.reserve().barrier()
    }

    /// Another handle on the same issuing thread: its collectives take tickets from the same
    /// counter, so they stay in the one order (no engine call is made).
    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(Arc::new(self.clone()))
    }

    /// The engine's split, in the next position; the new group's collectives go through the
    /// same issuing thread, taking tickets from the same counter.
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(Arc::new(self.split_ordered(color)?))
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    fn report_failure(&self, reason: &str) {
        self.inner.report_failure(reason);
    }

    fn first_failure(&self) -> Option<(usize, String)> {
        self.inner.first_failure()
    }

    fn orders_inputs_on_device(&self) -> bool {
        self.inner.orders_inputs_on_device()
    }

    fn count_into(&self, counters: &Arc<RankCounters>) {
        self.inner.count_into(counters);
    }
}
