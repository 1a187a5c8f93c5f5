//! `ShardedParam`: this rank's flat slice of a parameter (or of its reduced gradient).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape};

use crate::group::ZeroGroup;
use crate::memory::MemoryKind;

/// What a sharded tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardRole {
    /// A parameter's values.
    Parameter,
    /// A parameter's reduced (mean over ranks) gradient.
    Gradient,
}

/// This rank's shard of a tensor partitioned across a group.
///
/// The full tensor of `shape` is flattened, zero-padded to a multiple of the world size and
/// cut into equal blocks; rank `r` holds block `r`.
#[derive(Debug)]
pub struct ShardedParam<B: Backend> {
    key: usize,
    role: ShardRole,
    /// The block; `None` once released for `reuse_fp16_shard` (the optimizer's fp32 master
    /// holds the values until the step writes a new shard).
    shard: RwLock<Option<B::FloatTensorPrimitive>>,
    device: B::Device,
    shape: Shape,
    dtype: DType,
    group: Arc<ZeroGroup<B>>,
    version: u64,
}

/// Each shard gets a unique version, so a gather cached for an older value is never reused.
static NEXT_VERSION: AtomicU64 = AtomicU64::new(1);

impl<B: Backend> ShardedParam<B> {
    pub(crate) fn new(
        key: usize,
        role: ShardRole,
        shard: B::FloatTensorPrimitive,
        shape: Shape,
        dtype: DType,
        group: Arc<ZeroGroup<B>>,
    ) -> Self {
        group.memory().add(role.memory_kind(), shard_bytes(&shard));
        Self {
            key,
            role,
            device: B::float_device(&shard),
            shard: RwLock::new(Some(shard)),
            shape,
            dtype,
            group,
            version: NEXT_VERSION.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Position of the parameter in its module's visit order.
    pub fn key(&self) -> usize {
        self.key
    }

    /// Whether this holds values or a gradient.
    pub fn role(&self) -> ShardRole {
        self.role
    }

    /// This rank's flat block (padded length / world size elements).
    ///
    /// # Panics
    /// When the block was released after backward (`ZeroConfig::reuse_fp16_shard`) and no
    /// optimizer step has written a new one yet.
    pub fn shard(&self) -> B::FloatTensorPrimitive {
        self.shard
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
            .unwrap_or_else(|| {
                panic!(
                    "burn-zero: parameter #{} was released after backward (reuse_fp16_shard): \
                     its values live in the optimizer's fp32 master until the next optimizer \
                     step; step before the next forward",
                    self.key
                )
            })
    }

    /// The device the block lives on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Whether the block was released (`reuse_fp16_shard`).
    pub fn is_released(&self) -> bool {
        self.shard
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .is_none()
    }

    /// Frees the block: its memory is then the gradient shard's to use.
    pub(crate) fn release(&self) {
        let freed = self
            .shard
            .write()
            .unwrap_or_else(|poison| poison.into_inner())
            .take();
        if let Some(shard) = freed {
            self.group
                .memory()
                .sub(self.role.memory_kind(), shard_bytes(&shard));
        }
    }

    /// The full tensor's shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The group the tensor is sharded across.
    pub fn group(&self) -> &Arc<ZeroGroup<B>> {
        &self.group
    }

    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// The same tensor with new values for this rank's block (an optimizer step): same key,
    /// role, shape, dtype and group, a new version.
    pub fn with_shard(&self, shard: B::FloatTensorPrimitive) -> Self {
        Self::new(
            self.key,
            self.role,
            shard,
            self.shape.clone(),
            self.dtype,
            self.group.clone(),
        )
    }

    /// The full tensor, all-gathered (or taken from the group's gather cache).
    pub fn gather(&self) -> B::FloatTensorPrimitive {
        self.group.gather(self)
    }
}

impl ShardRole {
    fn memory_kind(self) -> MemoryKind {
        match self {
            ShardRole::Parameter => MemoryKind::ParameterShards,
            ShardRole::Gradient => MemoryKind::GradientShards,
        }
    }
}

impl<B: Backend> Drop for ShardedParam<B> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Bytes of a tensor primitive's data.
pub(crate) fn shard_bytes<P: burn::tensor::TensorMetadata>(tensor: &P) -> usize {
    tensor.shape().num_elements() * tensor.dtype().size()
}
