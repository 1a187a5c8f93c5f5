//! Global gradient statistics over every rank's shards: the norm for clipping and the
//! overflow flag for loss scaling, combined in one all-reduce.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_zero_comm::{CommError, Communicator, RankCounters, ReduceOp};

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
/// values, over the gradient parts it owns — kept on the device, so that the parts add up there
/// (in the same order and precision as adding their values one by one) and the host reads one
/// result per step, after the all-reduce, instead of two values per parameter.
pub(crate) struct LocalStats<B: Backend> {
    norm_part: Option<Tensor<B, 1>>,
    nonfinite: Option<Tensor<B, 1>>,
}

impl<B: Backend> Default for LocalStats<B> {
    fn default() -> Self {
        Self {
            norm_part: None,
            nonfinite: None,
        }
    }
}

impl<B: Backend> LocalStats<B> {
    /// Adds one gradient part; `count` is false for a replicated gradient on ranks other than
    /// rank 0, so that it counts once in the global norm.
    pub fn add(&mut self, grad: &Tensor<B, 1>, norm: NormType, count: bool) {
        let grad = cast_to(grad.clone(), DType::F32);
        let nonfinite = grad
            .clone()
            .is_nan()
            .bool_or(grad.clone().is_inf())
            .any()
            .float()
            .reshape([1]);
        self.nonfinite = Some(match self.nonfinite.take() {
            Some(sum) => sum + nonfinite,
            None => nonfinite,
        });
        if !count {
            return;
        }
        let part = match norm {
            NormType::L2 => grad.powi_scalar(2).sum(),
            NormType::Inf => grad.abs().max(),
        };
        self.norm_part = Some(match (self.norm_part.take(), norm) {
            (Some(sum), NormType::L2) => sum + part,
            (Some(max), NormType::Inf) => max.max_pair(part),
            (None, _) => part,
        });
    }

    /// The two values, `[norm part, non-finite count]`, where the parts were added
    /// (`device`): zeros for a rank with no gradient part.
    pub fn into_local(self, device: &B::Device) -> Tensor<B, 1> {
        let zero = || Tensor::<B, 1>::zeros([1], device);
        Tensor::cat(
            vec![
                self.norm_part.unwrap_or_else(zero),
                self.nonfinite.unwrap_or_else(zero),
            ],
            0,
        )
    }
}

/// Two ranks' (or one rank's two optimizers') `[norm part, non-finite count]` as one: summed
/// for the L2 norm, the larger of each for the largest magnitude.
pub(crate) fn merge<B: Backend>(a: Tensor<B, 1>, b: Tensor<B, 1>, norm: NormType) -> Tensor<B, 1> {
    match norm {
        NormType::L2 => a + b,
        NormType::Inf => a.max_pair(b),
    }
}

/// The global norm and whether any rank saw a non-finite value, from each rank's
/// `[norm part, non-finite count]` (`local`, on `comm`'s backend), in one all-reduce on
/// `comm` and one read of its result (counted in `counters`).
pub(crate) fn combine<C: Backend>(
    comm: &dyn Communicator<C>,
    local: Tensor<C, 1>,
    norm: NormType,
    counters: &RankCounters,
) -> Result<(f32, bool), CommError> {
    let op = match norm {
        NormType::L2 => ReduceOp::Sum,
        NormType::Inf => ReduceOp::Max,
    };
    let reduced = comm.all_reduce(local, op)?;
    let data = reduced.into_data();
    counters.host_read(data.as_bytes().len());
    let global = data
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("data converted to f32 reads as f32");
    let norm_value = match norm {
        NormType::L2 => global[0].sqrt(),
        NormType::Inf => global[0],
    };
    Ok((norm_value, global[1] > 0.0 || !norm_value.is_finite()))
}
