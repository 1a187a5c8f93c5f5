//! Gradient synchronisation: each parameter's final gradient is reduced across ranks (mean)
//! and replaced, through autodiff's gradient slot, by this rank's shard of the result.
//!
//! Collectives are issued in one fixed order on every rank — descending parameter key, the
//! order in which backward usually finalises gradients — whatever order the hooks fire in
//! and whichever parameters a rank used. A gradient that arrives early waits for its turn; at
//! the end of backward the remaining parameters are reduced with zeros standing in for the
//! gradients this rank does not have. So ranks never issue different collectives.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor, TensorPrimitive};
use burn_zero_comm::ReduceOp;

use crate::group::ZeroGroup;
use crate::sharded::{ShardRole, ShardedParam};
use crate::tensor::{ShardedView, ZeroTensor};

/// Autodiff's slot for one parameter's gradient.
pub(crate) struct GradSlot<B: Backend>(*mut ZeroTensor<B>);

// SAFETY: a slot is created, written and dropped on the thread that runs `backward`, between
// `register_sync_parameters` and `submit_sync_collective` of that backward pass; it only
// travels inside the rank's own group, never to another thread while live.
unsafe impl<B: Backend> Send for GradSlot<B> {}

impl<B: Backend> GradSlot<B> {
    /// Wraps the pointer autodiff hands to `submit_gradient_sync`.
    pub(crate) fn new(ptr: *mut ZeroTensor<B>) -> Self {
        Self(ptr)
    }

    /// The gradient in the slot.
    pub(crate) fn read(&self) -> ZeroTensor<B> {
        // SAFETY: the pointer comes from burn-autodiff's `Gradients` container, whose boxed
        // entry for this parameter stays in place, untouched by anyone else, until the
        // gradients are handed back after `submit_sync_collective` (Burn's own sync server
        // relies on the same guarantee).
        unsafe { (*self.0).clone() }
    }

    /// Replaces the gradient in the slot.
    fn write(self, value: ZeroTensor<B>) {
        // SAFETY: as in `read`; no other reference to the entry exists during backward.
        unsafe { *self.0 = value }
    }
}

/// Per-backward state of a rank's group.
pub(crate) struct GradSync<B: Backend> {
    /// Keys in the order their gradients are reduced.
    order: Vec<usize>,
    /// Index in `order` of the next gradient to reduce.
    next: usize,
    /// Gradients that arrived before their turn.
    pending: BTreeMap<usize, (GradSlot<B>, B::FloatTensorPrimitive)>,
    /// Whether a backward pass is in progress.
    active: bool,
    /// Reduced gradient shards of parameters this rank did not use in the last backward (its
    /// autodiff graph has no slot for them), kept for the optimizer.
    orphans: BTreeMap<usize, ZeroTensor<B>>,
}

impl<B: Backend> Default for GradSync<B> {
    fn default() -> Self {
        Self {
            order: Vec::new(),
            next: 0,
            pending: BTreeMap::new(),
            active: false,
            orphans: BTreeMap::new(),
        }
    }
}

impl<B: Backend> GradSync<B> {
    /// Sets the reduction order: every parameter, highest key first.
    pub(crate) fn set_params(&mut self, count: usize) {
        self.order = (0..count).rev().collect();
    }

    /// Reduced shards of parameters this rank had no gradient for in the last backward.
    pub(crate) fn take_orphans(&mut self) -> BTreeMap<usize, ZeroTensor<B>> {
        std::mem::take(&mut self.orphans)
    }
}

impl<B: Backend> ZeroGroup<B> {
    /// Starts a backward pass (idempotent within one pass).
    pub(crate) fn begin_backward(&self) {
        let mut state = self.lock_grads();
        if !state.active {
            state.active = true;
            state.next = 0;
            state.pending.clear();
            state.orphans.clear();
        }
    }

    /// The final gradient of parameter `key` sits in `slot`: reduce every gradient whose turn
    /// has come.
    pub(crate) fn gradient_ready(self: &Arc<Self>, key: usize, slot: GradSlot<B>) {
        let grad = slot.read().materialize();
        let mut state = self.lock_grads();
        if !state.active {
            state.active = true;
            state.next = 0;
        }
        state.pending.insert(key, (slot, grad));
        while let Some(&next) = state.order.get(state.next) {
            let Some((slot, grad)) = state.pending.remove(&next) else {
                break;
            };
            state.next += 1;
            slot.write(self.reduce_gradient(next, Some(grad)));
        }
    }

    /// Ends a backward pass: reduces every gradient not reduced yet, zero-filled where this
    /// rank has none, and drops the gathered parameters the pass left in the cache.
    pub(crate) fn end_backward(self: &Arc<Self>) {
        let mut state = self.lock_grads();
        if state.active {
            while let Some(&key) = state.order.get(state.next) {
                state.next += 1;
                match state.pending.remove(&key) {
                    Some((slot, grad)) => slot.write(self.reduce_gradient(key, Some(grad))),
                    None => {
                        let reduced = self.reduce_gradient(key, None);
                        state.orphans.insert(key, reduced);
                    }
                }
            }
            state.active = false;
        }
        drop(state);
        self.clear_gather_cache();
    }

    /// Mean over ranks of parameter `key`'s gradient (`None`: this rank contributes zeros):
    /// this rank's shard for a sharded parameter, the whole mean for a replicated one.
    fn reduce_gradient(
        self: &Arc<Self>,
        key: usize,
        grad: Option<B::FloatTensorPrimitive>,
    ) -> ZeroTensor<B> {
        let info = self
            .params()
            .into_iter()
            .nth(key)
            .unwrap_or_else(|| unreachable!("keys index the parameter table"));
        let numel = info.shape.num_elements();
        let device = self.device().clone();
        let flat = match grad {
            Some(grad) => Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
                grad,
                Shape::new([numel]),
            ))),
            None => Tensor::zeros([numel], (&device, info.dtype)),
        };
        let fail = |error| -> ! {
            panic!(
                "burn-zero: rank {} could not reduce the gradient of parameter #{key} `{}`: {error}",
                self.rank(),
                info.path
            )
        };
        if info.persistent {
            let mean = self
                .comm()
                .all_reduce(flat, ReduceOp::Mean)
                .unwrap_or_else(|e| fail(e));
            return ZeroTensor::Local(B::float_reshape(
                mean.into_primitive().tensor(),
                info.shape.clone(),
            ));
        }
        let padded = self.block_len(numel) * self.world_size();
        let flat = if padded > numel {
            Tensor::cat(
                vec![flat, Tensor::zeros([padded - numel], (&device, info.dtype))],
                0,
            )
        } else {
            flat
        };
        let shard = self
            .comm()
            .reduce_scatter(flat, ReduceOp::Mean)
            .unwrap_or_else(|e| fail(e));
        let param = ShardedParam::new(
            key,
            ShardRole::Gradient,
            shard.into_primitive().tensor(),
            info.shape.clone(),
            info.dtype,
            self.clone(),
        );
        ZeroTensor::Sharded(ShardedView::new(Arc::new(param)))
    }
}
