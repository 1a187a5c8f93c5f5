//! The bucket queue: final gradients wait here until their bucket is reduced, and buckets
//! are reduced strictly in layout order, so every rank issues the same collectives whatever
//! order its hooks fire in.

use std::collections::BTreeMap;

use burn::tensor::backend::Backend;

use crate::memory::{MemoryKind, MemoryTracker};
use crate::reduce::bucket::Bucket;
use crate::reduce::reduction::{self, ReduceError, Reduction, Values};

/// One reduced bucket: its index in the layout and each member's reduced flat gradient.
pub(crate) struct Reduced<B: Backend> {
    pub bucket: usize,
    pub values: Values<B>,
}

/// Gradients of one backward pass waiting for their bucket.
pub(crate) struct BucketQueue<B: Backend> {
    buckets: Vec<Bucket>,
    next: usize,
    /// Full gradients by parameter key, with their bytes (counted as bucket memory).
    pending: BTreeMap<usize, (B::FloatTensorPrimitive, usize)>,
}

impl<B: Backend> BucketQueue<B> {
    pub fn new(buckets: Vec<Bucket>) -> Self {
        Self {
            buckets,
            next: 0,
            pending: BTreeMap::new(),
        }
    }

    /// The layout, in reduction order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Keeps parameter `key`'s final gradient (`bytes` already counted as bucket memory).
    pub fn push(&mut self, key: usize, grad: B::FloatTensorPrimitive, bytes: usize) {
        self.pending.insert(key, (grad, bytes));
    }

    /// Whether the next bucket's gradients have all come (a parameter this rank did not use
    /// keeps its bucket incomplete until backward ends).
    pub fn next_is_complete(&self) -> bool {
        self.buckets.get(self.next).is_some_and(|bucket| {
            bucket
                .members
                .iter()
                .all(|member| self.pending.contains_key(&member.key))
        })
    }

    /// Bytes of the full gradients waiting for their bucket.
    pub fn pending_bytes(&self) -> usize {
        self.pending.values().map(|(_, bytes)| bytes).sum()
    }

    /// Whether every bucket of this pass has been reduced.
    pub fn is_done(&self) -> bool {
        self.next == self.buckets.len()
    }

    /// Reduces the next bucket, with zeros for members whose gradient never came (parameters
    /// this rank did not use), and frees the members' full gradients.
    pub fn reduce_next(&mut self, ctx: &Reduction<'_, B>) -> Result<Reduced<B>, ReduceError> {
        let index = self.next;
        self.next += 1;
        let bucket = &self.buckets[index];
        let grads = bucket
            .members
            .iter()
            .map(|member| {
                self.pending.remove(&member.key).map(|(grad, bytes)| {
                    ctx.memory.sub(MemoryKind::Buckets, bytes);
                    grad
                })
            })
            .collect();
        let values = reduction::reduce(ctx, bucket, grads)?;
        Ok(Reduced {
            bucket: index,
            values,
        })
    }

    /// Takes the next bucket out of the queue with its members' gradients (`None` where this
    /// rank has none: zeros stand in), freeing their bucket memory, so that it can be reduced
    /// on another thread; [`Self::restore`] puts it back. `None` when every bucket is done.
    #[allow(clippy::type_complexity)]
    pub fn take_next(
        &mut self,
        memory: &MemoryTracker,
    ) -> Option<(usize, Bucket, Vec<Option<B::FloatTensorPrimitive>>)> {
        let index = self.next;
        let bucket = self.buckets.get_mut(index)?;
        self.next += 1;
        let grads = bucket
            .members
            .iter()
            .map(|member| {
                self.pending.remove(&member.key).map(|(grad, bytes)| {
                    memory.sub(MemoryKind::Buckets, bytes);
                    grad
                })
            })
            .collect();
        let bucket = std::mem::replace(bucket, Bucket::taken());
        Some((index, bucket, grads))
    }

    /// Puts bucket `index` back after [`Self::take_next`] (with the buffers its reduction
    /// pooled).
    pub fn restore(&mut self, index: usize, bucket: Bucket) {
        self.buckets[index] = bucket;
    }

    /// Forgets this pass (after a failure, or when the pass is over) and starts the next.
    pub fn reset(&mut self, memory: &MemoryTracker) {
        for (_, (_, bytes)) in std::mem::take(&mut self.pending) {
            memory.sub(MemoryKind::Buckets, bytes);
        }
        self.next = 0;
    }
}
