//! `ZeroState`: the handle on one rank's state of a sharded module — its parameter store and
//! its gradient reducer — returned by [`crate::shard()`] and held by the optimizer.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_zero_comm::{Communicator, Counts, RankContext, RankOrderReduction};

use crate::backend::Zero;
use crate::config::ZeroConfig;
use crate::error::ZeroError;
use crate::memory::{MemoryReport, MemoryTracker};
use crate::reduce::hook;
use crate::reduce::{GradientReducer, ReductionStats};
use crate::store::param::UNTRACKED_KEY;
use crate::store::table::ParamTable;
use crate::store::{GatherStats, Groups, ParamInfo, ParamStore, ShardedParam};
use crate::tensor::{ShardedView, ZeroTensor};

/// One rank's state of a module sharded with [`crate::shard()`]: its parameter store
/// (communicator, configuration, parameter table, gathers, memory accounting) and its
/// gradient reducer (bucket layout, communication thread, last pass's statistics).
///
/// A cheap handle: clones share the state (two `Arc`s), and it is `Send` and `Sync`, so the
/// optimizer that holds one may be stepped from whichever thread the training loop uses.
/// Autodiff's gradient hooks, which Burn calls without a receiver, find the reducer through
/// a registry of the thread that sharded the module; nothing else does.
pub struct ZeroState<B: Backend> {
    store: Arc<ParamStore<B>>,
    reducer: Arc<GradientReducer<B>>,
}

impl<B: Backend> Clone for ZeroState<B> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            reducer: self.reducer.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for ZeroState<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroState")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("config", self.config())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> ZeroState<B> {
    /// The state of a sharded module, made known to this thread's gradient hooks.
    pub(crate) fn register(reducer: GradientReducer<B>) -> Self {
        let reducer = Arc::new(reducer);
        hook::register(&reducer);
        Self {
            store: reducer.store().clone(),
            reducer,
        }
    }

    /// A state for this rank without sharding a module (see [`Self::shard_tensor`]). A
    /// collective when `config` asks for hybrid sharding (the groups are split here).
    pub fn create(ctx: &RankContext<B>, config: ZeroConfig) -> Result<Self, ZeroError> {
        let shard_size = config
            .shard_group_size_for(ctx.world_size())
            .map_err(ZeroError::InvalidConfig)?;
        let world = if config.reduce_in_rank_order {
            Arc::new(RankOrderReduction::new(ctx.comm().clone()))
        } else {
            ctx.comm().clone()
        };
        let groups = Groups::split(world, shard_size)?;
        let counters = ctx.ordered().counters().clone();
        let store = ParamStore::new(groups, None, ctx.device().clone(), config, counters);
        store.set_table(ParamTable::default());
        Ok(Self::register(GradientReducer::new(
            Arc::new(store),
            Vec::new(),
            None,
            false,
        )))
    }

    /// The parameter store: gathers, blocks, the parameter table and memory accounting (what
    /// an optimizer or a checkpoint works with).
    pub fn store(&self) -> &Arc<ParamStore<B>> {
        &self.store
    }

    /// The gradient reducer.
    pub fn reducer(&self) -> &Arc<GradientReducer<B>> {
        &self.reducer
    }

    /// This rank within the ranks its tensors are sharded over: the job's rank, or with
    /// hybrid sharding ([`ZeroConfig::shard_group_size`]) its rank within its shard group.
    pub fn rank(&self) -> usize {
        self.store.rank()
    }

    /// Number of ranks each tensor is sharded over: every rank of the job, or with hybrid
    /// sharding the shard-group size.
    pub fn world_size(&self) -> usize {
        self.store.world_size()
    }

    /// This rank's shard group and the number of shard groups: `(0, 1)` without hybrid
    /// sharding. The groups hold the same blocks; checkpoints are written by group 0.
    pub fn replica(&self) -> (usize, usize) {
        self.store.replica()
    }

    /// Number of ranks whose gradients are averaged: every rank of the job.
    pub fn data_parallel_size(&self) -> usize {
        self.store.data_parallel_size()
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &B::Device {
        self.store.device()
    }

    /// The communicator parameters are gathered and gradients reduce-scattered with (the
    /// shard group).
    pub fn comm(&self) -> &Arc<dyn Communicator<B>> {
        self.store.comm()
    }

    /// Every communicator of this rank: all ranks, the shard group and the replica group.
    pub fn groups(&self) -> &Groups<B> {
        self.store.groups()
    }

    /// The configuration the module was sharded with.
    pub fn config(&self) -> &ZeroConfig {
        self.store.config()
    }

    /// Live memory counters.
    pub fn memory(&self) -> &MemoryTracker {
        self.store.memory()
    }

    /// A snapshot of this rank's memory accounting.
    pub fn memory_report(&self) -> MemoryReport {
        self.store.memory_report()
    }

    /// Every parameter of the module, in visit order.
    pub fn params(&self) -> Vec<ParamInfo> {
        self.store.params()
    }

    /// Whether parameter `key` required a gradient when the module was sharded: frozen
    /// parameters are never reduced or stepped (see [`ParamInfo::trainable`]).
    pub fn is_trainable(&self, key: usize) -> bool {
        self.store.is_trainable(key)
    }

    /// Whether parameter `key`'s reduced gradient is this rank's shard rather than the whole
    /// mean (see [`ParamStore::gradient_is_sharded`]).
    pub fn gradient_is_sharded(&self, key: usize) -> bool {
        self.store.gradient_is_sharded(key)
    }

    /// Drops every cached gathered parameter.
    pub fn clear_gather_cache(&self) {
        self.store.clear_gather_cache()
    }

    /// Bytes of gathered parameters held in the cache now.
    pub fn gathered_bytes(&self) -> usize {
        self.store.gathered_bytes()
    }

    /// Parameter gathers since the module was sharded: how many missed the cache, how many of
    /// those a prefetch had issued, and the time the training thread waited for them.
    pub fn gather_stats(&self) -> GatherStats {
        self.store.gather_stats()
    }

    /// This rank's counts since it started — collectives by kind, device synchronisations,
    /// host reads and writes — for every module sharded on its context: two snapshots subtract
    /// to the counts of the steps between them.
    pub fn counts(&self) -> Counts {
        self.store.counters().snapshot()
    }

    /// Gradient-reduction statistics of the last backward pass.
    pub fn last_reduction(&self) -> ReductionStats {
        self.reducer.last_reduction()
    }

    /// The gradient bucket layout: the parameter keys of each bucket, in reduction order.
    pub fn bucket_layout(&self) -> Vec<Vec<usize>> {
        self.reducer.bucket_layout()
    }

    /// Reduced gradient shards of parameters this rank did not use in the last backward pass
    /// (its autodiff gradients have no entry for them), by parameter key. Taken once.
    pub fn take_orphan_gradients(&self) -> BTreeMap<usize, ZeroTensor<B>> {
        self.reducer.take_orphan_gradients()
    }

    /// Shards a full tensor (identical on every rank) into this rank's block, as a tensor of
    /// `Zero<B>` whose ops gather it. Not marked for gradient hooks: use [`crate::shard()`] for
    /// module parameters.
    pub fn shard_tensor<const D: usize>(&self, tensor: Tensor<B, D>) -> Tensor<Zero<B>, D> {
        let shape = tensor.shape();
        let dtype = tensor.dtype();
        let flat = tensor.reshape([shape.num_elements()]);
        let block = self.store.own_block(flat).into_primitive().tensor();
        let param = ShardedParam::parameter(&self.store, UNTRACKED_KEY, block, shape, dtype);
        Tensor::from_primitive(TensorPrimitive::Float(ZeroTensor::Sharded(
            ShardedView::new(Arc::new(param)),
        )))
    }
}
