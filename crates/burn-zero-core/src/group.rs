//! `ZeroGroup`: one rank's view of a sharded module — its communicator, configuration,
//! parameter table, gather cache, gradient synchronisation and memory accounting.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::{DType, Shape, Slice, Tensor, TensorPrimitive};
use burn_zero_comm::{CommError, Communicator};

use crate::config::ZeroConfig;
use crate::gather::GatherCache;
use crate::grads::GradSync;
use crate::memory::{MemoryKind, MemoryReport, MemoryTracker};
use crate::sharded::ShardedParam;

/// What the group knows of one parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// Position in the module's visit order.
    pub key: usize,
    /// Path in the module, as `blocks.0.attn.query.weight`.
    pub path: String,
    /// Full shape.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
    /// Replicated (below `persist_below_numel`) rather than sharded.
    pub persistent: bool,
}

#[derive(Debug, Default)]
pub(crate) struct ParamTable {
    pub infos: Vec<ParamInfo>,
    pub keys: HashMap<DistributedParamId, usize>,
}

/// One rank's state for a module sharded with [`crate::shard`].
pub struct ZeroGroup<B: Backend> {
    comm: Arc<dyn Communicator<B>>,
    device: B::Device,
    config: ZeroConfig,
    memory: Arc<MemoryTracker>,
    cache: Mutex<GatherCache<B::FloatTensorPrimitive>>,
    pub(crate) params: Mutex<ParamTable>,
    pub(crate) grads: Mutex<GradSync<B>>,
    pub(crate) reduction: Mutex<ReductionStats>,
    /// The current shard of each sharded parameter, by key (for `reuse_fp16_shard`).
    live: Mutex<HashMap<usize, Weak<ShardedParam<B>>>>,
    /// Keys whose values an optimizer holds in an fp32 master copy.
    mastered: Mutex<HashSet<usize>>,
}

/// What the last backward pass spent on gradient reduction, on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReductionStats {
    /// Collectives issued (one per bucket).
    pub collectives: usize,
    /// Bytes this rank put into them (all ranks' rows of every bucket).
    pub bytes: usize,
    /// Wall time of packing, reducing and unpacking every bucket (on the communication
    /// thread when reduction overlaps backward).
    pub seconds: f64,
    /// Time the training thread waited for reductions once backward was over: all of
    /// `seconds` without overlap, only the part backward did not hide with it.
    pub exposed_seconds: f64,
    /// Buckets whose reduction was done while backward was still running.
    pub overlapped: usize,
}

impl<B: Backend> std::fmt::Debug for ZeroGroup<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroGroup")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl<B: Backend> ZeroGroup<B> {
    pub(crate) fn new(
        comm: Arc<dyn Communicator<B>>,
        device: B::Device,
        config: ZeroConfig,
    ) -> Self {
        Self {
            device,
            cache: Mutex::new(GatherCache::new(config.max_live_gathered_bytes)),
            comm,
            config,
            memory: Arc::new(MemoryTracker::default()),
            params: Mutex::new(ParamTable::default()),
            grads: Mutex::new(GradSync::default()),
            reduction: Mutex::new(ReductionStats::default()),
            live: Mutex::new(HashMap::new()),
            mastered: Mutex::new(HashSet::new()),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The communicator the group gathers and reduces with.
    pub fn comm(&self) -> &Arc<dyn Communicator<B>> {
        &self.comm
    }

    /// The configuration the module was sharded with.
    pub fn config(&self) -> &ZeroConfig {
        &self.config
    }

    /// Live memory counters.
    pub fn memory(&self) -> &MemoryTracker {
        &self.memory
    }

    /// The memory counters, shared (the communication thread updates them too).
    pub(crate) fn memory_handle(&self) -> Arc<MemoryTracker> {
        self.memory.clone()
    }

    /// A snapshot of this rank's memory accounting.
    pub fn memory_report(&self) -> MemoryReport {
        self.memory.report(self.rank())
    }

    /// Every parameter of the module, in visit order.
    pub fn params(&self) -> Vec<ParamInfo> {
        lock(&self.params).infos.clone()
    }

    /// Length of each rank's block for a tensor of `numel` elements (padded to the world size).
    pub fn block_len(&self, numel: usize) -> usize {
        numel.div_ceil(self.world_size())
    }

    /// Cuts this rank's block out of a full flat tensor, zero-padding past its end, into a
    /// fresh buffer (so that the full tensor is not kept alive by a view).
    pub fn own_block(&self, flat: Tensor<B, 1>) -> Tensor<B, 1> {
        let numel = flat.dims()[0];
        let block = self.block_len(numel);
        let start = (self.rank() * block).min(numel);
        let end = (start + block).min(numel);
        let device = flat.device();
        let dtype = flat.dtype();
        let mut parts = Vec::with_capacity(2);
        if end > start {
            let real = flat.slice(start..end);
            parts.push(Tensor::from_data(real.into_data(), (&device, dtype)));
        }
        if end - start < block {
            parts.push(Tensor::zeros([block - (end - start)], (&device, dtype)));
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
        let full = self.comm.all_gather(block)?.into_primitive().tensor();
        Ok(B::float_reshape(
            B::float_slice(full, &[Slice::from(0..shape.num_elements())]),
            shape.clone(),
        ))
    }

    /// The full tensor behind `param`: from the cache, or all-gathered (and cached if it fits).
    pub(crate) fn gather(&self, param: &ShardedParam<B>) -> B::FloatTensorPrimitive {
        let caching = self.config.max_live_gathered_bytes > 0;
        if caching && let Some(hit) = lock(&self.cache).get(param.version()) {
            return hit;
        }
        let numel = param.shape().num_elements();
        let block = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(param.shard().clone()));
        let full = self
            .all_gather_full(block, param.shape())
            .unwrap_or_else(|error| {
                let path = lock(&self.params)
                    .infos
                    .get(param.key())
                    .map(|info| info.path.clone())
                    .unwrap_or_default();
                panic!(
                    "burn-zero: rank {} could not gather parameter #{} `{path}`: {error}",
                    self.rank(),
                    param.key()
                )
            });
        let bytes = numel * param.dtype().size();
        self.memory.touch(MemoryKind::Gathered, bytes);
        if caching && bytes <= self.config.max_live_gathered_bytes {
            let evicted = lock(&self.cache).insert(param.version(), full.clone(), bytes);
            self.memory.add(MemoryKind::Gathered, bytes);
            self.memory.sub(MemoryKind::Gathered, evicted);
        }
        full
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

    /// Registers a parameter in visit order.
    pub(crate) fn register_param(&self, info: ParamInfo, id: DistributedParamId) {
        let mut table = lock(&self.params);
        table.keys.insert(id, info.key);
        table.infos.push(info);
    }

    pub(crate) fn param_ids(&self) -> std::collections::HashSet<DistributedParamId> {
        lock(&self.params).keys.keys().copied().collect()
    }

    pub(crate) fn key_of(&self, id: &DistributedParamId) -> Option<usize> {
        lock(&self.params).keys.get(id).copied()
    }

    pub(crate) fn lock_grads(&self) -> MutexGuard<'_, GradSync<B>> {
        lock(&self.grads)
    }

    /// Whether parameter `key`'s reduced gradient is this rank's shard (reduce-scattered: stages
    /// 1–3) rather than the whole mean (all-reduced: stage 0, and replicated parameters at
    /// stage 3).
    pub fn gradient_is_sharded(&self, key: usize) -> bool {
        let persistent = lock(&self.params)
            .infos
            .get(key)
            .is_some_and(|i| i.persistent);
        match self.config.stage {
            0 => false,
            3 => !persistent,
            _ => true,
        }
    }

    /// Records `param` as the current shard of its parameter.
    pub(crate) fn track_param(&self, param: &Arc<ShardedParam<B>>) {
        if param.key() != usize::MAX {
            lock(&self.live).insert(param.key(), Arc::downgrade(param));
        }
    }

    /// Tells the group that an optimizer keeps parameter `key`'s values in an fp32 master copy
    /// on this rank, so that with `reuse_fp16_shard` its half-precision shard may be released
    /// once its gradient shard arrives.
    pub fn hold_master(&self, key: usize) {
        lock(&self.mastered).insert(key);
    }

    /// With `reuse_fp16_shard`: frees parameter `key`'s half-precision shard when a master
    /// copy holds its values, so the gradient shard takes its place in memory.
    pub(crate) fn reuse_shard_for_gradient(&self, key: usize) {
        if !self.config.reuse_fp16_shard || !lock(&self.mastered).contains(&key) {
            return;
        }
        let current = lock(&self.live).get(&key).and_then(Weak::upgrade);
        if let Some(param) = current
            && matches!(param.dtype(), DType::F16 | DType::BF16)
        {
            param.release();
        }
    }

    /// Gradient-reduction statistics of the last backward pass.
    pub fn last_reduction(&self) -> ReductionStats {
        *lock(&self.reduction)
    }

    /// The gradient bucket layout: the parameter keys of each bucket, in reduction order.
    pub fn bucket_layout(&self) -> Vec<Vec<usize>> {
        self.lock_grads()
            .buckets()
            .iter()
            .map(|b| b.members.iter().map(|m| m.key).collect())
            .collect()
    }

    /// Reduced gradient shards of parameters this rank did not use in the last backward pass
    /// (its autodiff gradients have no entry for them), by parameter key. Taken once.
    pub fn take_orphan_gradients(
        &self,
    ) -> std::collections::BTreeMap<usize, crate::tensor::ZeroTensor<B>> {
        self.lock_grads().take_orphans()
    }

    /// Creates a group for this rank without sharding a module (see [`Self::shard_tensor`]).
    pub fn create(ctx: &burn_zero_comm::RankContext<B>, config: ZeroConfig) -> Arc<Self> {
        let group = Arc::new(Self::new(ctx.comm().clone(), ctx.device().clone(), config));
        crate::hooks::register(&group);
        group
    }

    /// Shards a full tensor (identical on every rank) into this rank's block, as a tensor of
    /// `Zero<B>` whose ops gather it. Not marked for gradient hooks: use [`crate::shard`] for
    /// module parameters.
    pub fn shard_tensor<const D: usize>(
        self: &Arc<Self>,
        tensor: Tensor<B, D>,
    ) -> Tensor<crate::Zero<B>, D> {
        let shape = tensor.shape();
        let dtype = tensor.dtype();
        let key = usize::MAX;
        let flat = tensor.reshape([shape.num_elements()]);
        let block = self.own_block(flat).into_primitive().tensor();
        let param = ShardedParam::new(
            key,
            crate::sharded::ShardRole::Parameter,
            block,
            shape,
            dtype,
            self.clone(),
        );
        Tensor::from_primitive(TensorPrimitive::Float(crate::tensor::ZeroTensor::Sharded(
            crate::tensor::ShardedView::new(Arc::new(param)),
        )))
    }
}
