//! The `Communicator` trait: the collectives every engine provides.

use std::sync::Arc;

use burn::tensor::{Tensor, backend::Backend};

use crate::call::{CollectiveOp, ReduceOp};
use crate::counters::RankCounters;
use crate::error::CommError;
use crate::issued::Issued;

/// Collective communication among the ranks of one group, on `B`'s float tensors.
///
/// Buffers are flat (1-D); callers reshape. Every rank of the group must issue the same
/// collectives in the same order with the same element type and size; engines check this and
/// answer a divergence with [`CommError::Mismatch`] on every rank instead of hanging. Results
/// are placed on the device of the caller's input.
///
/// Sizes that do not divide by the world size are the caller's business (padding lives in the
/// sharding layer): [`Communicator::reduce_scatter`] rejects them.
pub trait Communicator<B: Backend>: Send + Sync {
    /// This rank's index, `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Concatenates every rank's `block` in rank order. All blocks have the same length `L`;
    /// the result has `world_size · L` elements.
    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError>;

    /// Reduces every rank's `input` element-wise and returns block `rank` of the result. The
    /// input length must be divisible by the world size; the result has `len / world_size`
    /// elements.
    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError>;

    /// Reduces every rank's `input` element-wise; every rank receives the whole result.
    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError>;

    /// Sends block `j` of this rank's `input` to rank `j` and returns the blocks it receives,
    /// one from every rank in rank order: block `r` of the result is block `rank` of rank
    /// `r`'s input. The input length must be divisible by the world size; the result has the
    /// input's length. The building block of reductions in rank order
    /// ([`crate::RankOrderReduction`]): each rank receives every rank's piece of its own shard
    /// and sums them itself, in an order no engine's algorithm chooses.
    ///
    /// Engines without one answer [`CommError::Unavailable`] (the default), at once and on
    /// every rank alike.
    fn all_to_all(&self, input: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let _ = input;
        Err(CommError::Unavailable(
            "this communication engine has no all_to_all".to_string(),
        ))
    }

    /// Queues `op` on `input` and returns without waiting for the device to finish it: the
    /// caller (or the thread it hands the [`Issued`] to) waits just before it reads the
    /// result. Engines whose collectives complete on the host, or that have no way to defer
    /// the wait, run the blocking method and return a finished result (the default).
    ///
    /// Every rank issues the same collectives in the same order, as for the blocking methods;
    /// the engine keeps its own order of completion.
    fn issue(&self, op: DataOp, input: Tensor<B, 1>) -> Result<Issued<B>, CommError> {
        op.run(self, input).map(Issued::ready)
    }

    /// Returns `root`'s buffer on every rank. Every rank passes a buffer of the same dtype and
    /// length (its content is ignored except on `root`).
    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError>;

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<(), CommError>;

    /// A new group over the same ranks, in the same order, whose collectives are sequenced
    /// independently of this one's: a second thread of every rank may use it while the first
    /// keeps using this group (DeepSpeed and FSDP run gradient reductions on such a second
    /// group). It is a collective: every rank calls it as its next call on this group. A
    /// failure of either group ends the other as well.
    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError>;

    /// A new group of the ranks of this one that pass the same `color`, ranked in their order
    /// here: the building block of hybrid sharding, where parameters are sharded within a node
    /// (one color per node) and replicated across nodes (one color per position in a node),
    /// as NCCL's `ncclCommSplit` and PyTorch's `new_subgroups` make them. It is a collective:
    /// every rank calls it as its next call on this group. The new group's collectives are
    /// sequenced independently of this one's, and a failure of either ends the other.
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError>;

    /// Ends the group on behalf of this rank (it failed): every rank's pending and later
    /// collectives return [`CommError::PeerFailed`] with `reason`. Counts as a report of the
    /// failure ([`Communicator::report_failure`]).
    fn abort(&self, reason: &str);

    /// Records that this rank failed on its own account (`reason`) without ending the group:
    /// the rank is about to tell the others through a collective (an agreement such as
    /// [`crate::agree::failed_ranks`]), and they will stop because of it. Whoever reports the
    /// job's failure ([`crate::launch()`], the launcher of a training framework) then names the
    /// first rank that reported, the cause, rather than whichever rank happened to stop first.
    ///
    /// Engines that cannot share the record ignore it (the default).
    fn report_failure(&self, reason: &str) {
        let _ = reason;
    }

    /// The first rank of the job that reported a failure or aborted the group, numbered as
    /// the group everything was split from numbers it, with its reason; `None` when none did
    /// or the engine keeps no record (the default).
    fn first_failure(&self) -> Option<(usize, String)> {
        None
    }

    /// Whether the engine orders its reads of a collective's input after the input's writers
    /// on the device itself, whatever thread queued them: a caller may then hand it a tensor
    /// without finishing its own device work first (no synchronisation). `false`, the default,
    /// for engines that read an input only once its writers have finished.
    fn orders_inputs_on_device(&self) -> bool {
        false
    }

    /// Gives the engine the rank's counters, where it counts its own waits for the device
    /// ([`RankCounters::engine_wait`]). Engines that never wait ignore them (the default);
    /// wrappers pass them on.
    fn count_into(&self, counters: &Arc<RankCounters>) {
        let _ = counters;
    }
}

/// The collectives that move data, as [`Communicator::issue`] takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataOp {
    /// [`Communicator::all_gather`].
    AllGather,
    /// [`Communicator::reduce_scatter`].
    ReduceScatter(ReduceOp),
    /// [`Communicator::all_reduce`].
    AllReduce(ReduceOp),
    /// [`Communicator::all_to_all`].
    AllToAll,
    /// [`Communicator::broadcast`] from `root`.
    Broadcast {
        /// The rank whose buffer every rank receives.
        root: usize,
    },
}

impl DataOp {
    /// Runs the collective on `comm` with its blocking method.
    pub fn run<B: Backend, C: Communicator<B> + ?Sized>(
        self,
        comm: &C,
        input: Tensor<B, 1>,
    ) -> Result<Tensor<B, 1>, CommError> {
        match self {
            DataOp::AllGather => comm.all_gather(input),
            DataOp::ReduceScatter(op) => comm.reduce_scatter(input, op),
            DataOp::AllReduce(op) => comm.all_reduce(input, op),
            DataOp::AllToAll => comm.all_to_all(input),
            DataOp::Broadcast { root } => comm.broadcast(input, root),
        }
    }
}

impl From<DataOp> for CollectiveOp {
    fn from(op: DataOp) -> Self {
        match op {
            DataOp::AllGather => CollectiveOp::AllGather,
            DataOp::ReduceScatter(op) => CollectiveOp::ReduceScatter(op),
            DataOp::AllReduce(op) => CollectiveOp::AllReduce(op),
            DataOp::AllToAll => CollectiveOp::AllToAll,
            DataOp::Broadcast { root } => CollectiveOp::Broadcast { root },
        }
    }
}
