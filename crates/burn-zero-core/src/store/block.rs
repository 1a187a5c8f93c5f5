//! `Block`: this rank's flat block of one sharded tensor, as owned memory.
//!
//! The block is kept apart from [`crate::store::ShardedParam`] (the handle that knows shape,
//! version and store) so that the store can hold the live blocks of its parameters — to
//! release one for `reuse_fp16_shard` — without knowing the handles that point to it.

use std::sync::{Arc, RwLock};

use burn_zero_comm::sync::{read, write};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, TensorMetadata};

use crate::memory::{MemoryKind, MemoryTracker};

/// A rank's block of a tensor, counted as `kind` in the rank's memory accounting while held.
#[derive(Debug)]
pub struct Block<B: Backend> {
    /// The parameter's key, for error messages.
    key: usize,
    dtype: DType,
    kind: MemoryKind,
    /// `None` once released for `reuse_fp16_shard` (the optimizer's fp32 master holds the
    /// values until the step writes a new block).
    values: RwLock<Option<B::FloatTensorPrimitive>>,
    memory: Arc<MemoryTracker>,
}

impl<B: Backend> Block<B> {
    /// Holds `values` (of parameter `key`, whose element type is `dtype`) as `kind`.
    pub(crate) fn new(
        key: usize,
        dtype: DType,
        kind: MemoryKind,
        values: B::FloatTensorPrimitive,
        memory: Arc<MemoryTracker>,
    ) -> Self {
        memory.add(kind, primitive_bytes(&values));
        Self {
            key,
            dtype,
            kind,
            values: RwLock::new(Some(values)),
            memory,
        }
    }

    /// The element type of the tensor the block belongs to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The block's values.
    ///
    /// # Panics
    /// When the block was released after backward (`ZeroConfig::reuse_fp16_shard`) and no
    /// optimizer step has written a new one yet.
    pub fn values(&self) -> B::FloatTensorPrimitive {
        read(&self.values).clone().unwrap_or_else(|| {
            panic!(
                "burn-zero: parameter #{} was released after backward (reuse_fp16_shard): \
                     its values live in the optimizer's fp32 master until the next optimizer \
                     step; step before the next forward",
                self.key
            )
        })
    }

    /// Whether the block was released.
    pub fn is_released(&self) -> bool {
        read(&self.values).is_none()
    }

    /// Frees the values: their memory is then the gradient shard's to use.
    pub(crate) fn release(&self) {
        let freed = write(&self.values).take();
        if let Some(values) = freed {
            self.memory.sub(self.kind, primitive_bytes(&values));
        }
    }
}

impl<B: Backend> Drop for Block<B> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Bytes of a tensor primitive's data.
pub(crate) fn primitive_bytes<P: TensorMetadata>(tensor: &P) -> usize {
    tensor.shape().num_elements() * tensor.dtype().size()
}
