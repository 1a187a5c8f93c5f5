//! Master copies: the fp32 values and optimizer state of the part of a parameter a rank steps.

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use crate::one_pass::{FlatStep, OnePassFn};

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
    /// (unscaling and clipping), and returns the new values: in `dtype` when `one_pass` wrote
    /// them in the step's own pass, in fp32 otherwise (the caller casts).
    pub fn step(
        &mut self,
        optim: &O,
        one_pass: Option<OnePassFn<O, B>>,
        lr: f64,
        grad: Tensor<B, 1>,
        factor: f64,
        dtype: DType,
    ) -> Tensor<B, 1> {
        let grad = cast_to(grad, DType::F32);
        // The master is handed over without another reference, so that a one-pass step may
        // update its buffer in place.
        let device = self.values.device();
        let values = std::mem::replace(&mut self.values, Tensor::empty([0], &device));
        let state = self.state.take();
        let (values, written) = match one_pass {
            Some(one_pass) => {
                let FlatStep {
                    master,
                    state,
                    written,
                } = one_pass(optim, lr, values, grad, factor, state, dtype);
                self.state = state;
                (master, written)
            }
            None => {
                let (values, state) = optim.step(lr, values, scaled(grad, factor), state);
                self.state = state;
                (values, None)
            }
        };
        self.values = values.clone();
        written.unwrap_or(values)
    }
}

/// `grad` multiplied by `factor` as an operation of its own (none for 1).
pub(crate) fn scaled<B: Backend>(grad: Tensor<B, 1>, factor: f64) -> Tensor<B, 1> {
    if factor == 1.0 {
        grad
    } else {
        grad.mul_scalar(factor)
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
