//! `RankOrderReduction`: reductions summed in rank order by each rank itself, on any engine
//! with an all-to-all, so that their bits do not depend on the engine's algorithm.
//!
//! # Why
//!
//! An engine such as NCCL sums in an order of its own (a ring, a tree, NVLink reductions),
//! chosen by message size and topology: from three ranks on, the same inputs can give sums
//! that differ in the last bits between machines, world sizes and runs, and every step after
//! them differs too. `LocalGroup` and `MpiGroup` sum in rank order, which is what makes N
//! ranks bitwise equal to one rank accumulating the same micro-batches.
//!
//! # How
//!
//! A reduce-scatter becomes an all-to-all (each rank receives every rank's piece of its own
//! shard) followed by a sum of the pieces here, in rank order, with the arithmetic of the
//! other engines' own reductions (`plane`): from rank 0's piece (not from zero:
//! `0 + (-0.0)` is `+0.0`), each addition rounded in the storage dtype, a mean divided once at
//! the end. Per rank that sends and receives `(N−1)/N` of the buffer, as a ring reduce-scatter
//! does, but receives into a buffer of the whole input's size rather than `1/N` of it. An
//! all-reduce is that reduce-scatter, over the input padded to a multiple of the world size,
//! followed by an all-gather of the shards: `2(N−1)/N` of the buffer each way, as a ring
//! all-reduce. Every other collective is the engine's own.

use std::sync::Arc;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::call::ReduceOp;
use crate::communicator::Communicator;
use crate::communicator::DataOp;
use crate::counters::RankCounters;
use crate::error::CommError;
use crate::issued::Issued;
use crate::plane::{HostPlane, fold_pieces};

/// An engine whose reductions are all-to-alls summed in rank order (see the module docs).
pub struct RankOrderReduction<B: Backend> {
    engine: Arc<dyn Communicator<B>>,
    /// Host loops for the sums on Flex and NdArray, as `LocalGroup` and `MpiGroup` use.
    plane: Option<HostPlane>,
}

impl<B: Backend> RankOrderReduction<B> {
    /// `engine`, reducing in rank order. The engine must have [`Communicator::all_to_all`]
    /// (an engine without one fails the first reduction with its own error).
    pub fn new(engine: Arc<dyn Communicator<B>>) -> Self {
        Self {
            engine,
            plane: HostPlane::new::<B>(),
        }
    }

    /// The pieces an all-to-all received (one per rank, end to end, equal in length) reduced
    /// element by element in rank order.
    fn sum_pieces(&self, received: Tensor<B, 1>, op: ReduceOp) -> Tensor<B, 1> {
        let parts = self.engine.world_size();
        if let Some(plane) = &self.plane
            && let Some(buffer) = plane.view(&received)
            && let Some(reduced) = plane.reduce_parts(&buffer, parts, op)
        {
            return HostPlane::tensor(reduced);
        }
        fold_pieces(received, parts, op)
    }
}

impl<B: Backend> Communicator<B> for RankOrderReduction<B> {
    fn rank(&self) -> usize {
        self.engine.rank()
    }

    fn world_size(&self) -> usize {
        self.engine.world_size()
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.engine.all_gather(block)
    }

    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        let (numel, world_size) = (input.dims()[0], self.world_size());
        if world_size == 1 || numel == 0 {
            return self.engine.reduce_scatter(input, op);
        }
        if !numel.is_multiple_of(world_size) {
            return Err(CommError::NotDivisible { numel, world_size });
        }
        let received = self.engine.all_to_all(input)?;
        Ok(self.sum_pieces(received, op))
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        let (numel, world_size) = (input.dims()[0], self.world_size());
        if world_size == 1 || numel == 0 {
            return self.engine.all_reduce(input, op);
        }
        // Padded with zeros to whole shards; the padding's sums are dropped at the end.
        let padded = numel.next_multiple_of(world_size);
        let input = if padded > numel {
            let zeros = Tensor::zeros([padded - numel], (&input.device(), input.dtype()));
            Tensor::cat(vec![input, zeros], 0)
        } else {
            input
        };
        let received = self.engine.all_to_all(input)?;
        let mine = self.sum_pieces(received, op);
        let all = self.engine.all_gather(mine)?;
        Ok(if padded > numel {
            all.slice(0..numel)
        } else {
            all
        })
    }

    fn all_to_all(&self, input: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.engine.all_to_all(input)
    }

    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.engine.broadcast(buffer, root)
    }

    /// The engine's own collective issued as it is; a reduce-scatter on a device backend is
    /// the engine's all-to-all issued, its pieces summed by the thread that waits for the
    /// result, once they have arrived. An all-reduce (an all-gather of that sum) and the sums
    /// on host backends finish before this returns.
    fn issue(&self, op: DataOp, input: Tensor<B, 1>) -> Result<Issued<B>, CommError> {
        match op {
            DataOp::AllGather | DataOp::AllToAll | DataOp::Broadcast { .. } => {
                self.engine.issue(op, input)
            }
            DataOp::ReduceScatter(reduce)
                if self.plane.is_none()
                    && self.world_size() > 1
                    && input.dims()[0] > 0
                    && input.dims()[0].is_multiple_of(self.world_size()) =>
            {
                let parts = self.world_size();
                let issued = self.engine.issue(DataOp::AllToAll, input)?;
                Ok(issued.map(move |received| fold_pieces(received, parts, reduce)))
            }
            DataOp::ReduceScatter(_) | DataOp::AllReduce(_) => {
                op.run(self, input).map(Issued::ready)
            }
        }
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.engine.barrier()
    }

    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(Arc::new(Self::new(self.engine.duplicate()?)))
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(Arc::new(Self::new(self.engine.split(color)?)))
    }

    fn abort(&self, reason: &str) {
        self.engine.abort(reason);
    }

    fn report_failure(&self, reason: &str) {
        self.engine.report_failure(reason);
    }

    fn orders_inputs_on_device(&self) -> bool {
        self.engine.orders_inputs_on_device()
    }

    fn count_into(&self, counters: &Arc<RankCounters>) {
        self.engine.count_into(counters);
    }

    fn first_failure(&self) -> Option<(usize, String)> {
        self.engine.first_failure()
    }
}
