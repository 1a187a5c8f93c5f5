//! Consolidation without a model type and with bounded memory: a sharded checkpoint becomes one
//! safetensors file of whole parameters keyed by module path, which plain Burn loads through
//! burn-store; or a world-size-1 checkpoint of burn-zero's own format, optimizer state included.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use safetensors::Dtype;

use crate::dir::{read_metadata, resolve};
use crate::error::CheckpointError;
use crate::format::{
    FileEntry, METADATA_FILE, Metadata, Piece, RankIndex, TensorKind, rank_file_name, tensor_name,
    to_burn,
};
use crate::read::{RankFiles, element_size};
use crate::write::{PendingTensor, write_atomically, write_safetensors};

/// The element type of a consolidated file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputDtype {
    /// fp32: from the optimizer's fp32 masters where the checkpoint has them (exact for
    /// half-precision training), from the parameters otherwise.
    #[default]
    F32,
    /// Each parameter's training dtype, as saved.
    Training,
}

/// What a consolidation wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Consolidated {
    /// The checkpoint it read.
    pub checkpoint: PathBuf,
    /// The file or directory it wrote.
    pub output: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes written.
    pub bytes: u64,
}

/// Assembles one tensor at a time: the consolidation holds at most one whole tensor (plus its
/// conversion) and one read buffer.
struct Assembler<'m> {
    meta: &'m Metadata,
    files: RefCell<RankFiles<'m>>,
    error: RefCell<Option<CheckpointError>>,
}

impl<'m> Assembler<'m> {
    fn new(dir: &Path, meta: &'m Metadata) -> Self {
        Self {
            meta,
            files: RefCell::new(RankFiles::new(dir, meta)),
            error: RefCell::new(None),
        }
    }

    /// Every element of the saved tensor `name`, converted to `dtype`; zeros of the right
    /// length after an error (which is kept and reported once the writer is done).
    fn whole(&self, name: &str, dtype: Dtype) -> Vec<u8> {
        let entry = &self.meta.tensors[name];
        let numel = entry.numel();
        let mut bytes = Vec::with_capacity(numel * element_size(entry.dtype));
        let read = self
            .files
            .borrow_mut()
            .read(name, entry, 0, numel, &mut bytes);
        if let Err(error) = read {
            self.error.borrow_mut().get_or_insert(error);
            return vec![0; numel * element_size(dtype)];
        }
        if entry.dtype == dtype {
            return bytes;
        }
        match (to_burn(entry.dtype), to_burn(dtype)) {
            (Some(from), Some(to)) => TensorData::from_bytes_vec(bytes, [numel], from)
                .convert_dtype(to)
                .as_bytes()
                .to_vec(),
            _ => {
                self.error
                    .borrow_mut()
                    .get_or_insert(CheckpointError::Unsupported(format!(
                        "cannot convert `{name}` from {:?} to {dtype:?}",
                        entry.dtype
                    )));
                vec![0; numel * element_size(dtype)]
            }
        }
    }

    fn finish(&self) -> Result<(), CheckpointError> {
        match self.error.borrow_mut().take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// Writes the model of the checkpoint at `checkpoint` (a checkpoint directory, or a root whose
/// latest complete checkpoint is taken) as one safetensors file `out`: every parameter whole,
/// keyed by its module path, in `dtype`. Plain Burn loads it into the model with burn-store's
/// `SafetensorsStore`, without burn-zero.
///
/// Memory: one parameter at a time (and its conversion), plus one read buffer of at most
/// 64 MiB; any world size, no model type needed.
pub fn consolidate(
    checkpoint: &Path,
    out: &Path,
    dtype: OutputDtype,
) -> Result<Consolidated, CheckpointError> {
    let dir = resolve(checkpoint)?;
    let meta = read_metadata(&dir)?;
    let assembler = Assembler::new(&dir, &meta);
    let assembler = &assembler;
    let mut pending = Vec::new();
    for param in &meta.params {
        let master = tensor_name(TensorKind::Master, &param.path, None);
        let value = tensor_name(TensorKind::Parameter, &param.path, None);
        let (source, stored) = match dtype {
            OutputDtype::F32 if meta.tensors.contains_key(&master) => (master, Dtype::F32),
            OutputDtype::F32 => (value, Dtype::F32),
            OutputDtype::Training => (value, param.dtype),
        };
        if !meta.tensors.contains_key(&source) {
            return Err(CheckpointError::Format {
                path: dir.join(METADATA_FILE),
                reason: format!("no values saved for parameter `{}`", param.path),
            });
        }
        let numel: usize = param.shape.iter().product();
        pending.push(PendingTensor {
            name: param.path.clone(),
            dtype: stored,
            shape: param.shape.clone(),
            byte_len: numel * element_size(stored),
            produce: Box::new(move || assembler.whole(&source, stored)),
        });
    }
    let written = write_safetensors(out, 0, &pending);
    assembler.finish()?;
    let (file, _) = written?;
    tracing::info!(checkpoint = %dir.display(), out = %out.display(), "checkpoint consolidated");
    Ok(Consolidated {
        checkpoint: dir,
        output: out.to_path_buf(),
        tensors: pending.len(),
        bytes: file.bytes,
    })
}

/// Rewrites the checkpoint at `checkpoint` as a world-size-1 checkpoint of the same format in
/// the directory `out` (created): parameters, masters, optimizer state and accumulators, each
/// whole. Any world size loads it like the original.
pub fn consolidate_checkpoint(
    checkpoint: &Path,
    out: &Path,
) -> Result<Consolidated, CheckpointError> {
    let dir = resolve(checkpoint)?;
    let meta = read_metadata(&dir)?;
    std::fs::create_dir_all(out).map_err(|e| CheckpointError::io(out, e))?;
    let assembler = Assembler::new(&dir, &meta);
    let assembler = &assembler;
    let pending: Vec<PendingTensor<'_>> = meta
        .tensors
        .iter()
        .map(|(name, entry)| {
            let name = name.clone();
            let dtype = entry.dtype;
            PendingTensor {
                name: name.clone(),
                dtype,
                shape: vec![entry.numel()],
                byte_len: entry.numel() * element_size(dtype),
                produce: Box::new(move || assembler.whole(&name, dtype)),
            }
        })
        .collect();
    let file_path = out.join(rank_file_name(0, 1));
    let written = write_safetensors(&file_path, 0, &pending);
    assembler.finish()?;
    let (file, spots) = written?;
    let mut consolidated = meta.clone();
    consolidated.world_size = 1;
    consolidated.shard_group_size = 1;
    for param in &mut consolidated.params {
        param.replicated = true;
    }
    for (name, entry) in &mut consolidated.tensors {
        let spot = &spots[name];
        entry.pieces = vec![Piece {
            rank: 0,
            offset: 0,
            length: entry.numel(),
            padding: 0,
            data_offsets: spot.data_offsets,
            page_crc32: spot.page_crc32.clone(),
        }];
    }
    consolidated.files = vec![FileEntry {
        rank: 0,
        ..file.clone()
    }];
    let index = RankIndex {
        file: file.clone(),
        tensors: BTreeMap::new(),
    };
    let json = serde_json::to_vec(&index).map_err(|e| CheckpointError::Format {
        path: out.to_path_buf(),
        reason: e.to_string(),
    })?;
    write_atomically(&out.join(crate::format::rank_index_name(0, 1)), &json)?;
    let json = serde_json::to_vec_pretty(&consolidated).map_err(|e| CheckpointError::Format {
        path: out.join(METADATA_FILE),
        reason: e.to_string(),
    })?;
    write_atomically(&out.join(METADATA_FILE), &json)?;
    Ok(Consolidated {
        checkpoint: dir,
        output: out.to_path_buf(),
        tensors: pending.len(),
        bytes: file.bytes,
    })
}
