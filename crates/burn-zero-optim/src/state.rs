//! Bytes held by an optimizer's state for one master copy, for the memory accounting.

use burn::optim::{AdamState, AdamWState, AdaptiveMomentumState, SgdState};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// Bytes of an optimizer's state for a 1-D master copy of `numel` fp32 elements.
pub trait StateBytes {
    /// The state's bytes.
    fn state_bytes(&self, numel: usize) -> usize;
}

fn tensor_bytes<B: Backend>(tensor: &Tensor<B, 1>) -> usize {
    tensor.shape().num_elements() * tensor.dtype().size()
}

fn momentum_bytes<B: Backend>(momentum: &AdaptiveMomentumState<B, 1>) -> usize {
    tensor_bytes(&momentum.moment_1)
        + tensor_bytes(&momentum.moment_2)
        + momentum.max_moment_2.as_ref().map_or(0, tensor_bytes)
}

impl<B: Backend> StateBytes for AdamState<B, 1> {
    fn state_bytes(&self, _numel: usize) -> usize {
        momentum_bytes(&self.momentum)
    }
}

impl<B: Backend> StateBytes for AdamWState<B, 1> {
    fn state_bytes(&self, _numel: usize) -> usize {
        momentum_bytes(&self.momentum)
    }
}

impl<B: Backend> StateBytes for SgdState<B, 1> {
    /// The velocity (one fp32 value per element) when momentum is on.
    fn state_bytes(&self, numel: usize) -> usize {
        self.momentum.as_ref().map_or(0, |_| numel * 4)
    }
}

impl<B: Backend> StateBytes for crate::FusedSgdState<B, 1> {
    /// The velocity (one fp32 value per element) when momentum is on.
    fn state_bytes(&self, numel: usize) -> usize {
        self.momentum.as_ref().map_or(0, |_| numel * 4)
    }
}
