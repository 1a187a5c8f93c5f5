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
//! ([`crate::Issued::wait`]), on engines that can defer that wait (NCCL). A gather issued ahead of use
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

mod answer;
mod issuer;
mod reservation;

use std::sync::Arc;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

pub use answer::{Deferred, Pending};
use issuer::Issuer;
pub use reservation::Reservation;

use crate::call::ReduceOp;
use crate::communicator::Communicator;
use crate::counters::RankCounters;
use crate::error::CommError;

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
        let name = format!("burn-zero-issue-{}", inner.rank());
        OrderedComm {
            issuer: Arc::new(Issuer::new(counters, name)),
            inner,
        }
    }

    /// The rank's counts: every collective issued through this thread, by kind, and the
    /// device synchronisation before each. Other parts of the rank (the gradient reducer, the
    /// optimizer) count theirs here too.
    pub fn counters(&self) -> &Arc<RankCounters> {
        self.issuer.counters()
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
        inner.count_into(self.issuer.counters());
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
        inner.count_into(self.issuer.counters());
        Ok(OrderedComm {
            inner,
            issuer: self.issuer.clone(),
        })
    }

    /// Takes the next position in this rank's order of collectives. The reservation's calls,
    /// from whatever thread, run in that position; the position is done when the reservation
    /// is dropped (with no call, it is skipped).
    pub fn reserve(&self) -> Reservation<B> {
        Reservation::take(self.inner.clone(), &self.issuer)
    }
}

impl<B: Backend> Reservation<B> {
    /// A handle on this same position whose collectives run on `group`, another group of
    /// this rank behind the same issuing thread (split from it with
    /// [`OrderedComm::split_ordered`]). The position's calls on both run back to back in the
    /// order they are made, and it closes when both handles are gone: a hybrid-sharded bucket
    /// is reduce-scattered in its shard group and all-reduced across the groups in one
    /// position.
    pub fn on_group(&self, group: &OrderedComm<B>) -> Result<Reservation<B>, CommError> {
        if !self.is_served_by(&group.issuer) {
            return Err(CommError::InvalidGroup(
                "a reservation can carry the collectives of groups behind its own issuing \
                 thread only"
                    .into(),
            ));
        }
        Ok(self.spanning(group.inner.clone()))
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
