//! Engines for tests that need one lacking something: every collective but the missing one is
//! the wrapped engine's.

use std::sync::Arc;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_comm::{CommError, Communicator, ReduceOp};

/// An engine without an all-to-all (as NCCL is today): [`Communicator::all_to_all`] answers
/// the trait's default error; everything else is the wrapped engine's.
pub struct WithoutAllToAll<B: Backend>(pub Arc<dyn Communicator<B>>);

impl<B: Backend> Communicator<B> for WithoutAllToAll<B> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.0.all_gather(block)
    }

    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.0.reduce_scatter(input, op)
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.0.all_reduce(input, op)
    }

    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.0.broadcast(buffer, root)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.0.barrier()
    }

    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.0.duplicate()
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.0.split(color)
    }

    fn abort(&self, reason: &str) {
        self.0.abort(reason);
    }

    fn report_failure(&self, reason: &str) {
        self.0.report_failure(reason);
    }

    fn first_failure(&self) -> Option<(usize, String)> {
        self.0.first_failure()
    }
}
