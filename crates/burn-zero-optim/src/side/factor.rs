//! The step's gradient factor: loss-scale unscaling and clipping by the global norm, from each
//! rank's statistics of its prepared gradients combined in one all-reduce.

use burn::optim::SimpleOptimizer;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::prepare::Prepared;
use super::{Side, bound};
use crate::clip::{LocalStats, NormType, combine};
use crate::place::Place;

impl<O, B: Backend, P: Place<B>> Side<O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// The step's gradient factor from this rank's statistics, which `local` gives on the
    /// model's device for a norm type (one all-reduce combines every rank's): `None` when a
    /// gradient overflowed on any rank, or when no gradient was collected (`empty`). Updates
    /// the loss scaler. Without clipping or loss scaling the factor is 1 and nothing is read.
    /// A split optimizer's device side computes it for both sides.
    pub(crate) fn factor_of(
        &mut self,
        empty: bool,
        local: impl FnOnce(&Self, NormType) -> Tensor<B, 1>,
    ) -> Option<f64> {
        if self.clipping.is_none() && self.scaler.is_none() {
            return Some(1.0);
        }
        if empty {
            return None;
        }
        let norm_type = self.clipping.map_or(NormType::L2, |(_, n)| n);
        let local = local(self, norm_type);
        let zero = bound(&self.zero);
        let (norm, overflow) = combine(
            zero.comm().as_ref(),
            local,
            norm_type,
            zero.store().counters(),
        )
        .unwrap_or_else(|error| {
            panic!(
                "burn-zero: rank {} could not combine gradient norms: {error}",
                zero.rank()
            )
        });
        self.factor_from(norm, overflow)
    }

    /// This rank's statistics of `prepared` on the model's device: the norm's part (sum of
    /// squares or largest magnitude) and the count of non-finite values.
    pub(crate) fn local_stats(
        &self,
        prepared: &Prepared<B, P::Host>,
        norm_type: NormType,
    ) -> Tensor<B, 1> {
        let zero = bound(&self.zero);
        let host = P::host_device(zero.device());
        let mut stats = LocalStats::<P::Host>::default();
        // One statistic per chunk (its flat gradient), then per parameter outside chunks.
        for chunk in &prepared.chunk_grads {
            stats.add(&chunk.grad, norm_type, chunk.sharded || zero.rank() == 0);
        }
        for id in &prepared.order {
            let Some(t) = prepared.taken.get(id) else {
                continue;
            };
            let counts = zero.gradient_is_sharded(t.key) || zero.rank() == 0;
            stats.add(&t.grad.tensor(), norm_type, counts);
        }
        P::to_model(
            stats.into_local(&host),
            zero.device(),
            zero.store().counters(),
        )
    }

    /// The step's factor from the global `norm` and `overflow`, updating the loss scaler;
    /// `None` on an overflow.
    fn factor_from(&mut self, norm: f32, overflow: bool) -> Option<f64> {
        let scale = self.loss_scale();
        if let Some(scaler) = &mut self.scaler {
            scaler.update(overflow);
        }
        if overflow {
            self.last_norm = None;
            return None;
        }
        let norm = norm as f64 / scale;
        self.last_norm = Some(norm as f32);
        let clip = match self.clipping {
            Some((max_norm, _)) => (max_norm as f64 / (norm + 1e-6)).min(1.0),
            None => 1.0,
        };
        Some(clip / scale)
    }
}
