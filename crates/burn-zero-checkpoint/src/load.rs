//! `load`: each rank of a group of any size, at any stage, reads the parts of a checkpoint it
//! now owns.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::SimpleOptimizer;
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_zero_core::store::BlockLayout;
use burn_zero_core::{ShardedView, Zero, ZeroState, ZeroTensor};
use burn_zero_optim::{MasterEntry, ZeroOptimizer, ZeroOptimizerRecord};

use crate::dir::{read_metadata, resolve};
use crate::error::CheckpointError;
use crate::format::{Metadata, TensorKind, tensor_name, to_burn};
use crate::params::{NewValues, RankParams, agree, collect, tensor_from_bytes, unbound};
use crate::read::RankFiles;
use burn_zero_optim::state_tree::{for_each_tensor, from_tree, tree_from_json};

/// What [`load`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The checkpoint directory it read.
    pub dir: PathBuf,
    /// The step it was saved after.
    pub step: u64,
    /// The world size that saved it.
    pub saved_world_size: usize,
    /// What the caller attached when saving.
    pub extra: serde_json::Value,
    /// Bytes this rank read from the rank files.
    pub bytes_read: u64,
}

/// What [`load`] returns: the model and optimizer holding the checkpoint's state, and what it
/// found.
pub type Resumed<M, B, O, H> = (M, ZeroOptimizer<B, O, H>, Loaded);

/// What [`load_record`] returns: the model holding the checkpoint's parameters, the optimizer's
/// state as a record, and what it found.
pub type ResumedRecord<M, B, O, H> = (M, ZeroOptimizerRecord<B, O, H>, Loaded);

/// Loads a checkpoint into `model` (sharded with `shard`, at any world size and stage) and
/// `optimizer` (built with the same settings as when saving). A collective: call it on every
/// rank, on the training thread.
///
/// `path` is a checkpoint directory, or a root under which the latest complete checkpoint is
/// taken. Each rank reads only the byte ranges of the pieces that overlap what it owns now
/// (verifying their checksums), through one read buffer of at most 64 MiB. A model whose
/// parameters differ from the saved ones (missing, extra, reshaped) is refused by name; a
/// parameter saved in another float dtype is converted.
pub fn load<AB, B, M, O, H>(
    path: &Path,
    model: M,
    optimizer: ZeroOptimizer<B, O, H>,
) -> Result<Resumed<M, B, O, H>, CheckpointError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
    M: Module<AB>,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    let zero = optimizer.zero_state().ok_or_else(unbound)?.clone();
    let (model, record, loaded) = load_record::<AB, B, M, O, H>(path, model, &zero)?;
    Ok((model, optimizer.restore(record), loaded))
}

/// [`load`] that returns the optimizer's state as a record, bound to `zero` (the module's
/// [`ZeroState`]), to be restored into an optimizer built with the same settings as when
/// saving (`ZeroOptimizer::restore`, or burn-train's `Learner::load_optim`, which only takes
/// records).
pub fn load_record<AB, B, M, O, H>(
    path: &Path,
    model: M,
    zero: &ZeroState<B>,
) -> Result<ResumedRecord<M, B, O, H>, CheckpointError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
    M: Module<AB>,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    let params = collect::<AB, B, M>(&model, zero)?;
    let zero = params.zero.clone();
    let read = resolve(path)
        .and_then(|dir| read_metadata(&dir).map(|meta| (dir, meta)))
        .and_then(|(dir, meta)| {
            check_model(&meta, &params)?;
            let mut files = RankFiles::new(&dir, &meta);
            let values = read_values(&meta, &params, &mut files)?;
            let record = read_optimizer::<B, O, H>(&meta, &params, &mut files)?;
            let loaded = Loaded {
                dir: dir.clone(),
                step: meta.step,
                saved_world_size: meta.world_size,
                extra: meta.extra.clone(),
                bytes_read: files.bytes_read,
            };
            Ok((values, record, loaded))
        });
    let (mut values, record, loaded) = agree(&zero, read, "load")?;
    let model = model.map(&mut Replace {
        values: &mut values,
    });
    tracing::info!(
        rank = zero.rank(),
        step = loaded.step,
        saved_world_size = loaded.saved_world_size,
        "checkpoint loaded"
    );
    Ok((model, record.bound_to(&zero), loaded))
}

/// Names every difference between the saved parameters and the model's.
fn check_model<B: Backend>(meta: &Metadata, params: &RankParams<B>) -> Result<(), CheckpointError> {
    let saved: BTreeMap<&str, &Vec<usize>> = meta
        .params
        .iter()
        .map(|p| (p.path.as_str(), &p.shape))
        .collect();
    let model: BTreeMap<&str, Vec<usize>> = params
        .params
        .iter()
        .map(|p| (p.info.path.as_str(), p.info.shape.iter().copied().collect()))
        .collect();
    let missing: Vec<&str> = model
        .keys()
        .filter(|k| !saved.contains_key(*k))
        .copied()
        .collect();
    let extra: Vec<&str> = saved
        .keys()
        .filter(|k| !model.contains_key(*k))
        .copied()
        .collect();
    let reshaped: Vec<String> = model
        .iter()
        .filter_map(|(path, shape)| {
            let was = saved.get(path)?;
            (*was != shape).then(|| format!("`{path}` is {shape:?} in the model, {was:?} saved"))
        })
        .collect();
    let mut problems = Vec::new();
    let quoted = |paths: &[&str]| {
        paths
            .iter()
            .map(|p| format!("`{p}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !missing.is_empty() {
        problems.push(format!("not in the checkpoint: {}", quoted(&missing)));
    }
    if !extra.is_empty() {
        problems.push(format!(
            "in the checkpoint but not in the model: {}",
            quoted(&extra)
        ));
    }
    if !reshaped.is_empty() {
        problems.push(format!("reshaped: {}", reshaped.join(", ")));
    }
    let unique: BTreeSet<&str> = params.params.iter().map(|p| p.info.path.as_str()).collect();
    if unique.len() != params.params.len() {
        problems.push("the model has several parameters with one module path".into());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CheckpointError::ModelMismatch(problems.join("; ")))
    }
}

/// Elements `[start, end)` of the saved tensor `name` as bytes of its stored dtype, padded with
/// zeros to `len` elements; `None` when the checkpoint has no such tensor.
fn read_padded(
    meta: &Metadata,
    files: &mut RankFiles<'_>,
    name: &str,
    (start, end): (usize, usize),
    len: usize,
) -> Result<Option<(Vec<u8>, DType)>, CheckpointError> {
    let Some(entry) = meta.tensors.get(name) else {
        return Ok(None);
    };
    let stored = to_burn(entry.dtype).ok_or_else(|| CheckpointError::Format {
        path: PathBuf::from(name),
        reason: format!("tensor `{name}` has dtype {:?}, not a float", entry.dtype),
    })?;
    let mut bytes = Vec::with_capacity(len * stored.size());
    files.read(name, entry, start, end, &mut bytes)?;
    bytes.resize(len * stored.size(), 0);
    Ok(Some((bytes, stored)))
}

/// Like [`read_padded`], as a flat tensor of `dtype` (default: as stored) on `device`.
fn read_flat<H: Backend>(
    meta: &Metadata,
    files: &mut RankFiles<'_>,
    name: &str,
    range: (usize, usize),
    len: usize,
    dtype: Option<DType>,
    device: &H::Device,
) -> Result<Option<Tensor<H, 1>>, CheckpointError> {
    Ok(
        read_padded(meta, files, name, range, len)?.map(|(bytes, stored)| {
            tensor_from_bytes::<H>(bytes, stored, dtype.unwrap_or(stored), device)
        }),
    )
}

/// The elements `[start, end)` of a `numel`-element tensor that `rank` of `world` reads, and
/// the length of the flat tensor it builds from them: its padded block when the tensor is
/// `sharded`, else the whole tensor.
fn wanted(numel: usize, rank: usize, world: usize, sharded: bool) -> ((usize, usize), usize) {
    if sharded {
        let blocks = BlockLayout::new(numel, world);
        let owned = blocks.owned(rank);
        ((owned.start, owned.end), blocks.block_len())
    } else {
        ((0, numel), numel)
    }
}

/// This rank's new value of every parameter.
fn read_values<B: Backend>(
    meta: &Metadata,
    params: &RankParams<B>,
    files: &mut RankFiles<'_>,
) -> Result<NewValues<B>, CheckpointError> {
    let zero = &params.zero;
    let (rank, world) = (zero.rank(), zero.world_size());
    let mut values = HashMap::new();
    for param in &params.params {
        let path = &param.info.path;
        let numel = param.numel();
        let name = tensor_name(TensorKind::Parameter, path, None);
        let (range, len) = wanted(numel, rank, world, param.is_sharded());
        let flat = read_flat::<B>(
            meta,
            files,
            &name,
            range,
            len,
            Some(param.info.dtype),
            zero.device(),
        )?
        .ok_or_else(|| {
            CheckpointError::ModelMismatch(format!("the checkpoint has no values for `{path}`"))
        })?;
        let primitive = flat.into_primitive().tensor();
        let value = match &param.value {
            ZeroTensor::Sharded(view) => {
                let shard = view.param().with_shard(primitive);
                ZeroTensor::Sharded(ShardedView::new(Arc::new(shard)))
            }
            ZeroTensor::Local(_) => {
                ZeroTensor::Local(B::float_reshape(primitive, param.info.shape.clone()))
            }
        };
        values.insert(param.id, value);
    }
    Ok(values)
}

/// This rank's part of the optimizer's masters, state and accumulators, cut again for its
/// group.
fn read_optimizer<B, O, H>(
    meta: &Metadata,
    params: &RankParams<B>,
    files: &mut RankFiles<'_>,
) -> Result<ZeroOptimizerRecord<B, O, H>, CheckpointError>
where
    B: Backend,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    let zero = &params.zero;
    let (rank, world) = (zero.rank(), zero.world_size());
    let host = H::Device::default();
    let mut masters: Vec<MasterEntry<O, H>> = Vec::new();
    let mut accumulated = Vec::new();
    for param in &params.params {
        // A parameter frozen in this module has no optimizer state, whatever the checkpoint
        // holds for it (a fine-tuning run that starts from a fully trained checkpoint).
        if !param.info.trainable {
            continue;
        }
        let path = &param.info.path;
        let key = param.info.key;
        let numel = param.numel();
        // The optimizer steps this rank's block when gradients are reduce-scattered, the
        // whole parameter when they are all-reduced.
        let (range, len) = wanted(numel, rank, world, zero.gradient_is_sharded(key));
        let master_name = tensor_name(TensorKind::Master, path, None);
        if let Some(values) = read_flat::<H>(meta, files, &master_name, range, len, None, &host)? {
            let state = match meta.optimizer.states.get(path.as_str()) {
                Some(skeleton) => {
                    let fail = |reason: String| CheckpointError::OptimizerState {
                        param: path.clone(),
                        reason,
                    };
                    let mut tree = tree_from_json(skeleton).map_err(fail)?;
                    let mut error = None;
                    for_each_tensor(&mut tree, &mut |mut leaf| {
                        let name = tensor_name(TensorKind::OptimizerState, path, Some(&leaf.field));
                        if error.is_some() || !meta.tensors.contains_key(&name) {
                            return;
                        }
                        match read_padded(meta, files, &name, range, len) {
                            Ok(Some((bytes, _))) => leaf.put(bytes, len),
                            Ok(None) => {}
                            Err(e) => error = Some(e),
                        }
                    });
                    if let Some(error) = error {
                        return Err(error);
                    }
                    Some(
                        from_tree::<H, <O as SimpleOptimizer<H>>::State<1>>(tree, &host)
                            .map_err(fail)?,
                    )
                }
                None => None,
            };
            masters.push((key, values, state));
        }
        let accum_name = tensor_name(TensorKind::Accumulator, path, None);
        if let Some(sum) = read_flat::<H>(meta, files, &accum_name, range, len, None, &host)? {
            accumulated.push((key, sum));
        }
    }
    Ok(ZeroOptimizerRecord::new(
        Some((rank, world)),
        masters,
        accumulated,
        meta.optimizer.micro_steps,
        meta.optimizer.scaler,
        meta.optimizer.skipped,
    ))
}

/// Puts the loaded values into the module, trainable ones marked for the gradient hooks as
/// `shard` left them.
struct Replace<'a, B: Backend> {
    values: &'a mut NewValues<B>,
}

impl<AB, B> ModuleMapper<AB> for Replace<'_, B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let Some(value) = self.values.remove(&param.id) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let inner = Tensor::<Zero<B>, D>::from_primitive(TensorPrimitive::Float(value));
        let tensor = Tensor::<AB, D>::from_inner(inner).set_require_grad(require_grad);
        // Frozen parameters carry no mark: they have no bucket.
        let tensor = if require_grad {
            tensor.set_distributed(DistributedParamId::from(id.val()))
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}
