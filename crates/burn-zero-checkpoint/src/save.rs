//! `save`: every rank writes what it owns, then rank 0 commits the checkpoint by writing
//! `metadata.json`.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::SimpleOptimizer;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};
use burn_zero_core::store::BlockLayout;
use burn_zero_core::{Zero, ZeroState};
use burn_zero_optim::{ZeroOptimizer, ZeroOptimizerRecord};
use safetensors::Dtype;

use crate::dir::rotate;
use crate::error::CheckpointError;
use crate::format::{
    FORMAT, FORMAT_VERSION, METADATA_FILE, Metadata, OptimizerEntry, ParamEntry, Piece, RankIndex,
    TensorEntry, TensorKind, owned_range, rank_file_name, rank_index_name, step_dir_name,
    tensor_name, to_safetensors,
};
use crate::params::{
    RankParam, RankParams, agree, agree_on, collect, flat_bytes, slice_bytes, unbound,
};
use crate::read::element_size;
use crate::write::{PendingTensor, sync_dir, write_atomically, write_safetensors};
use burn_zero_optim::state_tree::{for_each_tensor, to_tree, tree_to_json};

/// How [`save`] writes and rotates.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveOptions {
    /// Complete checkpoints kept under the root (older ones are deleted once the new one is
    /// committed); 0 keeps all of them.
    pub keep_last: usize,
    /// Anything the caller wants back on load (data loader position, run name, …).
    pub extra: serde_json::Value,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            keep_last: 2,
            extra: serde_json::Value::Null,
        }
    }
}

/// Saves `model` and `optimizer` after training step `step` as `root/step-<step>` (a
/// collective: call it on every rank, on the training thread).
///
/// Every rank writes only what it owns — its piece of every parameter (shards as they are,
/// replicated parameters split so that each element is written once), of the fp32 masters, of
/// the optimizer's per-element state and of the gradient accumulators — into its own
/// safetensors file, keyed by module path, under a temporary name that is fsynced and renamed.
/// Rank 0 then writes `metadata.json` (the commit marker) and deletes checkpoints beyond
/// [`SaveOptions::keep_last`]. A save that fails or is killed leaves the previous checkpoints
/// as they were; every rank returns the error (its own, or [`CheckpointError::OtherRank`]).
///
/// Returns the checkpoint's directory.
pub fn save<AB, B, M, O, H>(
    root: &Path,
    step: u64,
    model: &M,
    optimizer: &ZeroOptimizer<B, O, H>,
    options: &SaveOptions,
) -> Result<PathBuf, CheckpointError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
    M: Module<AB>,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    let zero = optimizer.zero_state().ok_or_else(unbound)?.clone();
    save_record::<AB, B, M, O, H>(root, step, model, &zero, optimizer.record(), options)
}

/// [`save`] with the optimizer's state given as its record ([`ZeroOptimizer::record`]) and
/// the module's [`ZeroState`] given apart, for callers that hold the record but not the
/// optimizer (burn-train's `Learner` keeps its optimizer private and hands out records only).
pub fn save_record<AB, B, M, O, H>(
    root: &Path,
    step: u64,
    model: &M,
    zero: &ZeroState<B>,
    optimizer: ZeroOptimizerRecord<B, O, H>,
    options: &SaveOptions,
) -> Result<PathBuf, CheckpointError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
    M: Module<AB>,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    let params = collect::<AB, B, M>(model, zero)?;
    let zero = params.zero.clone();
    let dir = root.join(step_dir_name(step));
    // With hybrid sharding every shard group holds the same blocks: group 0 writes them, and
    // the other groups learn from every rank of the job whether the save succeeded.
    let (replica, replicas) = zero.replica();
    let written = if replica == 0 {
        save_shard_group(&dir, root, step, &params, optimizer, options)
    } else {
        Ok(())
    };
    if replicas > 1 {
        let world = &zero.groups().world;
        agree_on(world.as_ref(), zero.device(), written, "save")?;
    } else {
        written?;
    }
    tracing::info!(rank = zero.rank(), replica, step, dir = %dir.display(), "checkpoint saved");
    Ok(dir)
}

/// The save of one shard group's ranks: each writes its file, rank 0 commits the metadata.
fn save_shard_group<B, O, H>(
    dir: &Path,
    root: &Path,
    step: u64,
    params: &RankParams<B>,
    optimizer: ZeroOptimizerRecord<B, O, H>,
    options: &SaveOptions,
) -> Result<(), CheckpointError>
where
    B: Backend,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    let zero = &params.zero;
    let rank = zero.rank();
    let world = zero.world_size();

    let prepared = if rank == 0 {
        prepare_dir(root, dir)
    } else {
        Ok(())
    };
    agree(zero, prepared, "save")?;

    let written = write_rank::<B, O, H>(dir, params, optimizer);
    let (optimizer_entry, param_entries) = agree(zero, written, "save")?;

    let committed = if rank == 0 {
        let meta = Metadata {
            format: FORMAT.to_string(),
            version: FORMAT_VERSION,
            step,
            world_size: world,
            shard_group_size: world,
            stage: zero.config().stage,
            config: serde_json::to_value(zero.config()).unwrap_or_default(),
            files: Vec::new(),
            params: param_entries,
            tensors: BTreeMap::new(),
            optimizer: optimizer_entry,
            extra: options.extra.clone(),
        };
        commit(dir, meta).and_then(|()| rotate(root, options.keep_last))
    } else {
        Ok(())
    };
    agree(zero, committed, "save")
}

/// Makes an empty directory for the checkpoint (removing what an interrupted save of the same
/// step left there); refuses to overwrite a committed checkpoint.
fn prepare_dir(root: &Path, dir: &Path) -> Result<(), CheckpointError> {
    if dir.join(METADATA_FILE).exists() {
        return Err(CheckpointError::Exists(dir.to_path_buf()));
    }
    if dir.exists() {
        tracing::warn!(dir = %dir.display(), "removing an incomplete checkpoint of the same step");
        std::fs::remove_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
    }
    std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
    sync_dir(root)
}

/// Where a flat tensor of a parameter holds its values: the whole tensor, or this rank's
/// padded block.
#[derive(Clone, Copy)]
enum Layout {
    Whole,
    Block,
}

impl Layout {
    /// The layout of a flat tensor of `len` elements for a parameter of `numel`.
    fn of(len: usize, numel: usize, world: usize) -> Option<Self> {
        if len == numel {
            Some(Layout::Whole)
        } else if len == BlockLayout::new(numel, world).block_len() {
            Some(Layout::Block)
        } else {
            None
        }
    }

    /// Where this rank's owned elements `[start, end)` sit in a tensor of this layout.
    fn local(self, start: usize, end: usize) -> (usize, usize) {
        match self {
            Layout::Whole => (start, end),
            Layout::Block => (0, end - start),
        }
    }
}

/// A tensor this rank writes: the pending bytes and the metadata entry of its piece.
struct Planned<'a> {
    pending: PendingTensor<'a>,
    entry: TensorEntry,
}

#[allow(clippy::too_many_arguments)]
fn plan<'a>(
    kind: TensorKind,
    param: &str,
    field: Option<&str>,
    shape: Vec<usize>,
    dtype: Dtype,
    (start, end, padding): (usize, usize, usize),
    rank: usize,
    produce: Box<dyn Fn() -> Vec<u8> + 'a>,
) -> Planned<'a> {
    let name = tensor_name(kind, param, field);
    let length = end - start;
    Planned {
        pending: PendingTensor {
            name,
            dtype,
            shape: vec![length],
            byte_len: length * element_size(dtype),
            produce,
        },
        entry: TensorEntry {
            kind,
            param: param.to_string(),
            state_field: field.map(str::to_string),
            shape,
            dtype,
            pieces: vec![Piece {
                rank,
                offset: start,
                length,
                padding,
                data_offsets: (0, 0),
                page_crc32: Vec::new(),
            }],
        },
    }
}

fn stored_dtype(dtype: DType, what: &str) -> Result<Dtype, CheckpointError> {
    to_safetensors(dtype).ok_or_else(|| {
        CheckpointError::Unsupported(format!("{what} has dtype {dtype:?}, which is not a float"))
    })
}

fn state_dtype(name: &str) -> Option<Dtype> {
    match name {
        "F64" => Some(Dtype::F64),
        "F32" | "Flex32" => Some(Dtype::F32),
        "F16" => Some(Dtype::F16),
        "BF16" => Some(Dtype::BF16),
        _ => None,
    }
}

/// The optimizer's fp32 masters, each with the optimizer's state for it, by parameter key.
type Masters<O, H> = BTreeMap<usize, (Tensor<H, 1>, Option<<O as SimpleOptimizer<H>>::State<1>>)>;

/// Where the bytes of the optimizer-state tensors come from while the file is written: the
/// masters' state records, and the tree of the record being written. A record's fields are
/// written one after the other, so each record is turned into a tree once, not once per field.
struct StateSource<'a, O: SimpleOptimizer<H>, H: Backend> {
    masters: &'a Masters<O, H>,
    cache: &'a RefCell<Option<(usize, ciborium::Value)>>,
}

impl<O: SimpleOptimizer<H>, H: Backend> Clone for StateSource<'_, O, H> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O: SimpleOptimizer<H>, H: Backend> Copy for StateSource<'_, O, H> {}

impl<O: SimpleOptimizer<H>, H: Backend> StateSource<'_, O, H> {
    /// Bytes `[start, end)` of state field `field` of parameter `key` (none when the field
    /// holds fewer).
    fn field_bytes(self, key: usize, field: &str, (start, end): (usize, usize)) -> Vec<u8> {
        let mut cache = self.cache.borrow_mut();
        if cache.as_ref().is_none_or(|(k, _)| *k != key) {
            let state = self.masters[&key].1.clone().expect("state present");
            let tree = to_tree::<H, _>(state).unwrap_or(ciborium::Value::Null);
            *cache = Some((key, tree));
        }
        let tree = &mut cache.as_mut().expect("cached").1;
        let mut bytes = Vec::new();
        for_each_tensor(tree, &mut |mut leaf| {
            if leaf.field == field {
                bytes = leaf.take_bytes();
            }
        });
        bytes
            .get(start..end)
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    }
}

/// One parameter as the planner sees it: its key, module path and number of elements, and the
/// elements `[start, end)` this rank owns with the padding of its block.
#[derive(Clone, Copy)]
struct ParamPiece<'p> {
    key: usize,
    path: &'p str,
    numel: usize,
    owned: (usize, usize, usize),
}

/// Plans the tensors this rank writes, parameter by parameter, and collects the metadata that
/// goes with them. Nothing is read yet: each planned tensor produces its bytes when the file is
/// written, through borrows (of the masters and the state cache) that live for `'a`.
struct Planner<'a, O: SimpleOptimizer<H>, H: Backend> {
    rank: usize,
    world: usize,
    source: StateSource<'a, O, H>,
    accumulated: &'a BTreeMap<usize, Tensor<H, 1>>,
    /// The tensors to write, in file order.
    planned: Vec<Planned<'a>>,
    /// The model's parameters, for the metadata.
    params: Vec<ParamEntry>,
    /// Rank 0: each parameter's optimizer-state record with its per-element tensors taken out.
    states: BTreeMap<String, serde_json::Value>,
}

impl<'a, O: SimpleOptimizer<H> + 'a, H: Backend> Planner<'a, O, H> {
    /// Everything this rank writes of `param`: its piece of the values, and of the optimizer's
    /// master, state and gradient accumulator where the optimizer holds them.
    fn param<B: Backend>(&mut self, param: &RankParam<B>) -> Result<(), CheckpointError> {
        let info = &param.info;
        let piece = ParamPiece {
            key: info.key,
            path: info.path.as_str(),
            numel: param.numel(),
            owned: owned_range(param.numel(), self.rank, self.world),
        };
        self.values(param, piece)?;
        let (masters, accumulated) = (self.source.masters, self.accumulated);
        if let Some((values, state)) = masters.get(&piece.key) {
            self.master(piece, values, state.as_ref())?;
        }
        if let Some(sum) = accumulated.get(&piece.key) {
            self.accumulator(piece, sum)?;
        }
        Ok(())
    }

    /// The parameter's entry in the metadata and this rank's piece of its values (in the
    /// training dtype, with the parameter's shape).
    fn values<B: Backend>(
        &mut self,
        param: &RankParam<B>,
        piece: ParamPiece<'_>,
    ) -> Result<(), CheckpointError> {
        let info = &param.info;
        let path = piece.path;
        let dtype = stored_dtype(info.dtype, &format!("parameter `{path}`"))?;
        self.params.push(ParamEntry {
            path: path.to_string(),
            shape: info.shape.iter().copied().collect(),
            dtype,
            frozen: param.frozen,
            replicated: !param.is_sharded(),
        });
        let value = param.value.clone();
        let (start, end, _) = piece.owned;
        self.planned.push(plan(
            TensorKind::Parameter,
            path,
            None,
            info.shape.iter().copied().collect(),
            dtype,
            piece.owned,
            self.rank,
            Box::new(move || flat_bytes(&value, start, end)),
        ));
        Ok(())
    }

    /// Where this rank's owned elements sit in the optimizer's flat tensor (`what`) of `len`
    /// elements: the whole parameter, or this rank's block of it. Any other length is refused.
    fn local(
        &self,
        what: &str,
        piece: ParamPiece<'_>,
        len: usize,
    ) -> Result<(usize, usize), CheckpointError> {
        let (path, numel, world) = (piece.path, piece.numel, self.world);
        let layout = Layout::of(len, numel, world).ok_or_else(|| {
            CheckpointError::Unsupported(format!(
                "{what} of `{path}` has {len} elements, neither the parameter's {numel} nor a \
                 block of them over {world} ranks"
            ))
        })?;
        Ok(layout.local(piece.owned.0, piece.owned.1))
    }

    /// This rank's piece of the optimizer's fp32 master of the parameter, then of its state.
    fn master(
        &mut self,
        piece: ParamPiece<'_>,
        values: &Tensor<H, 1>,
        state: Option<&O::State<1>>,
    ) -> Result<(), CheckpointError> {
        let len = values.dims()[0];
        let (a, b) = self.local("the optimizer's master", piece, len)?;
        let values = values.clone();
        self.planned.push(plan(
            TensorKind::Master,
            piece.path,
            None,
            vec![piece.numel],
            stored_dtype(values.dtype(), "a master copy")?,
            piece.owned,
            self.rank,
            Box::new(move || slice_bytes(values.clone(), a, b)),
        ));
        if let Some(state) = state {
            self.state(piece, len, (a, b), state)?;
        }
        Ok(())
    }

    /// This rank's piece (`[a, b)` of the master's `len` elements) of each per-element tensor
    /// of the optimizer's `state` for the parameter: the tensors of the master's length. Rank 0
    /// keeps the rest of the record, the tensors taken out, for the metadata.
    fn state(
        &mut self,
        piece: ParamPiece<'_>,
        len: usize,
        (a, b): (usize, usize),
        state: &O::State<1>,
    ) -> Result<(), CheckpointError> {
        let path = piece.path;
        let fail = |reason: String| CheckpointError::OptimizerState {
            param: path.to_string(),
            reason,
        };
        let mut tree = to_tree::<H, _>(state.clone()).map_err(fail)?;
        let mut fields = Vec::new();
        for_each_tensor(&mut tree, &mut |mut leaf| {
            if leaf.shape == [len]
                && let Some(dtype) = state_dtype(&leaf.dtype)
            {
                leaf.take_bytes();
                fields.push((leaf.field.clone(), dtype));
            }
        });
        if self.rank == 0 {
            let json = tree_to_json(&tree).map_err(fail)?;
            self.states.insert(path.to_string(), json);
        }
        for (field, dtype) in fields {
            let size = element_size(dtype);
            let (source, key, wanted) = (self.source, piece.key, field.clone());
            self.planned.push(plan(
                TensorKind::OptimizerState,
                path,
                Some(&field),
                vec![piece.numel],
                dtype,
                piece.owned,
                self.rank,
                Box::new(move || source.field_bytes(key, &wanted, (a * size, b * size))),
            ));
        }
        Ok(())
    }

    /// This rank's piece of the parameter's fp32 gradient accumulator `sum`.
    fn accumulator(
        &mut self,
        piece: ParamPiece<'_>,
        sum: &Tensor<H, 1>,
    ) -> Result<(), CheckpointError> {
        let len = sum.dims()[0];
        let (a, b) = self.local("the gradient accumulator", piece, len)?;
        let sum = sum.clone();
        self.planned.push(plan(
            TensorKind::Accumulator,
            piece.path,
            None,
            vec![piece.numel],
            stored_dtype(sum.dtype(), "a gradient accumulator")?,
            piece.owned,
            self.rank,
            Box::new(move || slice_bytes(sum.clone(), a, b)),
        ));
        Ok(())
    }
}

/// Writes this rank's file and index; returns (on every rank) the optimizer's scalar state and
/// the parameter list for the metadata.
fn write_rank<B, O, H>(
    dir: &Path,
    params: &RankParams<B>,
    record: ZeroOptimizerRecord<B, O, H>,
) -> Result<(OptimizerEntry, Vec<ParamEntry>), CheckpointError>
where
    B: Backend,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    let zero: &ZeroState<B> = &params.zero;
    let (rank, world) = (zero.rank(), zero.world_size());
    let masters: Masters<O, H> = record
        .masters
        .into_iter()
        .map(|(key, values, state)| (key, (values, state)))
        .collect();
    let accumulated: BTreeMap<usize, Tensor<H, 1>> = record.accumulated.into_iter().collect();
    // The state tree currently being written (its tensors are written one after the other).
    let state_cache = RefCell::new(None);
    let mut planner: Planner<'_, O, H> = Planner {
        rank,
        world,
        source: StateSource {
            masters: &masters,
            cache: &state_cache,
        },
        accumulated: &accumulated,
        planned: Vec::new(),
        params: Vec::new(),
        states: BTreeMap::new(),
    };
    for param in &params.params {
        planner.param(param)?;
    }
    let Planner {
        planned,
        params: param_entries,
        states,
        ..
    } = planner;
    write_planned(dir, rank, world, planned)?;

    let optimizer_entry = OptimizerEntry {
        micro_steps: record.micro_steps,
        skipped: record.skipped,
        scaler: record.scaler,
        states,
    };
    Ok((optimizer_entry, param_entries))
}

/// Writes the planned tensors as this rank's safetensors file (pieces of no elements, small
/// tensors on high ranks, are not written), then the rank's index: each piece's entry with
/// where it landed in the file and its page checksums, for rank 0 to merge.
fn write_planned(
    dir: &Path,
    rank: usize,
    world: usize,
    mut planned: Vec<Planned<'_>>,
) -> Result<(), CheckpointError> {
    planned.retain(|p| p.pending.byte_len > 0);

    let (pending, entries): (Vec<_>, Vec<_>) =
        planned.into_iter().map(|p| (p.pending, p.entry)).unzip();
    let file_path = dir.join(rank_file_name(rank, world));
    let (file, written) = write_safetensors(&file_path, rank, &pending)?;
    drop(pending);
    let mut tensors = BTreeMap::new();
    for mut entry in entries {
        let name = tensor_name(entry.kind, &entry.param, entry.state_field.as_deref());
        let spot = written
            .get(&name)
            .ok_or_else(|| CheckpointError::Corrupted {
                file: file_path.clone(),
                tensor: name.clone(),
                reason: "was not written".into(),
            })?;
        entry.pieces[0].data_offsets = spot.data_offsets;
        entry.pieces[0].page_crc32 = spot.page_crc32.clone();
        tensors.insert(name, entry);
    }
    let index = RankIndex { file, tensors };
    let json = serde_json::to_vec(&index).map_err(|e| CheckpointError::Format {
        path: dir.join(rank_index_name(rank, world)),
        reason: e.to_string(),
    })?;
    write_atomically(&dir.join(rank_index_name(rank, world)), &json)
}

/// Rank 0: merges the ranks' indexes into `meta`, checks that every tensor is covered exactly
/// once, and writes `metadata.json`.
fn commit(dir: &Path, mut meta: Metadata) -> Result<(), CheckpointError> {
    for rank in 0..meta.world_size {
        let path = dir.join(rank_index_name(rank, meta.world_size));
        let bytes = std::fs::read(&path).map_err(|e| CheckpointError::io(&path, e))?;
        let index: RankIndex =
            serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Format {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        meta.files.push(index.file);
        for (name, entry) in index.tensors {
            match meta.tensors.get_mut(&name) {
                Some(merged) => {
                    if merged.shape != entry.shape || merged.dtype != entry.dtype {
                        return Err(CheckpointError::Format {
                            path,
                            reason: format!("tensor `{name}` differs between ranks"),
                        });
                    }
                    merged.pieces.extend(entry.pieces);
                }
                None => {
                    meta.tensors.insert(name, entry);
                }
            }
        }
    }
    for (name, entry) in &mut meta.tensors {
        entry.pieces.sort_by_key(|p| p.offset);
        let mut next = 0;
        for piece in &entry.pieces {
            if piece.offset != next {
                return Err(CheckpointError::Format {
                    path: dir.to_path_buf(),
                    reason: format!(
                        "tensor `{name}`: no rank wrote elements {next}..{}",
                        piece.offset
                    ),
                });
            }
            next += piece.length;
        }
        if next != entry.numel() {
            return Err(CheckpointError::Format {
                path: dir.to_path_buf(),
                reason: format!(
                    "tensor `{name}`: {next} of {} elements written",
                    entry.numel()
                ),
            });
        }
    }
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| CheckpointError::Format {
        path: dir.join(METADATA_FILE),
        reason: e.to_string(),
    })?;
    write_atomically(&dir.join(METADATA_FILE), &json)
}
