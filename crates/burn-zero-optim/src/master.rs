//! Master copies: the fp32 values and optimizer state of the part of a parameter a rank steps.

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// One parameter's master copy on this rank: its block (sharded gradients) or all of it
/// (all-reduced gradients), in fp32, with the optimizer's state for it.
pub(crate) struct Master<O: SimpleOptimizer<B>, B: Backend> {
    pub values: Tensor<B, 1>,
    pub state: Option<O::State<1>>,
}

impl<O: SimpleOptimizer<B>, B: Backend> Clone for Master<O, B> {
    fn clone(&self) -> Self {
        Self {
            values: self.values.clone(),
            state: self.state.clone(),
        }
    }
}

impl<O: SimpleOptimizer<B>, B: Backend> Master<O, B> {
    /// A master copy of `values` (converted to fp32), with no optimizer state yet.
    pub fn new(values: Tensor<B, 1>) -> Self {
        Self {
            values: cast_to(values, DType::F32),
            state: None,
        }
    }

    /// Applies one step of `optim` with `grad` (any float dtype) multiplied by `factor`
    /// (unscaling and clipping), and returns the new values.
    pub fn step(&mut self, optim: &O, lr: f64, grad: Tensor<B, 1>, factor: f64) -> Tensor<B, 1> {
        let grad = cast_to(grad, DType::F32);
        let grad = if factor == 1.0 {
            grad
        } else {
            grad.mul_scalar(factor)
        };
        let (values, state) = optim.step(lr, self.values.clone(), grad, self.state.take());
        self.values = values.clone();
        self.state = state;
        values
    }
}

/// `tensor` in `dtype` (itself when it already is).
pub(crate) fn cast_to<B: Backend>(tensor: Tensor<B, 1>, dtype: DType) -> Tensor<B, 1> {
    if tensor.dtype() == dtype {
        tensor
    } else {
        tensor.cast(dtype)
    }
}
