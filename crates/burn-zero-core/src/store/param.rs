//! `ShardedParam`: a handle on this rank's block of a parameter (or of its reduced gradient),
//! pointing to the store that gathers it.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};

use crate::memory::MemoryKind;
use crate::store::block::{Block, SharedRow};
use crate::store::param_store::ParamStore;

/// What a sharded tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardRole {
    /// A parameter's values.
    Parameter,
    /// A parameter's reduced (mean over ranks) gradient.
    Gradient,
}

/// This rank's shard of a tensor partitioned across the ranks.
///
/// The full tensor of `shape` is flattened, zero-padded to a multiple of the world size and
/// cut into equal blocks; rank `r` holds block `r`.
#[derive(Debug)]
pub struct ShardedParam<B: Backend> {
    key: usize,
    role: ShardRole,
    block: Arc<Block<B>>,
    device: B::Device,
    shape: Shape,
    store: Arc<ParamStore<B>>,
    version: u64,
}

/// Each shard gets a unique version, so a gather cached for an older value is never reused.
static NEXT_VERSION: AtomicU64 = AtomicU64::new(1);

/// Key of a tensor sharded outside any module ([`crate::ZeroState::shard_tensor`]): the
/// store keeps no record of it.
pub(crate) const UNTRACKED_KEY: usize = usize::MAX;

impl<B: Backend> ShardedParam<B> {
    fn new(
        store: &Arc<ParamStore<B>>,
        key: usize,
        role: ShardRole,
        block: B::FloatTensorPrimitive,
        shape: Shape,
        dtype: DType,
    ) -> Self {
        let device = B::float_device(&block);
        let block = Block::new(
            key,
            dtype,
            role.memory_kind(),
            block,
            store.memory_handle(),
            store.counters().clone(),
        );
        Self::holding(store, key, role, block, device, shape)
    }

    /// A shard whose values `data` are already in host memory, uploaded to the store's device
    /// whenever they are read.
    fn new_on_host(
        store: &Arc<ParamStore<B>>,
        key: usize,
        role: ShardRole,
        data: TensorData,
        shape: Shape,
        dtype: DType,
    ) -> Self {
        let device = store.device().clone();
        let block = Block::on_host(
            key,
            dtype,
            role.memory_kind(),
            data,
            device.clone(),
            store.memory_handle(),
            store.counters().clone(),
        );
        Self::holding(store, key, role, block, device, shape)
    }

    fn holding(
        store: &Arc<ParamStore<B>>,
        key: usize,
        role: ShardRole,
        block: Block<B>,
        device: B::Device,
        shape: Shape,
    ) -> Self {
        Self {
            key,
            role,
            block: Arc::new(block),
            device,
            shape,
            store: store.clone(),
            version: NEXT_VERSION.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The shard of parameter `key` whose block on this rank is `block`, recorded in `store`
    /// as the parameter's current block (so that `reuse_fp16_shard` can release it).
    pub(crate) fn parameter(
        store: &Arc<ParamStore<B>>,
        key: usize,
        block: B::FloatTensorPrimitive,
        shape: Shape,
        dtype: DType,
    ) -> Self {
        Self::new(store, key, ShardRole::Parameter, block, shape, dtype).tracked()
    }

    /// As [`Self::parameter`], for a block whose values `data` are already in host memory
    /// (a shard staged there while its module is sharded).
    pub(crate) fn parameter_on_host(
        store: &Arc<ParamStore<B>>,
        key: usize,
        data: TensorData,
        shape: Shape,
        dtype: DType,
    ) -> Self {
        Self::new_on_host(store, key, ShardRole::Parameter, data, shape, dtype).tracked()
    }

    /// Records the block in the store as its parameter's current one (a tensor sharded
    /// outside any module is not recorded).
    fn tracked(self) -> Self {
        if self.key != UNTRACKED_KEY {
            self.store.track_block(self.key, &self.block, self.version);
        }
        self
    }

    /// This rank's shard of parameter `key`'s reduced gradient, moved to host memory when an
    /// optimizer that steps there asked for it ([`ParamStore::step_on`]).
    pub(crate) fn gradient(
        store: &Arc<ParamStore<B>>,
        key: usize,
        block: B::FloatTensorPrimitive,
        shape: Shape,
        dtype: DType,
    ) -> Self {
        Self::new(store, key, ShardRole::Gradient, block, shape, dtype).moved_where_asked()
    }

    /// This rank's shard of parameter `key`'s reduced gradient as `range` of `row`, its
    /// chunk's reduced row shared with the other members (moved to host memory, cut out of
    /// the row, when an optimizer that steps there asked for it).
    pub(crate) fn gradient_part(
        store: &Arc<ParamStore<B>>,
        key: usize,
        row: &Arc<SharedRow<B>>,
        range: Range<usize>,
        shape: Shape,
    ) -> Self {
        let kind = ShardRole::Gradient.memory_kind();
        let (memory, counters) = (store.memory_handle(), store.counters().clone());
        let block = Block::part(key, kind, row, range, memory, counters);
        let device = store.device().clone();
        Self::holding(store, key, ShardRole::Gradient, block, device, shape).moved_where_asked()
    }

    /// This gradient shard, its block moved to host memory when an optimizer that steps there
    /// asked for its parameter's gradients.
    fn moved_where_asked(self) -> Self {
        if self.store.gradient_on_host(self.key) {
            self.block.move_to_host();
        }
        self
    }

    /// This rank's shard of parameter `key`'s reduced gradient, `data` already in host memory
    /// (read back by the reduction for an optimizer that steps there).
    pub(crate) fn gradient_on_host(
        store: &Arc<ParamStore<B>>,
        key: usize,
        data: TensorData,
        shape: Shape,
        dtype: DType,
    ) -> Self {
        Self::new_on_host(store, key, ShardRole::Gradient, data, shape, dtype)
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
        self.block.values()
    }

    /// The block's values when they are in host memory (parameter offload, or a gradient kept
    /// for a host optimizer): read without a device transfer.
    pub fn host_data(&self) -> Option<TensorData> {
        self.block.host_data()
    }

    /// The row this shard is a range of, with the range, when it shares one with the other
    /// members of its chunk ([`SharedRow`]).
    pub fn row_part(&self) -> Option<(Arc<SharedRow<B>>, Range<usize>)> {
        self.block.row_part()
    }

    /// The device the block lives on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Whether the block was released (`reuse_fp16_shard`).
    pub fn is_released(&self) -> bool {
        self.block.is_released()
    }

    /// The full tensor's shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.block.dtype()
    }

    /// The store the tensor belongs to.
    pub fn store(&self) -> &Arc<ParamStore<B>> {
        &self.store
    }

    /// The same tensor with new values for this rank's block (an optimizer step): same key,
    /// role, shape, dtype and store, a new version. A parameter's new block becomes its
    /// current one in the store.
    pub fn with_shard(&self, shard: B::FloatTensorPrimitive) -> Self {
        match self.role {
            ShardRole::Parameter => Self::parameter(
                &self.store,
                self.key,
                shard,
                self.shape.clone(),
                self.dtype(),
            ),
            ShardRole::Gradient => Self::gradient(
                &self.store,
                self.key,
                shard,
                self.shape.clone(),
                self.dtype(),
            ),
        }
    }

    /// The same parameter with new values that are `range` of `row`, a chunk's new shard
    /// shared with its other members ([`SharedRow`]): no copy is made, and a gather of the
    /// whole chunk reads the row as it is.
    ///
    /// # Panics
    /// When this is a gradient's shard, or `range` is not a block of the parameter's length
    /// within the row (a caller bug).
    pub fn with_shard_part(&self, row: &Arc<SharedRow<B>>, range: Range<usize>) -> Self {
        assert_eq!(
            self.role,
            ShardRole::Parameter,
            "only a parameter's block is written as part of a chunk's row"
        );
        self.assert_new_block("values", range.len(), row.values().dtype());
        let block = Block::part(
            self.key,
            self.role.memory_kind(),
            row,
            range,
            self.store.memory_handle(),
            self.store.counters().clone(),
        );
        let device = self.device.clone();
        Self::holding(
            &self.store,
            self.key,
            self.role,
            block,
            device,
            self.shape.clone(),
        )
        .tracked()
    }

    /// The same parameter with new values `shard` already in host memory (an offloaded
    /// chunk's member, updated by the optimizer and read back once for the whole chunk): held
    /// there without a device transfer, and uploaded for each gather.
    ///
    /// # Panics
    /// When `shard` does not have the current block's element count and the parameter's
    /// element type (a caller bug), or this is a gradient's shard.
    pub fn with_host_shard(&self, shard: TensorData) -> Self {
        assert_eq!(
            self.role,
            ShardRole::Parameter,
            "only parameters live on the host"
        );
        self.assert_new_block("host values", shard.num_elements(), shard.dtype);
        let (shape, dtype) = (self.shape.clone(), self.dtype());
        let param = Self::new_on_host(&self.store, self.key, self.role, shard, shape, dtype);
        self.store
            .track_block(self.key, &param.block, param.version);
        param
    }

    /// Checks that new `what` of `numel` elements of `dtype` fit this parameter's block: its
    /// element count and type (a caller bug otherwise).
    fn assert_new_block(&self, what: &str, numel: usize, dtype: DType) {
        let block_len = self.store.block_len(self.shape.num_elements());
        assert!(
            numel == block_len && dtype == self.dtype(),
            "burn-zero: parameter #{}: new {what} of {numel} {dtype:?} elements for a block of \
             {block_len} {:?}",
            self.key,
            self.dtype()
        );
    }

    /// The full tensor, all-gathered (or taken from the store's gather cache, or from a
    /// prefetch).
    pub fn gather(&self) -> B::FloatTensorPrimitive {
        let parameter = self.role == ShardRole::Parameter && self.key != UNTRACKED_KEY;
        self.store
            .gather(self.key, self.version, &self.block, &self.shape, parameter)
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
