//! A position in a rank's order of collectives, and the collectives run in it: answered in
//! place for a group of one rank, queued on the issuing thread otherwise.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_kernels::{QueueMark, ThreadQueue};

use super::answer::{Answer, Deferred, Pending};
use super::issuer::{Call, Issuer, Shared, stopped};
use crate::call::ReduceOp;
use crate::communicator::{Communicator, DataOp};
use crate::counters::{CollectiveKind, RankCounters};
use crate::error::CommError;
use crate::issued::Issued;
use crate::parked::Unfinished;

/// A position in a rank's order of collectives, taken with [`super::OrderedComm::reserve`]. Its
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
        self.shared.close(self.ticket);
    }
}

impl<B: Backend> Reservation<B> {
    /// The reservation's position (0-based) in the rank's order.
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// A position taken now in `issuer`'s order (see [`super::OrderedComm::reserve`]), whose
    /// collectives run on `inner` and whose results the calling thread reads.
    pub(super) fn take(inner: Arc<dyn Communicator<B>>, issuer: &Arc<Issuer>) -> Self {
        let ticket = issuer.shared().take_ticket();
        Reservation {
            ticket,
            rank: inner.rank(),
            world_size: inner.world_size(),
            inner,
            shared: issuer.shared().clone(),
            open: Arc::new(Open {
                ticket,
                shared: issuer.shared().clone(),
                issuer: issuer.clone(),
                spans_groups: AtomicBool::new(false),
            }),
            // The thread taking the position is the one that reads its results.
            reader: ThreadQueue::current::<B>(),
        }
    }

    /// Whether this position is in the order `issuer` serves.
    pub(super) fn is_served_by(&self, issuer: &Issuer) -> bool {
        Arc::ptr_eq(&self.shared, issuer.shared())
    }

    /// Another handle on this position, whose collectives run on `inner` (another group behind
    /// the same issuing thread): the position now spans groups.
    pub(super) fn spanning(&self, inner: Arc<dyn Communicator<B>>) -> Reservation<B> {
        self.open.spans_groups.store(true, Ordering::Relaxed);
        Reservation {
            ticket: self.ticket,
            rank: inner.rank(),
            world_size: inner.world_size(),
            inner,
            shared: self.shared.clone(),
            open: self.open.clone(),
            reader: self.reader,
        }
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
        settle(self.inner.as_ref(), self.open.issuer.counters(), input)
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
        self.open.issuer.counters().in_place();
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
        let counters = self.open.issuer.counters().clone();
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
        self.open.issuer.counters().collective(kind);
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
        self.shared.push(self.ticket, call)
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
    /// returned (outside the ordering; [`super::OrderedComm`]'s split orders it).
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
