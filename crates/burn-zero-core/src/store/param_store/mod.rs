//! `ParamStore`: one rank's parameters of a sharded module — the communicator and
//! configuration they were sharded with, the parameter table, where each shard lives, the
//! memory accounting and the live parameter blocks. The gathers (cache, prefetch, chunks,
//! offloaded shards) are in `gather`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::{DType, Tensor, TensorData};
use burn_zero_comm::sync::lock;
use burn_zero_comm::{Communicator, OrderedComm, RankCounters};

use crate::chunk::{BlockLayout, ChunkKind, ChunkLayout};
use crate::config::ZeroConfig;
use crate::memory::{
    AutoPlacementReport, ChunkCounts, KeptShardStats, MemoryReport, MemoryTracker,
};
use crate::store::block::Block;
use crate::store::cache::GatherCache;
use crate::store::groups::Groups;
use crate::store::host_gradients::{HostGradients, StepSite};
use crate::store::prefetch::Prefetcher;
use crate::store::shard_placement::ShardPlacement;
use crate::store::table::{ParamInfo, ParamTable};

mod gather;

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
    /// Which parameters are gathered and reduced together; set once, after the table.
    chunks: OnceLock<ChunkLayout>,
    /// Where each parameter shard lives (static fractions, or the auto placement's warm-up
    /// and choice).
    placement: ShardPlacement<B>,
    /// Which reduced gradient shards go to host memory as they arrive.
    gradients_on_host: Arc<HostGradients>,
    cache: Mutex<GatherCache<B::FloatTensorPrimitive>>,
    live: Mutex<LiveBlocks<B>>,
    /// The gather order and the gathers issued ahead of use.
    prefetch: Mutex<Prefetcher<B>>,
    /// The shard group behind the rank's issuing thread, where prefetches take their
    /// positions (`None` without prefetch).
    ordered: Option<OrderedComm<B>>,
    /// The rank's collectives, device synchronisations and host reads (shared with its issuing
    /// thread and every module sharded on it).
    counters: Arc<RankCounters>,
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
        counters: Arc<RankCounters>,
    ) -> Self {
        let depth = match &ordered {
            Some(_) if config.prefetches() => config.prefetch,
            _ => 0,
        };
        let memory = Arc::new(MemoryTracker::default());
        // `shard` reads the device's capacity into MiB before the store is made.
        let placement = ShardPlacement::new(
            &config.placement,
            device.clone(),
            groups.world.rank(),
            memory.clone(),
        );
        Self {
            prefetch: Mutex::new(Prefetcher::new(depth)),
            ordered,
            counters,
            device,
            cache: Mutex::new(GatherCache::new(config.max_live_gathered_bytes)),
            groups,
            config,
            memory,
            table: OnceLock::new(),
            chunks: OnceLock::new(),
            placement,
            gradients_on_host: Arc::new(HostGradients::default()),
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

    /// Fixes the chunk layout (once: a second call is ignored).
    /// Moves the parameter shards of the chunks `offload_param_frac` places on the host there
    /// (all of them for the auto placement's warm-up), and shards staged on the host while
    /// sharding ([`Self::stages_shards_on_host`]) whose chunks stay on the device back to it.
    pub(crate) fn set_chunks(&self, chunks: ChunkLayout) {
        if self.chunks.set(chunks).is_err() {
            tracing::warn!("the chunk layout of a sharded module was set twice");
            return;
        }
        self.placement.lay_out(self.chunks());
        // One walk; the host-bound shards move first, so that the device frees their memory
        // before it takes the others.
        let (to_host, to_device): (Vec<_>, Vec<_>) = self
            .live_blocks(|_| true)
            .into_iter()
            .partition(|(key, _)| self.is_on_host(*key));
        for (_, block) in to_host {
            block.move_to_host();
        }
        for (_, block) in to_device {
            block.move_to_device();
        }
    }

    /// Whether sharding puts each new parameter shard in host memory at once, before the
    /// chunk layout says where it lives: whenever parameters may be offloaded
    /// (`offload_param_frac` above 0, or the auto placement, whose warm-up starts with every
    /// shard on the host). The device then holds one parameter at a time while a module is
    /// sharded, not the whole model, so that a model larger than the device can be sharded
    /// from lazily initialised parameters; the chunks that stay on the device are uploaded
    /// once the layout is known.
    pub(crate) fn stages_shards_on_host(&self) -> bool {
        self.placement.stages_shards_on_host()
    }

    /// The current blocks of the parameters `wanted` picks, with their keys.
    fn live_blocks(&self, wanted: impl Fn(usize) -> bool) -> Vec<(usize, Arc<Block<B>>)> {
        let live = lock(&self.live);
        live.blocks
            .iter()
            .filter(|(key, _)| wanted(**key))
            .filter_map(|(&key, (block, _))| Some((key, block.upgrade()?)))
            .collect()
    }

    /// Where the optimizer steps the parameters `keys` (`None`: every parameter), which decides
    /// where their reduced gradient shards go: to host memory as their reduction delivers them
    /// ([`StepSite::Host`]; a bucket is read back when every one of its members steps there),
    /// or kept on the device ([`StepSite::Device`], whose moved state takes device room from
    /// the auto placement's kept shards). Parameters never named step on the device.
    pub fn step_on(&self, keys: Option<&HashSet<usize>>, site: StepSite) {
        match (site, keys) {
            (StepSite::Host, None) => self.gradients_on_host.keep_all(),
            (StepSite::Host, Some(keys)) => self.gradients_on_host.keep(keys.iter().copied()),
            (StepSite::Device { moved_state_bytes }, keys) => {
                match keys {
                    None => self.gradients_on_host.forget_all(),
                    Some(keys) => self.gradients_on_host.forget(keys.iter().copied()),
                }
                if moved_state_bytes > 0 {
                    self.placement.take_device_room(moved_state_bytes);
                }
            }
        }
    }

    /// Whether parameter `key`'s reduced gradient shard goes to host memory as it arrives.
    pub fn gradient_on_host(&self, key: usize) -> bool {
        self.gradients_on_host.of(key)
    }

    /// The set behind [`Self::gradient_on_host`], for the reduction (the communication
    /// thread holds it, not the store, which it must not keep alive).
    pub(crate) fn host_gradients(&self) -> Arc<HostGradients> {
        self.gradients_on_host.clone()
    }

    /// Whether parameter `key`'s shard lives in host memory (`offload_param_frac`, or the
    /// auto placement); until the chunk layout is set, whether shards are staged there.
    pub fn is_on_host(&self, key: usize) -> bool {
        self.placement.is_on_host(key)
    }

    /// What the auto placement measured and decided (`None` without it, or before its
    /// warm-up has ended).
    pub fn auto_placement(&self) -> Option<AutoPlacementReport> {
        self.placement.report()
    }

    /// What the host shards kept on the device between uses did (`None` without the auto
    /// placement, or before it decided).
    pub fn kept_shards(&self) -> Option<KeptShardStats> {
        self.placement.kept_shards()
    }

    /// The auto placement's part at a gather of parameter `gathered_key` or (`None`) at the end
    /// of a pass (see [`ShardPlacement::at_gather`]): the chunks it moves to the device for
    /// good take their live blocks there.
    fn place_automatically(&self, gathered_key: Option<usize>) {
        self.placement
            .at_gather(gathered_key, self.chunks(), |keys: &HashSet<usize>| {
                for (_, block) in self.live_blocks(|key| keys.contains(&key)) {
                    block.move_to_device();
                }
            });
    }

    /// During the auto placement's warm-up, a reading of the device's bytes in use inside the
    /// current period (see [`ShardPlacement::read_within_period`]).
    pub(crate) fn read_within_period(&self) {
        self.placement.read_within_period();
    }

    /// The chunk layout: which parameters are gathered, reduced and stepped together (empty
    /// until the module is sharded).
    pub fn chunks(&self) -> &ChunkLayout {
        static EMPTY: OnceLock<ChunkLayout> = OnceLock::new();
        self.chunks
            .get()
            .unwrap_or_else(|| EMPTY.get_or_init(ChunkLayout::default))
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

    /// The rank's counts of collectives, device synchronisations and host reads.
    pub fn counters(&self) -> &Arc<RankCounters> {
        &self.counters
    }

    /// Live memory counters.
    pub fn memory(&self) -> &MemoryTracker {
        &self.memory
    }

    /// The memory counters, shared (blocks and the communication thread update them too).
    pub(crate) fn memory_handle(&self) -> Arc<MemoryTracker> {
        self.memory.clone()
    }

    /// A snapshot of this rank's memory accounting, with the chunk layout's numbers and the
    /// rank's counts so far.
    pub fn memory_report(&self) -> MemoryReport {
        let mut report = self.memory.report(self.groups.world.rank());
        let chunks = self.chunks();
        let ranks = self.world_size();
        let sharded = chunks
            .chunks()
            .iter()
            .filter(|c| c.kind == ChunkKind::Sharded);
        report.chunks = ChunkCounts {
            sharded: chunks.count(ChunkKind::Sharded),
            replicated: chunks.count(ChunkKind::Replicated),
            padding_bytes: sharded
                .flat_map(|c| c.members.iter().map(move |m| (c.dtype, m)))
                .map(|(dtype, m)| ((m.block_len * ranks - m.numel) * dtype.size()) as u64)
                .sum(),
        };
        report.counts = self.counters.snapshot();
        report.auto_placement = self.auto_placement();
        report.kept_shards = self.kept_shards();
        report
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
        let (device, dtype) = (flat.device(), flat.dtype());
        Tensor::from_data(self.own_block_data(flat), (&device, dtype))
    }

    /// As [`Self::own_block`], into host memory: the block's values are read off the device
    /// and padded there, so no device copy of the block is ever made.
    pub(crate) fn own_block_data(&self, flat: Tensor<B, 1>) -> TensorData {
        let blocks = self.blocks(flat.dims()[0]);
        let owned = blocks.owned(self.rank());
        let padding = blocks.padding(self.rank());
        if padding == 0 && !owned.is_empty() {
            // The block as it is read back: no second copy on the host.
            return flat.slice(owned).into_data();
        }
        let dtype = flat.dtype();
        let mut bytes = Vec::with_capacity((owned.len() + padding) * dtype.size());
        if !owned.is_empty() {
            bytes.extend_from_slice(flat.slice(owned.clone()).into_data().as_bytes());
        }
        bytes.resize(bytes.len() + padding * dtype.size(), 0);
        TensorData::from_bytes_vec(bytes, [owned.len() + padding], dtype)
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

    /// Records `block` as the current block of parameter `key`, moved to host memory when the
    /// parameter's chunk lives there, to the device when it does not.
    pub(crate) fn track_block(&self, key: usize, block: &Arc<Block<B>>, version: u64) {
        if let Some((chunk, _)) = self.chunks().place(key) {
            self.placement.forget_kept(chunk.id);
        }
        if self.is_on_host(key) {
            block.move_to_host();
        } else {
            block.move_to_device();
        }
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
