//! `ParamStore`: one rank's parameters of a sharded module — the communicator and
//! configuration they were sharded with, the parameter table, gathers and their cache, the
//! memory accounting and the live parameter blocks.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::{DType, Shape, Slice, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use burn_zero_comm::sync::lock;
use burn_zero_comm::{CommError, Communicator, OrderedComm, RankCounters};
use burn_zero_kernels::{GatheredMember, PackPath, cut_gathered, join};

use crate::chunk::{BlockLayout, Chunk, ChunkKind, ChunkLayout};
use crate::config::ZeroConfig;
use crate::memory::{
    AutoPlacementReport, ChunkCounts, KeptShardStats, MemoryKind, MemoryReport, MemoryTracker,
};
use crate::store::block::Block;
use crate::store::cache::GatherCache;
use crate::store::groups::Groups;
use crate::store::host_gradients::{HostGradients, StepSite};
use crate::store::prefetch::{GatherStats, InFlight, Prefetcher};
use crate::store::shard_placement::ShardPlacement;
use crate::store::table::{ParamInfo, ParamTable};
use crate::store::upload::{ShardValues, Upload};

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
    ///
    /// A parameter that shares a sharded chunk with others is gathered with its whole chunk:
    /// one all-gather for every member, each member then cut out of it and cached.
    pub(crate) fn gather(
        &self,
        key: usize,
        version: u64,
        block: &Block<B>,
        shape: &Shape,
        parameter: bool,
    ) -> B::FloatTensorPrimitive {
        if parameter {
            self.place_automatically(Some(key));
        }
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
        let started = Instant::now();
        let ahead = if prefetching {
            lock(&self.prefetch).take(key, version)
        } else {
            None
        };
        let prefetched = ahead.is_some();
        let chunk = self.gathered_chunk(key, parameter);
        let gathered = match (ahead, chunk) {
            (Some(ahead), _) => {
                self.memory.sub(MemoryKind::Gathered, ahead.bytes);
                let members = ahead.members.clone();
                ahead.pending.wait().map(|raw| (raw, members))
            }
            (None, Some(chunk)) => self
                .chunk_shard(chunk, key, version, block, false)
                .and_then(|(shard, members)| {
                    self.comm()
                        .all_gather(shard.on_device())
                        .map(|raw| (raw, members))
                }),
            (None, None) => {
                let values = self.own_shard(key, version, block, parameter, false);
                self.comm()
                    .all_gather(values.on_device())
                    .map(|raw| (raw, vec![(key, version)]))
            }
        };
        let full = gathered
            .map(|(raw, members)| self.cut_out(raw, &members, key, shape, caching))
            .unwrap_or_else(|error| self.gather_failed(key, error));
        if parameter {
            let mut prefetch = lock(&self.prefetch);
            prefetch.stats.gathers += 1;
            prefetch.stats.prefetched += u64::from(prefetched);
            prefetch.stats.exposed += started.elapsed();
        }
        if prefetching {
            self.prefetch_ahead();
        }
        full
    }

    /// The sharded chunk parameter `key` is gathered with, when it shares one with others.
    fn gathered_chunk(&self, key: usize, parameter: bool) -> Option<&Chunk> {
        let (chunk, _) = self.chunks().place(key)?;
        (parameter && chunk.kind == ChunkKind::Sharded && chunk.members.len() > 1).then_some(chunk)
    }

    /// This rank's shard of `chunk`: its members' current blocks one after the other
    /// (`block` at `version` for member `key`), with each member's key and shard version.
    /// An offloaded chunk's blocks (all in host memory: placement moves whole chunks) are
    /// joined on the host and uploaded as one tensor, one transfer per gather; blocks on the
    /// device are joined there.
    #[allow(clippy::type_complexity)]
    fn chunk_shard(
        &self,
        chunk: &Chunk,
        key: usize,
        version: u64,
        block: &Block<B>,
        defer_upload: bool,
    ) -> Result<(ShardValues<B>, Vec<(usize, u64)>), CommError> {
        let live = lock(&self.live);
        // The other members' blocks (`None` stands for `block`), in chunk order.
        let mut others = Vec::with_capacity(chunk.members.len());
        let mut members = Vec::with_capacity(chunk.members.len());
        for member in &chunk.members {
            if member.key == key {
                members.push((key, version));
                others.push(None);
                continue;
            }
            let current = live.blocks.get(&member.key).and_then(|(block, version)| {
                Some((block.upgrade().filter(|b| !b.is_released())?, *version))
            });
            let Some((other, version)) = current else {
                return Err(CommError::InvalidGroup(format!(
                    "parameter #{} of the chunk being gathered has no values on this rank: \
                     it was released after backward (reuse_fp16_shard) and lives in the \
                     optimizer's fp32 master until the next optimizer step; step before the \
                     next forward",
                    member.key
                )));
            };
            members.push((member.key, version));
            others.push(Some(other));
        }
        let blocks: Vec<&Block<B>> = others
            .iter()
            .map(|o| o.as_deref().unwrap_or(block))
            .collect();
        if let Some(shard) = self.host_shard(chunk, &blocks, &members, defer_upload) {
            return Ok((shard, members));
        }
        if let Some(row) = whole_row(chunk, &blocks) {
            let row = Tensor::from_primitive(TensorPrimitive::Float(row));
            return Ok((ShardValues::Device(row), members));
        }
        // Blocks written apart (by sharding, or by steps of one parameter per call) are joined
        // by the pack kernels, up to 16 a launch.
        let parts = blocks.iter().map(|b| b.values()).collect();
        let shard =
            join::<B>(parts, chunk.dtype, self.device(), PackPath::Auto).unwrap_or_else(|error| {
                panic!(
                    "burn-zero: rank {} could not join chunk #{}'s blocks for its gather: {error}",
                    self.rank(),
                    chunk.id
                )
            });
        let shard = Tensor::from_primitive(TensorPrimitive::Float(shard));
        Ok((ShardValues::Device(shard), members))
    }

    /// A single-member gather's shard: parameter `key`'s `block` (at `version`), from the
    /// kept shards or uploaded when it is in host memory and a module `parameter` (left for
    /// the gathering thread to upload with `defer_upload`, see [`Self::host_shard`]).
    fn own_shard(
        &self,
        key: usize,
        version: u64,
        block: &Block<B>,
        parameter: bool,
        defer_upload: bool,
    ) -> ShardValues<B> {
        let chunk = (parameter && block.is_on_host())
            .then(|| self.chunks().place(key))
            .flatten();
        if let Some((chunk, _)) = chunk
            && let Some(shard) = self.host_shard(chunk, &[block], &[(key, version)], defer_upload)
        {
            return shard;
        }
        ShardValues::Device(Tensor::from_primitive(TensorPrimitive::Float(
            block.values(),
        )))
    }

    /// The shard of `chunk` whose `blocks` (of `members` at their versions) are all in host
    /// memory: the one kept on the device when it holds these versions, or else uploaded
    /// (and offered to be kept). With `defer_upload`, and no shard kept between uses, the
    /// joined host bytes are returned for the thread that gathers them to upload
    /// ([`crate::store::upload`]). `None` when a block is on the device.
    fn host_shard(
        &self,
        chunk: &Chunk,
        blocks: &[&Block<B>],
        members: &[(usize, u64)],
        defer_upload: bool,
    ) -> Option<ShardValues<B>> {
        if !blocks.iter().all(|block| block.is_on_host()) {
            return None;
        }
        if defer_upload && !self.placement.keeps_shards() {
            let data = host_bytes(blocks)?;
            let upload = Upload::new(data, self.device.clone(), self.counters.clone());
            return Some(ShardValues::Host(upload));
        }
        let versions: Vec<u64> = members.iter().map(|&(_, version)| version).collect();
        let upload = || {
            let data = host_bytes(blocks)?;
            let values = Block::<B>::upload(data, &self.device, &self.counters);
            Some(Tensor::from_primitive(TensorPrimitive::Float(values)))
        };
        self.placement
            .kept_or_uploaded(chunk, versions, upload)
            .map(ShardValues::Device)
    }

    /// Cuts every member out of an all-gather's result `raw` (one member, or a chunk of
    /// `members` at their shard versions), caches those that fit when `caching`, and returns
    /// parameter `key`'s full tensor of `shape`.
    fn cut_out(
        &self,
        raw: Tensor<B, 1>,
        members: &[(usize, u64)],
        key: usize,
        shape: &Shape,
        caching: bool,
    ) -> B::FloatTensorPrimitive {
        let raw = raw.into_primitive().tensor();
        let limit = self.config.max_live_gathered_bytes;
        if let [(_, version)] = members {
            let full = full_tensor::<B>(raw, shape);
            self.cache_gathered(*version, &full, shape, caching && limit > 0);
            return full;
        }
        let chunk = self
            .chunks()
            .place(key)
            .map(|(chunk, _)| chunk)
            .expect("a chunk gather is of a parameter in a chunk");
        let mut wanted = None;
        for ((member_key, full), &(_, version)) in
            self.members_of(chunk, raw).into_iter().zip(members)
        {
            let shape = full.shape();
            self.cache_gathered(version, &full, &shape, caching);
            if member_key == key {
                wanted = Some(full);
            }
        }
        wanted.expect("the requested parameter is a member of its chunk")
    }

    /// Every member of `chunk`, full, cut out of `raw`, the all-gather of the ranks' shards of
    /// it: each rank's shard is its members' blocks end to end, so a member is one block from
    /// each rank's row, its padding cut off. On cubecl backends the copies that joins take
    /// are batched, up to 16 members a launch; at one rank a member is a view of the row where
    /// the device's alignment allows.
    fn members_of(
        &self,
        chunk: &Chunk,
        raw: B::FloatTensorPrimitive,
    ) -> Vec<(usize, B::FloatTensorPrimitive)> {
        let Some(table) = self.table() else {
            return Vec::new();
        };
        let (keys, shapes, members): (Vec<usize>, Vec<Shape>, Vec<GatheredMember>) = chunk
            .members
            .iter()
            .filter_map(|member| {
                let shape = table.get(member.key)?.shape.clone();
                let cut = GatheredMember {
                    offset: member.offset,
                    block_len: member.block_len,
                    numel: shape.num_elements(),
                };
                Some((member.key, shape, cut))
            })
            .collect();
        let flats = cut_gathered::<B>(&raw, self.world_size(), &members, PackPath::Auto)
            .unwrap_or_else(|error| {
                panic!(
                    "burn-zero: rank {} could not cut chunk #{}'s members out of its gather: \
                     {error}",
                    self.rank(),
                    chunk.id
                )
            });
        (keys.into_iter().zip(shapes).zip(flats))
            .map(|((key, shape), flat)| (key, B::float_reshape(flat, shape)))
            .collect()
    }

    /// All-gathers this rank's `shard` of `chunk` (its members' blocks end to end) and returns
    /// every member's full tensor, by key, in member order: how the updated parameters of a
    /// chunk reach every rank at stages 1 and 2 with one collective. A collective.
    pub fn all_gather_chunk(
        &self,
        chunk: &Chunk,
        shard: Tensor<B, 1>,
    ) -> Result<Vec<(usize, B::FloatTensorPrimitive)>, CommError> {
        let raw = self.comm().all_gather(shard)?.into_primitive().tensor();
        Ok(self.members_of(chunk, raw))
    }

    /// Counts a gathered tensor's bytes and keeps it in the cache when caching and it fits.
    fn cache_gathered(
        &self,
        version: u64,
        full: &B::FloatTensorPrimitive,
        shape: &Shape,
        caching: bool,
    ) {
        let bytes = shape.num_elements() * full.dtype().size();
        self.memory.touch(MemoryKind::Gathered, bytes);
        if caching && bytes <= self.config.max_live_gathered_bytes {
            let evicted = lock(&self.cache).insert(version, full.clone(), bytes);
            self.memory.add(MemoryKind::Gathered, bytes);
            self.memory.sub(MemoryKind::Gathered, evicted);
        }
    }

    /// A gather that failed cannot return an error through Burn's op traits: the rank stops,
    /// naming the parameter.
    fn gather_failed(&self, key: usize, error: CommError) -> ! {
        let path = self
            .table()
            .and_then(|table| table.get(key))
            .map(|info| info.path.clone())
            .unwrap_or_default();
        panic!(
            "burn-zero: rank {} could not gather parameter #{key} `{path}`: {error}",
            self.rank(),
        )
    }

    /// Issues the gathers the recorded order asks for next, up to the prefetch depth, while
    /// the gathered and prefetched parameters fit in `max_live_gathered_bytes` (least
    /// recently used gathered parameters make room). A parameter in a shared chunk is
    /// prefetched with its chunk.
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
            if prefetch.in_flight(key) {
                continue;
            }
            let current = lock(&self.live).blocks.get(&key).cloned();
            let (Some(info), Some((block, version))) = (table.get(key), current) else {
                break;
            };
            let Some(block) = block.upgrade().filter(|block| !block.is_released()) else {
                break;
            };
            let (values, members, bytes) = match self.gathered_chunk(key, true) {
                Some(chunk) => match self.chunk_shard(chunk, key, version, &block, true) {
                    Ok((shard, members)) => {
                        let bytes = chunk.gathered_len(self.world_size()) * info.dtype.size();
                        (shard, members, bytes)
                    }
                    Err(_) => break,
                },
                None => {
                    let values = self.own_shard(key, version, &block, true, true);
                    let bytes = info.shape.num_elements() * info.dtype.size();
                    (values, vec![(key, version)], bytes)
                }
            };
            let inflight = prefetch.inflight_bytes();
            if inflight + bytes > limit {
                break;
            }
            let evicted = lock(&self.cache).shrink_to(limit - inflight - bytes);
            self.memory.sub(MemoryKind::Gathered, evicted);
            // A shard in host memory is uploaded by the issuing thread, on its stream, just
            // before the gather (see `store::upload`).
            let reservation = ordered.reserve();
            let pending = match values {
                ShardValues::Device(values) => reservation.all_gather_later(values),
                ShardValues::Host(upload) => {
                    reservation.all_gather_later_from(move || upload.run())
                }
            }
            .unwrap_or_else(|error| {
                panic!(
                    "burn-zero: rank {} could not prefetch parameter #{key} `{}`: {error}",
                    self.rank(),
                    info.path
                )
            });
            self.memory.add(MemoryKind::Gathered, bytes);
            prefetch.issued(InFlight {
                members,
                bytes,
                pending,
            });
        }
    }

    /// Ends a pass (the end of backward): its gather order is recorded if it is new, and
    /// prefetches it did not use are dropped.
    pub(crate) fn end_pass(&self) {
        self.place_automatically(None);
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

/// `blocks` joined in host memory, when every one of them is there and they share a dtype.
fn host_bytes<B: Backend>(blocks: &[&Block<B>]) -> Option<TensorData> {
    let mut bytes = Vec::new();
    let (mut dtype, mut numel) = (None, 0);
    for block in blocks {
        let (block_dtype, len) = block.append_host_bytes(&mut bytes)?;
        if dtype.is_some_and(|d| d != block_dtype) {
            return None;
        }
        dtype = Some(block_dtype);
        numel += len;
    }
    Some(TensorData::from_bytes_vec(bytes, [numel], dtype?))
}

/// The row `blocks` (the members of `chunk`, in order) are ranges of, when they are exactly
/// its members' ranges of one row of the chunk's shard length: the shard an optimizer step
/// wrote, read whole without joining the blocks.
fn whole_row<B: Backend>(chunk: &Chunk, blocks: &[&Block<B>]) -> Option<B::FloatTensorPrimitive> {
    let parts: Vec<_> = blocks
        .iter()
        .map(|block| block.row_part())
        .collect::<Option<_>>()?;
    let (row, _) = parts.first()?;
    let one_row = parts.iter().all(|(other, _)| Arc::ptr_eq(row, other));
    let ranges = parts.iter().map(|(_, range)| range.clone());
    (one_row && chunk.is_tiled_by(row.len(), ranges)).then(|| row.values())
}
