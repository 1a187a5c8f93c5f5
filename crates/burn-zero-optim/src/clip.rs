//! Global gradient statistics over every rank's shards: the norm for clipping and the
//! overflow flag for loss scaling, combined in one all-reduce.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, Tensor};
use burn_zero_comm::{CommError, Communicator, ReduceOp};

use crate::master::cast_to;

/// Which norm clipping bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormType {
    /// The Euclidean norm of all gradients together.
    L2,
    /// The largest absolute gradient value.
    Inf,
}

/// One rank's contribution: sum of squares (or largest magnitude) and the count of non-finite
/// values, over the gradient parts it owns.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LocalStats {
    norm_part: f32,
    nonfinite: f32,
}

impl LocalStats {
    /// Adds one gradient part; `count` is false for a replicated gradient on ranks other than
    /// rank 0, so that it counts once in the global norm.
    pub fn add<B: Backend>(&mut self, grad: &Tensor<B, 1>, norm: NormType, count: bool) {
        let grad = cast_to(grad.clone(), DType::F32);
        let nonfinite = grad.clone().is_nan().bool_or(grad.clone().is_inf()).any();
        if nonfinite.into_scalar().elem::<bool>() {
            self.nonfinite += 1.0;
        }
        if !count {
            return;
        }
        match norm {
            NormType::L2 => self.norm_part += grad.powi_scalar(2).sum().into_scalar().elem::<f32>(),
            NormType::Inf => {
                self.norm_part = self
                    .norm_part
                    .max(grad.abs().max().into_scalar().elem::<f32>())
            }
        }
    }

    /// The global norm and whether any rank saw a non-finite value, in one all-reduce.
    pub fn combine<B: Backend>(
        self,
        comm: &dyn Communicator<B>,
        norm: NormType,
        device: &B::Device,
    ) -> Result<(f32, bool), CommError> {
        let op = match norm {
            NormType::L2 => ReduceOp::Sum,
            NormType::Inf => ReduceOp::Max,
        };
        let local = Tensor::<B, 1>::from_floats([self.norm_part, self.nonfinite], device);
        let global = comm
            .all_reduce(local, op)?
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("data converted to f32 reads as f32");
        let norm_value = match norm {
            NormType::L2 => global[0].sqrt(),
            NormType::Inf => global[0],
        };
        Ok((norm_value, global[1] > 0.0 || !norm_value.is_finite()))
    }
}
