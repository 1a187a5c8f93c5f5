//! `shard` and `unshard`: turn a module's parameters into sharded tensors and back.

use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use burn_zero_comm::{
    CommError, Communicator, OrderedComm, RankContext, RankOrderReduction, agree,
};
use burn_zero_kernels::host::HostBackend;

use crate::backend::Zero;
use crate::chunk::{ChunkLayout, ChunkParam, SearchLimits};
use crate::config::ZeroConfig;
use crate::error::ZeroError;
use crate::memory::MemoryKind;
use crate::reduce::GradientReducer;
use crate::reduce::bucket::{self, Mode};
use crate::reduce::thread::CommThread;
use crate::state::ZeroState;
use crate::store::auto_placement;
use crate::store::table::ParamTable;
use crate::store::{Groups, ParamInfo, ParamStore, ShardedParam};
use crate::tensor::{ShardedView, ZeroTensor};

/// Dimensions a parameter may have for the cross-rank shape check.
const MAX_DIMS: usize = 12;
/// Length of one parameter's description: ndims, dtype, trainable, then each dim as two
/// 16-bit halves ([`agree::halves`]).
const DESC_LEN: usize = 3 + 2 * MAX_DIMS;

/// Shards every float parameter of `module` across the ranks of `ctx`'s communicator (or,
/// with [`ZeroConfig::shard_group_size`], across each group of that many ranks, replicated
/// across the groups).
///
/// Each parameter is visited in module order (its key), checked to have the same shape and
/// dtype on every rank, and copied from rank 0 when `config.sync_module_states`. At stage 3 it
/// is replaced by a sharded tensor holding this rank's padded 1/N block — or kept whole when it
/// has fewer than `config.persist_below_numel` elements; below stage 3 it stays whole. The
/// gradient bucket layout is fixed here, from the trainable parameters in reverse visit
/// order. Trainable parameters are marked for autodiff's gradient hooks, so `backward` leaves
/// each rank with its shard of the mean gradient. Lazily initialised parameters are
/// materialised one at a time; where parameters may be offloaded (`offload_param_frac` above
/// 0, or the auto placement) each shard goes to host memory as it is cut, so a module built
/// from lazy parameters is sharded with one parameter at a time on the device, however large
/// it is (those whose chunks stay on the device are uploaded once the layout is fixed).
///
/// A parameter that does not require a gradient (`Module::no_grad`, `set_require_grad(false)`)
/// is frozen: it is sharded and gathered like the others, but it has no place in the gradient
/// buckets, is never reduced, and `ZeroOptimizer` keeps no master copy or state of it. Freeze
/// or unfreeze parameters before sharding: the ranks agree on which are frozen here, and the
/// bucket layout is fixed from it.
///
/// Returns the sharded module and the handle on this rank's state of it, which
/// `ZeroOptimizer` is built from and which reports memory and reduction statistics.
///
/// Call it on every rank, on the thread that runs backward (autodiff's gradient hooks find
/// the module's reducer there). Fails on every rank, before any training step, when the
/// ranks' modules differ.
pub fn shard<AB, B, M>(
    module: M,
    ctx: &RankContext<B>,
    config: &ZeroConfig,
) -> Result<(M, ZeroState<B>), ZeroError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
    M: Module<AB>,
{
    config.validate().map_err(ZeroError::InvalidConfig)?;
    let config = &auto_placement::with_capacity::<B>(config, ctx.device())?;
    let shard_size = config
        .shard_group_size_for(ctx.world_size())
        .map_err(ZeroError::InvalidConfig)?;
    // Every collective of the rank goes through the context's one issuing thread, in the
    // order the training thread fixes, whatever thread submits it: the gradient communication
    // thread and prefetches of this module and of every other module sharded with `ctx` (NCCL
    // deadlocks when ranks interleave two threads' collectives differently). The shard and
    // replica groups of hybrid sharding are split from it and keep that one order.
    let world = world_group(ctx, config)?;
    let (groups, ordered) = Groups::split_ordered(&world, shard_size)?;
    let ordered = Some(ordered).filter(|_| config.overlaps_reduction() || config.prefetches());
    let prefetch_on = ordered.as_ref().map(|ordered| ordered.shard.clone());
    let store = Arc::new(ParamStore::new(
        groups,
        prefetch_on,
        ctx.device().clone(),
        config.clone(),
        ctx.ordered().counters().clone(),
    ));
    let mut sharder = Sharder {
        store: store.clone(),
        table: ParamTable::default(),
        next_key: 0,
        path: Vec::new(),
        error: None,
    };
    let module = module.map(&mut sharder);
    if sharder.error.is_none() {
        // Every rank ends with the same sentinel; a rank with more parameters meets it early.
        sharder.agree(None, "");
    }
    if let Some(error) = sharder.error {
        return Err(error);
    }
    let params_sharded = sharder.next_key;
    store.set_table(sharder.table);
    let chunks = chunk_layout(&store, config)?;
    let buckets = if chunks.is_per_parameter() {
        per_parameter_buckets(&store, config)
    } else {
        let params = store.params();
        bucket::from_chunks(
            &chunks,
            |key| params[key].shape.clone(),
            config.reduce_dtype,
        )
    };
    let buckets = bucket::replicated_last(buckets);
    store.set_chunks(chunks);
    // A rank alone reduces each bucket in the hook that completes it: its collectives are
    // answered in place, so a thread would only cost a device synchronisation per bucket.
    let alone = ctx.world_size() == 1;
    let eager = alone && config.overlaps_reduction();
    let thread = if let Some(ordered) = ordered.filter(|_| config.overlaps_reduction() && !alone) {
        let thread = CommThread::spawn(
            ordered,
            buckets.clone(),
            store.device().clone(),
            config.gradient_predivide_factor,
            store.memory_handle(),
            store.counters().clone(),
            store.host_gradients(),
        )
        .map_err(|error| {
            ZeroError::Comm(CommError::InvalidGroup(format!(
                "could not start the gradient communication thread: {error}"
            )))
        })?;
        Some(thread)
    } else {
        None
    };
    let state = ZeroState::register(GradientReducer::new(store, buckets, thread, eager));
    tracing::debug!(
        rank = state.rank(),
        params = params_sharded,
        "module sharded"
    );
    Ok((module, state))
}

/// The rank's ordered group, its reductions in rank order where `config` asks for them
/// (checked: the engine must have an all-to-all, which every rank asks it here, alike).
fn world_group<B: Backend>(
    ctx: &RankContext<B>,
    config: &ZeroConfig,
) -> Result<OrderedComm<B>, ZeroError> {
    if !config.reduce_in_rank_order {
        return Ok(ctx.ordered().clone());
    }
    let world = ctx
        .ordered()
        .with_engine(|engine| Arc::new(RankOrderReduction::new(engine)));
    let empty = Tensor::<B, 1>::from_data(TensorData::new(Vec::<f32>::new(), [0]), ctx.device());
    world.all_to_all(empty).map_err(|error| {
        ZeroError::InvalidConfig(format!(
            "reduce_in_rank_order needs a communication engine with an all-to-all: {error}"
        ))
    })?;
    Ok(world)
}

/// The chunk layout of the store's parameters under `config`, the same on every rank (checked:
/// a rank whose configuration packs differently would pair other tensors in its collectives).
fn chunk_layout<B: Backend>(
    store: &ParamStore<B>,
    config: &ZeroConfig,
) -> Result<ChunkLayout, ZeroError> {
    let ranks = store.world_size();
    let chunk_size = config.chunk_size.resolve(HostBackend::of::<B>().is_some());
    chunk_size
        .validate(ranks)
        .map_err(ZeroError::InvalidConfig)?;
    let params: Vec<ChunkParam> = store
        .params()
        .iter()
        .map(|info| ChunkParam {
            key: info.key,
            numel: info.shape.num_elements(),
            dtype: info.dtype,
            trainable: info.trainable,
            sharded: store.gradient_is_sharded(info.key),
        })
        .collect();
    let limits = SearchLimits {
        ranks,
        gather_budget_bytes: config.max_live_gathered_bytes,
        prefetch: if config.prefetches() {
            config.prefetch
        } else {
            0
        },
    };
    let layout = chunk_size.layout(&params, &limits);
    let digest = layout.digest();
    let mine = [
        digest >> 48,
        (digest >> 32) & 0xFFFF,
        (digest >> 16) & 0xFFFF,
        digest & 0xFFFF,
    ]
    .map(|part| part as f32);
    let all = agree::exchange(store.groups().world.as_ref(), store.device(), &mine)?;
    if let Some(other) = all.iter().position(|theirs| theirs.as_slice() != mine) {
        return Err(ZeroError::InvalidConfig(format!(
            "rank {} and rank {other} pack the parameters into different chunks ({} chunks \
             here): ZeroConfig::chunk_size must be the same on every rank",
            store.groups().world.rank(),
            layout.chunks().len()
        )));
    }
    Ok(layout)
}

/// One gradient bucket per `bucket_size_mb` of trainable parameters, in reduction order (the
/// reverse of the visit order, as backward produces gradients): the layout without chunks.
fn per_parameter_buckets<B: Backend>(
    store: &ParamStore<B>,
    config: &ZeroConfig,
) -> Vec<bucket::Bucket> {
    let params = store.params();
    bucket::layout(
        // Frozen parameters have no gradient to reduce.
        &params
            .iter()
            .rev()
            .filter(|info| info.trainable)
            .cloned()
            .collect::<Vec<_>>(),
        |info| {
            if store.gradient_is_sharded(info.key) {
                Mode::ReduceScatter
            } else {
                Mode::AllReduce
            }
        },
        store.world_size(),
        config.bucket_size_mb * (1u64 << 20) as f64,
        config.reduce_dtype,
    )
}

/// Gathers every sharded parameter of `module` back into an ordinary tensor (a collective:
/// call it on every rank).
pub fn unshard<AB, B, M>(module: M) -> M
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
    M: Module<AB>,
{
    module.map(&mut Unsharder)
}

struct Sharder<B: Backend> {
    store: Arc<ParamStore<B>>,
    /// The parameters visited so far.
    table: ParamTable,
    next_key: usize,
    path: Vec<String>,
    error: Option<ZeroError>,
}

fn dtype_code(dtype: DType) -> f32 {
    match dtype {
        DType::F64 => 1.0,
        DType::F32 => 2.0,
        DType::Flex32 => 3.0,
        DType::F16 => 4.0,
        DType::BF16 => 5.0,
        _ => 6.0,
    }
}

impl<B: Backend> Sharder<B> {
    /// Checks that every rank has the same parameter here, as trainable or frozen on all
    /// (`None`: no more parameters). Records a [`ZeroError::ModuleMismatch`] naming the
    /// difference when not.
    fn agree(&mut self, param: Option<(&Shape, DType, bool)>, path: &str) -> bool {
        let mut desc = vec![0f32; DESC_LEN];
        match param {
            Some((shape, dtype, trainable)) => {
                if shape.num_dims() > MAX_DIMS {
                    self.error = Some(ZeroError::InvalidConfig(format!(
                        "parameter `{path}` has {} dimensions; at most {MAX_DIMS} are supported",
                        shape.num_dims()
                    )));
                    return false;
                }
                desc[0] = shape.num_dims() as f32;
                desc[1] = dtype_code(dtype);
                desc[2] = if trainable { 1.0 } else { 0.0 };
                for (i, &d) in shape.iter().enumerate() {
                    match agree::halves(d) {
                        Ok(halves) => desc[3 + 2 * i..5 + 2 * i].copy_from_slice(&halves),
                        Err(error) => {
                            self.error = Some(error.into());
                            return false;
                        }
                    }
                }
            }
            None => desc[0] = -1.0,
        }
        let device = self.store.device().clone();
        // Every rank of the job agrees, across shard groups too.
        let all = match agree::exchange(self.store.groups().world.as_ref(), &device, &desc) {
            Ok(all) => all,
            Err(e) => {
                self.error = Some(e.into());
                return false;
            }
        };
        let ranks: Vec<&[f32]> = all.iter().map(Vec::as_slice).collect();
        let rank = self.store.groups().world.rank();
        let read = |d: &[f32]| -> Option<String> {
            (d[0] >= 0.0).then(|| {
                let dims: Vec<usize> = (0..d[0] as usize)
                    .map(|i| agree::from_halves(&d[3 + 2 * i..]))
                    .collect();
                let dtype = match d[1] as u32 {
                    1 => "f64",
                    2 => "f32",
                    3 => "flex32",
                    4 => "f16",
                    5 => "bf16",
                    _ => "other",
                };
                let role = if d[2] > 0.0 { "trainable" } else { "frozen" };
                format!("{dims:?} {dtype} ({role})")
            })
        };
        if let Some((other, _)) = ranks.iter().enumerate().find(|(_, d)| **d != ranks[rank]) {
            let key = self.next_key;
            let here = read(ranks[rank]).map_or("no more parameters".to_string(), |s| {
                format!("parameter #{key} `{path}` of shape {s}")
            });
            let there = read(ranks[other]).map_or("no more parameters".to_string(), |s| {
                format!("parameter #{key} of shape {s}")
            });
            self.error = Some(ZeroError::ModuleMismatch(format!(
                "rank {rank} has {here}, rank {other} has {there}"
            )));
            return false;
        }
        true
    }

    fn shard_param<const D: usize>(
        &mut self,
        tensor: Tensor<Zero<B>, D>,
        path: &str,
        trainable: bool,
    ) -> Result<Option<(ZeroTensor<B>, ParamInfo)>, ZeroError> {
        let local = match tensor.into_primitive() {
            TensorPrimitive::Float(ZeroTensor::Local(local)) => local,
            TensorPrimitive::Float(ZeroTensor::Sharded(_)) => {
                return Err(ZeroError::AlreadySharded(path.to_string()));
            }
            TensorPrimitive::QFloat(_) => {
                return Err(ZeroError::InvalidConfig(format!(
                    "parameter `{path}` is quantized; only float parameters can be sharded"
                )));
            }
        };
        let shape = local.shape();
        let dtype = local.dtype();
        if !self.agree(Some((&shape, dtype, trainable)), path) {
            return Ok(None);
        }
        let key = self.next_key;
        let numel = shape.num_elements();
        let config = self.store.config();
        let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
            local,
            Shape::new([numel]),
        )));
        let world = &self.store.groups().world;
        let flat = if config.sync_module_states && world.world_size() > 1 {
            world.broadcast(flat, 0)?
        } else {
            flat
        };
        // Below stage 3 every parameter stays whole on every rank.
        let persistent = config.stage < 3 || numel < config.persist_below_numel;
        let info = ParamInfo {
            key,
            path: path.to_string(),
            shape: shape.clone(),
            dtype,
            persistent,
            trainable,
        };
        let tensor = if persistent {
            self.store
                .memory()
                .add(MemoryKind::PersistentParameters, numel * dtype.size());
            ZeroTensor::Local(B::float_reshape(flat.into_primitive().tensor(), shape))
        } else {
            let param = if self.store.stages_shards_on_host() {
                let data = self.store.own_block_data(flat);
                ShardedParam::parameter_on_host(&self.store, key, data, shape, dtype)
            } else {
                let block = self.store.own_block(flat).into_primitive().tensor();
                ShardedParam::parameter(&self.store, key, block, shape, dtype)
            };
            ZeroTensor::Sharded(ShardedView::new(Arc::new(param)))
        };
        Ok(Some((tensor, info)))
    }
}

impl<AB, B> ModuleMapper<AB> for Sharder<B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        if self.error.is_some() {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let path = self.path.join(".");
        let require_grad = tensor.is_require_grad();
        match self.shard_param(tensor.clone().inner(), &path, require_grad) {
            Ok(Some((sharded, info))) => {
                let dist_id = DistributedParamId::from(id.val());
                self.table.push(info, dist_id);
                self.next_key += 1;
                let inner = Tensor::<Zero<B>, D>::from_primitive(TensorPrimitive::Float(sharded));
                let tensor = Tensor::<AB, D>::from_inner(inner).set_require_grad(require_grad);
                // Only trainable parameters call the gradient hooks: a frozen one has no bucket.
                let tensor = if require_grad {
                    tensor.set_distributed(dist_id)
                } else {
                    tensor
                };
                Param::from_mapped_value(id, tensor, mapper)
            }
            Ok(None) => Param::from_mapped_value(id, tensor, mapper),
            Err(error) => {
                self.error = Some(error);
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
    }
}

struct Unsharder;

impl<AB, B> ModuleMapper<AB> for Unsharder
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let primitive = tensor.inner().into_primitive().tensor();
        let local = ZeroTensor::Local(primitive.materialize());
        let inner = Tensor::<Zero<B>, D>::from_primitive(TensorPrimitive::Float(local));
        let tensor = Tensor::<AB, D>::from_inner(inner).set_require_grad(require_grad);
        Param::from_mapped_value(id, tensor, mapper)
    }
}
