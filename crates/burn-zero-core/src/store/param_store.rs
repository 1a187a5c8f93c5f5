//! `ParamStore`: one rank's parameters of a sharded module — the communicator and
//! configuration they were sharded with, the parameter table, gathers and their cache, the
//! memory accounting and the live parameter blocks.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::{DType, Shape, Slice, Tensor, TensorPrimitive};
use burn_zero_comm::sync::lock;
use burn_zero_comm::{CommError, Communicator, OrderedComm};

use crate::config::ZeroConfig;
use crate::memory::{MemoryKind, MemoryReport, MemoryTracker};
use crate::store::block::Block;
use crate::store::cache::GatherCache;
use crate::store::groups::Groups;
use crate::store::layout::BlockLayout;
use crate::store::prefetch::{GatherStats, InFlight, Prefetcher};
use crate::store::table::{ParamInfo, ParamTable};

/// One rank's store of a sharded module's parameters.
///
/// Shared (`Arc`) by every [`crate::store::ShardedParam`] of the module, by the gradient
/// reducer and by the optimizer, through [`crate::ZeroState`].
pub struct ParamStore<B: Backend> {
    groups: Groups<B>,
    device: B::Device,
    config: ZeroConfig,
    memory: Arc<MemoryTracker>,
    /// Set once, when sharding has visited every parameter.
    table: OnceLock<ParamTable>,
    cache: Mutex<GatherCache<B::FloatTensorPrimitive>>,
    live: Mutex<LiveBlocks<B>>,
    /// The gather order and the gathers issued ahead of use.
    prefetch: Mutex<Prefetcher<B>>,
    /// The shard group behind the rank's issuing thread, where prefetches take their
    /// positions (`None` without prefetch).
    ordered: Option<OrderedComm<B>>,
}

/// The current block (and its version) of each sharded parameter and the keys an optimizer
/// keeps a master copy of: what `reuse_fp16_shard` needs to release a block once its gradient
/// shard arrives, and what a prefetch gathers.
struct LiveBlocks<B: Backend> {
    blocks: HashMap<usize, (Weak<Block<B>>, u64)>,
    mastered: HashSet<usize>,
}

impl<B: Backend> std::fmt::Debug for ParamStore<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamStore")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("replica", &self.groups.replica())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> ParamStore<B> {
    /// An empty store of one rank: no parameter yet. `ordered` is the shard group behind the
    /// rank's issuing thread, where prefetches are issued (prefetch is off without it).
    pub(crate) fn new(
        groups: Groups<B>,
        ordered: Option<OrderedComm<B>>,
        device: B::Device,
        config: ZeroConfig,
    ) -> Self {
        let depth = match &ordered {
            Some(_) if config.prefetches() => config.prefetch,
            _ => 0,
        };
        Self {
            prefetch: Mutex::new(Prefetcher::new(depth)),
            ordered,
            device,
            cache: Mutex::new(GatherCache::new(config.max_live_gathered_bytes)),
            groups,
            config,
            memory: Arc::new(MemoryTracker::default()),
            table: OnceLock::new(),
            live: Mutex::new(LiveBlocks {
                blocks: HashMap::new(),
                mastered: HashSet::new(),
            }),
        }
    }

    /// Fixes the parameter table (once: a second call is ignored).
    pub(crate) fn set_table(&self, table: ParamTable) {
        if self.table.set(table).is_err() {
            tracing::warn!("the parameter table of a sharded module was set twice");
        }
    }

    fn table(&self) -> Option<&ParamTable> {
        self.table.get()
    }

    /// This rank within the ranks its tensors are sharded over (its shard group; the job's
    /// rank without hybrid sharding).
    pub fn rank(&self) -> usize {
        self.groups.shard.rank()
    }

    /// Number of ranks each tensor is sharded over (the shard-group size; every rank of the
    /// job without hybrid sharding).
    pub fn world_size(&self) -> usize {
        self.groups.shard.world_size()
    }

    /// This rank's shard group and the number of shard groups (`(0, 1)` without hybrid
    /// sharding). Ranks of different shard groups hold the same blocks.
    pub fn replica(&self) -> (usize, usize) {
        self.groups.replica()
    }

    /// The communicators: every rank, the shard group, the replica group.
    pub fn groups(&self) -> &Groups<B> {
        &self.groups
    }

    /// Number of ranks whose gradients are averaged (every rank of the job).
    pub fn data_parallel_size(&self) -> usize {
        self.world_size() * self.replica().1
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The communicator parameters are gathered and gradients reduce-scattered with: the
    /// shard group.
    pub fn comm(&self) -> &Arc<dyn Communicator<B>> {
        &self.groups.shard
    }

    /// The configuration the module was sharded with.
    pub fn config(&self) -> &ZeroConfig {
        &self.config
    }

    /// Live memory counters.
    pub fn memory(&self) -> &MemoryTracker {
        &self.memory
    }

    /// The memory counters, shared (blocks and the communication thread update them too).
    pub(crate) fn memory_handle(&self) -> Arc<MemoryTracker> {
        self.memory.clone()
    }

    /// A snapshot of this rank's memory accounting.
    pub fn memory_report(&self) -> MemoryReport {
        self.memory.report(self.groups.world.rank())
    }

    /// Every parameter of the module, in visit order.
    pub fn params(&self) -> Vec<ParamInfo> {
        self.table()
            .map(|table| table.infos().to_vec())
            .unwrap_or_default()
    }

    /// The key of the parameter with gradient-hook mark `id`
    /// (`DistributedParamId::from(param_id.val())`), if it belongs to this module.
    pub fn key_of(&self, id: &DistributedParamId) -> Option<usize> {
        self.table()?.key_of(id)
    }

    /// Whether parameter `key` required a gradient when the module was sharded (see
    /// [`crate::store::table::ParamInfo::trainable`]).
    pub fn is_trainable(&self, key: usize) -> bool {
        self.table()
            .and_then(|table| table.get(key))
            .is_some_and(|info| info.trainable)
    }

    /// Every gradient-hook mark of the module's parameters.
    pub(crate) fn param_ids(&self) -> HashSet<DistributedParamId> {
        self.table()
            .map(|table| table.ids().copied().collect())
            .unwrap_or_default()
    }

    /// Length of each rank's block for a tensor of `numel` elements (padded to the world size).
    pub fn block_len(&self, numel: usize) -> usize {
        self.blocks(numel).block_len()
    }

    /// The padded blocks of a flat tensor of `numel` elements over this rank's shard group.
    fn blocks(&self, numel: usize) -> BlockLayout {
        BlockLayout::new(numel, self.world_size())
    }

    /// Cuts this rank's block out of a full flat tensor, zero-padding past its end, into a
    /// fresh buffer (so that the full tensor is not kept alive by a view).
    pub fn own_block(&self, flat: Tensor<B, 1>) -> Tensor<B, 1> {
        let blocks = self.blocks(flat.dims()[0]);
        let owned = blocks.owned(self.rank());
        let padding = blocks.padding(self.rank());
        let device = flat.device();
        let dtype = flat.dtype();
        let mut parts = Vec::with_capacity(2);
        if !owned.is_empty() {
            let real = flat.slice(owned);
            parts.push(Tensor::from_data(real.into_data(), (&device, dtype)));
        }
        if padding > 0 {
            parts.push(Tensor::zeros([padding], (&device, dtype)));
        }
        Tensor::cat(parts, 0)
    }

    /// All-gathers every rank's block of a padded flat tensor and returns the full tensor of
    /// `shape` (padding cut off). A collective.
    pub fn all_gather_full(
        &self,
        block: Tensor<B, 1>,
        shape: &Shape,
    ) -> Result<B::FloatTensorPrimitive, CommError> {
        let full = self.comm().all_gather(block)?.into_primitive().tensor();
        Ok(full_tensor::<B>(full, shape))
    }

    /// The full tensor of `shape` whose block on this rank is `block` (parameter `key`, shard
    /// `version`): from the cache, from a prefetch, or all-gathered now (and cached if it
    /// fits). `parameter`: a module parameter's values, whose gathers follow the recorded
    /// order and may be prefetched (not a gradient, not a tensor outside the module).
    pub(crate) fn gather(
        &self,
        key: usize,
        version: u64,
        block: &Block<B>,
        shape: &Shape,
        parameter: bool,
    ) -> B::FloatTensorPrimitive {
        let prefetching = parameter && lock(&self.prefetch).depth() > 0;
        if prefetching {
            let dropped = lock(&self.prefetch).request(key);
            self.memory.sub(MemoryKind::Gathered, dropped);
        }
        let caching = self.config.max_live_gathered_bytes > 0;
        // The cache's lock is released before prefetching (an `if let` scrutinee's
        // temporaries live through its block).
        let hit = if caching {
            lock(&self.cache).get(version)
        } else {
            None
        };
        if let Some(hit) = hit {
            if prefetching {
                self.prefetch_ahead();
            }
            return hit;
        }
        let numel = shape.num_elements();
        let bytes = numel * block.dtype().size();
        let started = Instant::now();
        let ahead = if prefetching {
            lock(&self.prefetch).take(key, version)
        } else {
            None
        };
        let prefetched = ahead.is_some();
        let full = match ahead {
            Some(ahead) => {
                self.memory.sub(MemoryKind::Gathered, ahead.bytes);
                ahead
                    .pending
                    .wait()
                    .map(|full| full_tensor::<B>(full.into_primitive().tensor(), shape))
            }
            None => {
                let values = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(block.values()));
                self.all_gather_full(values, shape)
            }
        };
        let full = full.unwrap_or_else(|error| {
            let path = self
                .table()
                .and_then(|table| table.get(key))
                .map(|info| info.path.clone())
                .unwrap_or_default();
            panic!(
                "burn-zero: rank {} could not gather parameter #{key} `{path}`: {error}",
                self.rank(),
            )
        });
        if parameter {
            let mut prefetch = lock(&self.prefetch);
            prefetch.stats.gathers += 1;
            prefetch.stats.prefetched += u64::from(prefetched);
            prefetch.stats.exposed += started.elapsed();
        }
        self.memory.touch(MemoryKind::Gathered, bytes);
        if caching && bytes <= self.config.max_live_gathered_bytes {
            let evicted = lock(&self.cache).insert(version, full.clone(), bytes);
            self.memory.add(MemoryKind::Gathered, bytes);
            self.memory.sub(MemoryKind::Gathered, evicted);
        }
        if prefetching {
            self.prefetch_ahead();
        }
        full
    }

    /// Issues the gathers the recorded order asks for next, up to the prefetch depth, while
    /// the gathered and prefetched parameters fit in `max_live_gathered_bytes` (least
    /// recently used gathered parameters make room).
    fn prefetch_ahead(&self) {
        let Some(ordered) = &self.ordered else { return };
        let Some(table) = self.table() else { return };
        let limit = self.config.max_live_gathered_bytes;
        let mut prefetch = lock(&self.prefetch);
        let upcoming = {
            let cache = lock(&self.cache);
            let live = lock(&self.live);
            prefetch.upcoming(|key| {
                live.blocks
                    .get(&key)
                    .is_some_and(|(_, version)| cache.contains(*version))
            })
        };
        for key in upcoming {
            let current = lock(&self.live).blocks.get(&key).cloned();
            let (Some(info), Some((block, version))) = (table.get(key), current) else {
                break;
            };
            let Some(block) = block.upgrade().filter(|block| !block.is_released()) else {
                break;
            };
            let bytes = info.shape.num_elements() * info.dtype.size();
            let inflight = prefetch.inflight_bytes();
            if inflight + bytes > limit {
                break;
            }
            let evicted = lock(&self.cache).shrink_to(limit - inflight - bytes);
            self.memory.sub(MemoryKind::Gathered, evicted);
            let values = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(block.values()));
            let pending = ordered
                .reserve()
                .all_gather_later(values)
                .unwrap_or_else(|error| {
                    panic!(
                        "burn-zero: rank {} could not prefetch parameter #{key} `{}`: {error}",
                        self.rank(),
                        info.path
                    )
                });
            self.memory.add(MemoryKind::Gathered, bytes);
            prefetch.issued(InFlight {
                key,
                version,
                bytes,
                pending,
            });
        }
    }

    /// Ends a pass (the end of backward): its gather order is recorded if it is new, and
    /// prefetches it did not use are dropped.
    pub(crate) fn end_pass(&self) {
        let dropped = lock(&self.prefetch).end_pass();
        self.memory.sub(MemoryKind::Gathered, dropped);
    }

    /// Gathers and prefetches since the module was sharded.
    pub fn gather_stats(&self) -> GatherStats {
        lock(&self.prefetch).stats
    }

    /// Drops every cached gathered parameter.
    pub fn clear_gather_cache(&self) {
        let freed = lock(&self.cache).clear();
        self.memory.sub(MemoryKind::Gathered, freed);
    }

    /// Bytes of gathered parameters held in the cache now.
    pub fn gathered_bytes(&self) -> usize {
        lock(&self.cache).bytes()
    }

    /// Whether parameter `key`'s reduced gradient is this rank's shard (reduce-scattered: stages
    /// 1–3) rather than the whole mean (all-reduced: stage 0, and replicated parameters at
    /// stage 3).
    pub fn gradient_is_sharded(&self, key: usize) -> bool {
        let persistent = self
            .table()
            .and_then(|table| table.get(key))
            .is_some_and(|info| info.persistent);
        match self.config.stage {
            0 => false,
            3 => !persistent,
            _ => true,
        }
    }

    /// Records `block` as the current block of parameter `key`.
    pub(crate) fn track_block(&self, key: usize, block: &Arc<Block<B>>, version: u64) {
        lock(&self.live)
            .blocks
            .insert(key, (Arc::downgrade(block), version));
    }

    /// Tells the store that an optimizer keeps parameter `key`'s values in an fp32 master copy
    /// on this rank, so that with `reuse_fp16_shard` its half-precision block may be released
    /// once its gradient shard arrives.
    pub fn hold_master(&self, key: usize) {
        lock(&self.live).mastered.insert(key);
    }

    /// With `reuse_fp16_shard`: frees parameter `key`'s half-precision block when a master
    /// copy holds its values, so the gradient shard takes its place in memory.
    pub(crate) fn reuse_block_for_gradient(&self, key: usize) {
        if !self.config.reuse_fp16_shard {
            return;
        }
        let current = {
            let live = lock(&self.live);
            if !live.mastered.contains(&key) {
                return;
            }
            live.blocks.get(&key).and_then(|(block, _)| block.upgrade())
        };
        if let Some(block) = current
            && matches!(block.dtype(), DType::F16 | DType::BF16)
        {
            block.release();
        }
    }
}

/// The full tensor of `shape` from the concatenated, padded blocks of an all-gather.
fn full_tensor<B: Backend>(
    gathered: B::FloatTensorPrimitive,
    shape: &Shape,
) -> B::FloatTensorPrimitive {
    B::float_reshape(
        B::float_slice(gathered, &[Slice::from(0..shape.num_elements())]),
        shape.clone(),
    )
}
