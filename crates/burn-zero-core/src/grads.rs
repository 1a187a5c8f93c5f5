//! Gradient synchronisation: each parameter's final gradient is reduced across ranks (mean)
//! and replaced, through autodiff's gradient slot, by this rank's shard of the result (or the
//! whole mean, for all-reduced parameters).
//!
//! Gradients are reduced in buckets ([`crate::bucket`]) in one fixed order on every rank —
//! descending parameter key — whatever order the hooks fire in and whichever parameters a rank
//! used, with zeros standing in for the gradients this rank does not have. So ranks never issue
//! different collectives. With `overlap_comm` (stages 0, 2, 3) a communication thread
//! ([`crate::reducer`]) reduces each bucket as soon as it is complete, while backward goes on,
//! in the position of the rank's order of collectives that the completing hook took (so the
//! order is the program's, not the threads' timing); otherwise, and at stage 1, every bucket
//! is reduced when backward ends, on the training thread. Either way the hook
//! itself never blocks (see [`ZeroGroup::gradient_ready`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorMetadata};

use crate::bucket::{self, Bucket, ReduceError, Reduction};
use crate::group::{ReductionStats, ZeroGroup, lock};
use crate::memory::MemoryKind;
use crate::queue::{BucketQueue, Reduced};
use crate::reducer::Reducer;
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
    fn write(&self, value: ZeroTensor<B>) {
        // SAFETY: as in `read`; no other reference to the entry exists during backward.
        unsafe { *self.0 = value }
    }
}

/// Per-backward state of a rank's group.
pub(crate) struct GradSync<B: Backend> {
    /// Gradients waiting for their bucket, when buckets are reduced on this thread.
    queue: BucketQueue<B>,
    /// The communication thread, when reduction overlaps backward.
    reducer: Option<Reducer<B>>,
    /// Autodiff's slots of this pass's gradients, by parameter key.
    slots: BTreeMap<usize, GradSlot<B>>,
    /// Gradients that stay with this thread until backward ends, with their bytes: all of
    /// them without a communication thread; with one, the (rare) sharded ones, which gather.
    held: BTreeMap<usize, (ZeroTensor<B>, usize)>,
    /// What a slot holds between its gradient's hand-over and the result: one element, shared.
    placeholder: Option<B::FloatTensorPrimitive>,
    /// Whether a backward pass is in progress.
    active: bool,
    /// Reduced gradients of parameters this rank did not use in the last backward (its
    /// autodiff graph has no slot for them), kept for the optimizer.
    orphans: BTreeMap<usize, ZeroTensor<B>>,
}

impl<B: Backend> Default for GradSync<B> {
    fn default() -> Self {
        Self {
            queue: BucketQueue::new(Vec::new()),
            reducer: None,
            slots: BTreeMap::new(),
            held: BTreeMap::new(),
            placeholder: None,
            active: false,
            orphans: BTreeMap::new(),
        }
    }
}

impl<B: Backend> GradSync<B> {
    /// Sets the static bucket layout, and the communication thread that reduces it (if any).
    pub(crate) fn set_layout(&mut self, buckets: Vec<Bucket>, reducer: Option<Reducer<B>>) {
        self.queue = BucketQueue::new(buckets);
        self.reducer = reducer;
    }

    /// Reduced gradients of parameters this rank had no gradient for in the last backward.
    pub(crate) fn take_orphans(&mut self) -> BTreeMap<usize, ZeroTensor<B>> {
        std::mem::take(&mut self.orphans)
    }

    /// The bucket layout, in reduction order.
    pub(crate) fn buckets(&self) -> &[Bucket] {
        self.queue.buckets()
    }

    fn start(&mut self) {
        if !self.active {
            self.active = true;
            self.slots.clear();
            self.held.clear();
            self.orphans.clear();
        }
    }
}

impl<B: Backend> ZeroGroup<B> {
    /// Starts a backward pass (idempotent within one pass).
    pub(crate) fn begin_backward(&self) {
        self.lock_grads().start();
    }

    /// The final gradient of parameter `key` sits in `slot`: hand it to the communication
    /// thread, or keep it until backward ends.
    ///
    /// Nothing is reduced on this thread here. Autodiff calls this hook while it holds the
    /// rank's graph lock, and after every backward pass burn-autodiff locks *every* graph of
    /// the process to clean up. A rank blocked in a collective under its lock can then wait
    /// forever for a rank that waits for that lock (seen with four ranks). The communication
    /// thread holds no graph lock, so it may block.
    pub(crate) fn gradient_ready(self: &Arc<Self>, key: usize, slot: GradSlot<B>) {
        let grad = slot.read();
        let bytes = grad.shape().num_elements() * grad.dtype().size();
        self.memory().add(MemoryKind::Buckets, bytes);
        let mut guard = self.lock_grads();
        let state = &mut *guard;
        state.start();
        match (&mut state.reducer, grad) {
            (Some(reducer), ZeroTensor::Local(grad)) => {
                // The thread reads the gradient from its own stream on cubecl backends.
                if let Err(error) = B::sync(self.device()) {
                    panic!(
                        "burn-zero: rank {} could not finish a gradient on its device: {error}",
                        self.rank()
                    );
                }
                reducer.submit(key, grad, bytes);
                // Autodiff's container no longer keeps the full gradient alive.
                let placeholder = state
                    .placeholder
                    .get_or_insert_with(|| {
                        Tensor::<B, 1>::zeros([1], self.device())
                            .into_primitive()
                            .tensor()
                    })
                    .clone();
                slot.write(ZeroTensor::Local(placeholder));
            }
            // Kept as it is: materialising a sharded gradient would gather under the lock.
            (_, grad) => {
                state.held.insert(key, (grad, bytes));
            }
        }
        state.slots.insert(key, slot);
    }

    /// Ends a backward pass: reduces every bucket not reduced yet, zero-filled where this rank
    /// has no gradient, writes the results into autodiff's slots, and drops the gathered
    /// parameters the pass left in the cache.
    pub(crate) fn end_backward(self: &Arc<Self>) {
        let backward_ended = Instant::now();
        let mut guard = self.lock_grads();
        let state = &mut *guard;
        if state.active {
            let started = Instant::now();
            let held = std::mem::take(&mut state.held);
            let (reduced, overlap) = match &mut state.reducer {
                Some(reducer) => {
                    for (key, (grad, bytes)) in held {
                        reducer.submit(key, grad.materialize(), bytes);
                    }
                    // Every bucket takes its position now, before the fence.
                    reducer.reserve_rest();
                    // A fence at the end of the pass: a rank that gathered more than the
                    // others meets a mismatch here instead of waiting for a partner that
                    // will not come until the next step.
                    match self.comm().barrier() {
                        Ok(()) => {
                            let finished = reducer.finish(backward_ended);
                            let overlap = (finished.busy_seconds, finished.early);
                            (finished.reduced, Some(overlap))
                        }
                        Err(error) => (Err(ReduceError::Comm(error)), None),
                    }
                }
                None => {
                    for (key, (grad, bytes)) in held {
                        state.queue.push(key, grad.materialize(), bytes);
                    }
                    (self.reduce_here(&mut state.queue), None)
                }
            };
            let reduced = reduced.unwrap_or_else(|error| {
                panic!(
                    "burn-zero: rank {} could not reduce its gradients: {error}",
                    self.rank()
                )
            });
            let exposed = started.elapsed().as_secs_f64();
            let stats = self.deliver(state, reduced, exposed, overlap);
            state.active = false;
            tracing::debug!(rank = self.rank(), ?stats, "gradients reduced");
            *lock(&self.reduction) = stats;
        }
        drop(guard);
        self.clear_gather_cache();
    }

    /// Reduces every bucket on this thread, in order.
    fn reduce_here(&self, queue: &mut BucketQueue<B>) -> Result<Vec<Reduced<B>>, ReduceError> {
        let ctx = Reduction {
            comm: self.comm().as_ref(),
            device: self.device(),
            predivide: self.config().gradient_predivide_factor,
            memory: self.memory(),
        };
        let mut reduced = Vec::new();
        while !queue.is_done() {
            match queue.reduce_next(&ctx) {
                Ok(bucket) => reduced.push(bucket),
                Err(error) => {
                    queue.reset(self.memory());
                    return Err(error);
                }
            }
        }
        queue.reset(self.memory());
        Ok(reduced)
    }

    /// Writes each reduced gradient into its autodiff slot, or keeps it as an orphan when
    /// this rank has no slot for it.
    fn deliver(
        self: &Arc<Self>,
        state: &mut GradSync<B>,
        reduced: Vec<Reduced<B>>,
        exposed_seconds: f64,
        overlap: Option<(f64, usize)>,
    ) -> ReductionStats {
        let (seconds, overlapped) = overlap.unwrap_or((exposed_seconds, 0));
        let mut stats = ReductionStats {
            exposed_seconds,
            seconds,
            overlapped,
            ..ReductionStats::default()
        };
        for Reduced { bucket, values } in reduced {
            let bucket = &state.queue.buckets()[bucket];
            stats.collectives += 1;
            stats.bytes += bucket.bytes(self.world_size());
            let mode = bucket.mode;
            for (member, value) in bucket.members.iter().zip(values) {
                let value = bucket::deliver(self, mode, member, value);
                match state.slots.remove(&member.key) {
                    Some(slot) => slot.write(value),
                    None => {
                        state.orphans.insert(member.key, value);
                    }
                }
                if mode == bucket::Mode::ReduceScatter {
                    self.reuse_shard_for_gradient(member.key);
                }
            }
        }
        stats
    }
}
