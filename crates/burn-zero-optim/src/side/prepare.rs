//! The step's second phase: the collected gradients added into the accumulators (outside an
//! accumulation window's last micro-step nothing is stepped) and joined once per chunk.

use std::collections::HashMap;

use burn::module::ParamId;
use burn::optim::SimpleOptimizer;
use burn::tensor::DType;
use burn::tensor::backend::Backend;
use burn_zero_core::ZeroTensor;

use super::collect::{Collected, Grad, Taken};
use super::pending::ChunkGrad;
use super::{Side, bound};
use crate::place::Place;

/// Collected gradients ready for the step: accumulated, and joined per chunk.
pub(crate) struct Prepared<B: Backend, H: Backend> {
    /// Gradients of parameters outside chunks.
    pub(super) taken: HashMap<ParamId, Taken<H>>,
    pub(super) order: Vec<ParamId>,
    pub(super) values: HashMap<usize, ZeroTensor<B>>,
    /// Every collected parameter's id by key.
    pub(super) ids: HashMap<usize, ParamId>,
    pub(super) chunk_grads: Vec<ChunkGrad<H>>,
}

impl<B: Backend, H: Backend> Prepared<B, H> {
    /// Whether no gradient was collected.
    pub(crate) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

impl<O, B: Backend, P: Place<B>> Side<O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// Second phase: adds the gradients into the accumulators (`None` inside an accumulation
    /// window: no step this time) and joins each chunk's gradient parts once, for the
    /// statistics and the step alike.
    pub(crate) fn prepare(
        &mut self,
        collected: Collected<B, P::Host>,
    ) -> Option<Prepared<B, P::Host>> {
        let Collected {
            mut taken,
            order,
            values,
        } = collected;
        if self.accumulation > 1 {
            for id in &order {
                let t = &taken[id];
                let grad = t.grad.tensor().cast(DType::F32);
                let sum = match self.accumulated.remove(&t.key) {
                    Some(sum) => sum + grad,
                    None => grad,
                };
                self.accumulated.insert(t.key, sum);
            }
            self.micro_steps += 1;
            if self.micro_steps < self.accumulation {
                return None;
            }
            self.micro_steps = 0;
            let n = self.accumulation as f64;
            for t in taken.values_mut() {
                if let Some(sum) = self.accumulated.remove(&t.key) {
                    t.grad = Grad::Whole(sum.div_scalar(n));
                }
            }
            self.accumulated.clear();
        }
        let chunked = !bound(&self.zero).store().chunks().is_per_parameter();
        let ids: HashMap<usize, ParamId> = taken.iter().map(|(id, t)| (t.key, *id)).collect();
        let chunk_grads = if chunked {
            self.join_chunk_grads(&mut taken)
        } else {
            Vec::new()
        };
        Some(Prepared {
            taken,
            order,
            values,
            ids,
            chunk_grads,
        })
    }
}
