//! Gradient synchronisation: each parameter's final gradient is reduced across ranks (mean)
//! and replaced, through autodiff's gradient slot, by this rank's shard of the result (or the
//! whole mean, for all-reduced parameters).
//!
//! Gradients are reduced in buckets ([`crate::bucket`]) in one fixed order on every rank —
//! descending parameter key — whatever order the hooks fire in and whichever parameters a rank
//! used, with zeros standing in for the gradients this rank does not have. So ranks never issue
//! different collectives. The reductions run when backward ends (see
//! [`ZeroGroup::gradient_ready`] for why not earlier).

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;

use crate::bucket::{self, Bucket};
use crate::group::{ReductionStats, ZeroGroup, lock};
use crate::memory::MemoryKind;
use crate::tensor::ZeroTensor;

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
    /// Buckets in the order they are reduced.
    buckets: Vec<Bucket>,
    /// Index of the next bucket to reduce.
    next: usize,
    /// Final gradients waiting for their bucket's turn, with their bytes.
    pending: BTreeMap<usize, (GradSlot<B>, ZeroTensor<B>, usize)>,
    /// Whether a backward pass is in progress.
    active: bool,
    /// Reduced gradients of parameters this rank did not use in the last backward (its
    /// autodiff graph has no slot for them), kept for the optimizer.
    orphans: BTreeMap<usize, ZeroTensor<B>>,
}

impl<B: Backend> Default for GradSync<B> {
    fn default() -> Self {
        Self {
            buckets: Vec::new(),
            next: 0,
            pending: BTreeMap::new(),
            active: false,
            orphans: BTreeMap::new(),
        }
    }
}

impl<B: Backend> GradSync<B> {
    /// Sets the static bucket layout.
    pub(crate) fn set_layout(&mut self, buckets: Vec<Bucket>) {
        self.buckets = buckets;
    }

    /// Reduced gradients of parameters this rank had no gradient for in the last backward.
    pub(crate) fn take_orphans(&mut self) -> BTreeMap<usize, ZeroTensor<B>> {
        std::mem::take(&mut self.orphans)
    }

    /// The bucket layout, in reduction order.
    pub(crate) fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    fn start(&mut self) {
        if !self.active {
            self.active = true;
            self.next = 0;
            self.pending.clear();
            self.orphans.clear();
        }
    }
}

impl<B: Backend> ZeroGroup<B> {
    /// Starts a backward pass (idempotent within one pass).
    pub(crate) fn begin_backward(&self) {
        self.lock_grads().start();
    }

    /// The final gradient of parameter `key` sits in `slot`: keep it for its bucket.
    ///
    /// Nothing is reduced here. Autodiff calls this hook while it holds the rank's graph
    /// lock, and after every backward pass burn-autodiff locks *every* graph of the process
    /// to clean up. A rank blocked in a collective under its lock can then wait forever for a
    /// rank that waits for that lock (seen with four ranks). So every bucket is reduced in
    /// [`Self::end_backward`], after the locks are released.
    pub(crate) fn gradient_ready(self: &Arc<Self>, key: usize, slot: GradSlot<B>) {
        // Kept as it is: materialising a (rare) sharded gradient would gather under the lock.
        let grad = slot.read();
        let bytes = grad.shape().num_elements() * grad.dtype().size();
        self.memory().add(MemoryKind::Buckets, bytes);
        let mut state = self.lock_grads();
        state.start();
        state.pending.insert(key, (slot, grad, bytes));
    }

    /// Ends a backward pass: reduces every bucket not reduced yet, zero-filled where this rank
    /// has no gradient, and drops the gathered parameters the pass left in the cache.
    pub(crate) fn end_backward(self: &Arc<Self>) {
        let mut state = self.lock_grads();
        if state.active {
            let started = std::time::Instant::now();
            let mut stats = ReductionStats::default();
            while state.next < state.buckets.len() {
                stats.bytes += self.flush_next(&mut state);
                stats.collectives += 1;
            }
            stats.seconds = started.elapsed().as_secs_f64();
            state.active = false;
            tracing::debug!(rank = self.rank(), ?stats, "gradients reduced");
            *lock(&self.reduction) = stats;
        }
        drop(state);
        self.clear_gather_cache();
    }

    /// Reduces the next bucket and delivers each member's result to its autodiff slot, or
    /// keeps it as an orphan when this rank has no slot for it. Returns the bucket's bytes.
    fn flush_next(self: &Arc<Self>, state: &mut GradSync<B>) -> usize {
        let bucket = state.buckets[state.next].clone();
        state.next += 1;
        let mut slots = Vec::with_capacity(bucket.members.len());
        let mut grads = Vec::with_capacity(bucket.members.len());
        for member in &bucket.members {
            match state.pending.remove(&member.key) {
                Some((slot, grad, bytes)) => {
                    self.memory().sub(MemoryKind::Buckets, bytes);
                    slots.push(Some(slot));
                    grads.push(Some(grad.materialize()));
                }
                None => {
                    slots.push(None);
                    grads.push(None);
                }
            }
        }
        let reduced = bucket::reduce(self, &bucket, grads);
        for ((member, slot), value) in bucket.members.iter().zip(slots).zip(reduced) {
            match slot {
                Some(slot) => slot.write(value),
                None => {
                    state.orphans.insert(member.key, value);
                }
            }
        }
        bucket.bytes(self.world_size())
    }
}
