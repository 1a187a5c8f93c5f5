//! The on-disk format: one safetensors file per rank plus `metadata.json`, written last as the
//! commit marker.
//!
//! ```text
//! DIR/step-00000100/rank-00000-of-00004.safetensors   what rank 0 owned
//! DIR/step-00000100/rank-00000-of-00004.json          rank 0's index of it (merged below)
//! …
//! DIR/step-00000100/metadata.json                     every tensor's global shape and pieces
//! ```
//!
//! Every saved tensor is a flat sequence of `numel` elements cut into one piece per rank:
//! rank `r` of `N` owns elements `[r·b, min((r+1)·b, numel))` with `b = ⌈numel / N⌉`, the
//! same blocks ZeRO shards by, so a sharded tensor is written straight from its shard and a
//! replicated one is written once, spread over the ranks. A loading rank intersects the
//! elements it needs with these pieces and reads those byte ranges only.
//!
//! A rank's piece of a tensor is a [`Piece`] (`chunks` in `metadata.json`, the name it had
//! before ZeroConfig's parameter chunks existed, kept so that every checkpoint reads and is
//! read by every build): the format knows parameters by module path only, never the chunks
//! the saving run packed them into, so a checkpoint loads under any chunk size.

use std::collections::BTreeMap;

use burn::tensor::DType;
use burn_zero_core::store::BlockLayout;
use safetensors::Dtype;
use serde::{Deserialize, Serialize};

/// What `metadata.json` says it is.
pub const FORMAT: &str = "burn-zero-checkpoint";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the commit marker.
pub const METADATA_FILE: &str = "metadata.json";
/// Each piece carries a CRC32 per page of this many bytes, so that a rank reading part of a
/// piece can still verify what it read.
pub const CHECKSUM_PAGE: usize = 1 << 20;
/// Largest read a loading rank issues at once (its read buffer).
pub const READ_BUFFER: usize = 64 << 20;

/// The directory of the checkpoint of `step` under a checkpoint root.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The safetensors file of `rank` of `world_size`.
pub fn rank_file_name(rank: usize, world_size: usize) -> String {
    format!("rank-{rank:05}-of-{world_size:05}.safetensors")
}

/// The index (pieces and checksums) `rank` writes next to its safetensors file.
pub fn rank_index_name(rank: usize, world_size: usize) -> String {
    format!("rank-{rank:05}-of-{world_size:05}.json")
}

/// What a saved tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A parameter's values, in the training dtype.
    Parameter,
    /// The optimizer's fp32 master copy of a parameter.
    Master,
    /// One per-element tensor of the optimizer's state for a parameter (Adam's moments, SGD's
    /// velocity, …), at `state_field` in the state's record.
    OptimizerState,
    /// An fp32 gradient accumulator of the current accumulation window.
    Accumulator,
}

impl TensorKind {
    fn prefix(self) -> &'static str {
        match self {
            TensorKind::Parameter => "param",
            TensorKind::Master => "master",
            TensorKind::OptimizerState => "optim",
            TensorKind::Accumulator => "accum",
        }
    }
}

/// The stored name of a tensor: its kind, the parameter's module path, and for optimizer state
/// the field inside the state's record (`optim/blocks.0.fc1.weight/momentum.moment_1`).
pub fn tensor_name(kind: TensorKind, param: &str, field: Option<&str>) -> String {
    match field {
        Some(field) => format!("{}/{param}/{field}", kind.prefix()),
        None => format!("{}/{param}", kind.prefix()),
    }
}

/// The elements `[start, end)` of a `numel`-element tensor that `rank` of `world_size` owns,
/// and the zeros its padded block carries past them (ZeRO's blocks: [`BlockLayout`]).
pub fn owned_range(numel: usize, rank: usize, world_size: usize) -> (usize, usize, usize) {
    let blocks = BlockLayout::new(numel, world_size);
    let owned = blocks.owned(rank);
    (owned.start, owned.end, blocks.padding(rank))
}

/// A rank's piece of a tensor: the elements of one saved tensor that one rank's file holds.
/// (Not a parameter chunk of `ZeroConfig::chunk_size`: those never reach the format.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Piece {
    /// The rank whose file holds it.
    pub rank: usize,
    /// First element (of the flat tensor).
    pub offset: usize,
    /// Elements.
    pub length: usize,
    /// Zeros the rank's padded block held past the piece (not written).
    pub padding: usize,
    /// Byte range in the file's data section (after the safetensors header).
    pub data_offsets: (usize, usize),
    /// CRC32 of each [`CHECKSUM_PAGE`] bytes of the piece.
    pub page_crc32: Vec<u32>,
}

/// One saved tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// What it holds.
    pub kind: TensorKind,
    /// The parameter's module path (the key burn-store uses).
    pub param: String,
    /// For optimizer state: the field inside the state's record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_field: Option<String>,
    /// Global shape (the flat length for masters, state and accumulators).
    pub shape: Vec<usize>,
    /// Element type as stored.
    pub dtype: Dtype,
    /// The pieces, by rank, covering every element once. Stored as `chunks`, as format
    /// version 1 has always named them.
    #[serde(rename = "chunks")]
    pub pieces: Vec<Piece>,
}

impl TensorEntry {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parameter of the saved model, in module visit order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Module path (`blocks.0.attn.query.weight`).
    pub path: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Training dtype.
    pub dtype: Dtype,
    /// Saved without gradient (`require_grad` off): loaded as such, never stepped. Frozen
    /// parameters are stored like the others; the flag is there so that tools can tell them
    /// apart.
    pub frozen: bool,
    /// Replicated on every rank when saved (rather than sharded); it is still written once.
    pub replicated: bool,
}

/// One rank's file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// The rank that wrote it.
    pub rank: usize,
    /// File name in the checkpoint directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC32 of the file's data section (every tensor's bytes, in file order).
    pub data_crc32: u32,
}

/// The optimizer's scalar state (identical on every rank).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerEntry {
    /// Micro-steps taken in the current accumulation window.
    pub micro_steps: usize,
    /// Steps skipped because of gradient overflow.
    pub skipped: usize,
    /// Loss scaler: scale, clean steps, overflows counted towards hysteresis.
    pub scaler: Option<(f64, usize, usize)>,
    /// Per parameter path: the optimizer state's record with its per-element tensors taken
    /// out (their bytes live in the rank files, as [`TensorKind::OptimizerState`] tensors).
    pub states: BTreeMap<String, serde_json::Value>,
}

/// `metadata.json`: everything a loading rank needs to plan its reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub version: u32,
    /// The training step the checkpoint was taken after (the caller's count).
    pub step: u64,
    /// Ranks that saved it: every rank of the job, or with hybrid sharding the ranks of shard
    /// group 0 (the other groups hold the same blocks and write nothing).
    pub world_size: usize,
    /// Ranks each tensor was sharded over; equal to `world_size` (one copy is written, by
    /// the first shard group, cut into its pieces).
    pub shard_group_size: usize,
    /// ZeRO stage of the saving run.
    pub stage: u8,
    /// The saving run's `ZeroConfig`, as JSON.
    pub config: serde_json::Value,
    /// The rank files, by rank.
    pub files: Vec<FileEntry>,
    /// The model's parameters, in visit order.
    pub params: Vec<ParamEntry>,
    /// Every saved tensor by stored name ([`tensor_name`]).
    pub tensors: BTreeMap<String, TensorEntry>,
    /// The optimizer's scalar state and state records.
    pub optimizer: OptimizerEntry,
    /// Whatever the caller attached (data loader position, run name, …).
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// What one rank writes next to its file; rank 0 merges them into [`Metadata`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankIndex {
    /// The rank file.
    pub file: FileEntry,
    /// The tensors it holds pieces of, each with this rank's piece only.
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// The safetensors dtype of a Burn float dtype.
pub fn to_safetensors(dtype: DType) -> Option<Dtype> {
    match dtype {
        DType::F64 => Some(Dtype::F64),
        DType::F32 | DType::Flex32 => Some(Dtype::F32),
        DType::F16 => Some(Dtype::F16),
        DType::BF16 => Some(Dtype::BF16),
        _ => None,
    }
}

/// The Burn dtype of a safetensors float dtype.
pub fn to_burn(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::F64 => Some(DType::F64),
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// CRC32 of each [`CHECKSUM_PAGE`] bytes of `bytes`.
pub fn page_checksums(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks(CHECKSUM_PAGE).map(crc32fast::hash).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `metadata.json` of a 2-rank checkpoint of one 10-element parameter as format version 1
    /// has written it since the start: each tensor's pieces under `chunks`.
    const VERSION_1_METADATA: &str = r#"{
      "format": "burn-zero-checkpoint",
      "version": 1,
      "step": 3,
      "world_size": 2,
      "shard_group_size": 2,
      "stage": 3,
      "config": {"stage": 3},
      "files": [
        {"rank": 0, "name": "rank-00000-of-00002.safetensors", "bytes": 120, "data_crc32": 1},
        {"rank": 1, "name": "rank-00001-of-00002.safetensors", "bytes": 120, "data_crc32": 2}
      ],
      "params": [
        {"path": "fc.weight", "shape": [2, 5], "dtype": "F32", "frozen": false,
         "replicated": false}
      ],
      "tensors": {
        "param/fc.weight": {
          "kind": "parameter",
          "param": "fc.weight",
          "shape": [2, 5],
          "dtype": "F32",
          "chunks": [
            {"rank": 0, "offset": 0, "length": 5, "padding": 0, "data_offsets": [0, 20],
             "page_crc32": [7]},
            {"rank": 1, "offset": 5, "length": 5, "padding": 0, "data_offsets": [0, 20],
             "page_crc32": [8]}
          ]
        }
      },
      "optimizer": {"micro_steps": 0, "skipped": 0, "scaler": null, "states": {}},
      "extra": null
    }"#;

    #[test]
    fn metadata_with_the_pieces_under_chunks_reads_and_is_written_the_same_way() {
        let meta: Metadata = serde_json::from_str(VERSION_1_METADATA).unwrap();
        let entry = &meta.tensors["param/fc.weight"];
        assert_eq!(
            entry.pieces,
            [
                Piece {
                    rank: 0,
                    offset: 0,
                    length: 5,
                    padding: 0,
                    data_offsets: (0, 20),
                    page_crc32: vec![7],
                },
                Piece {
                    rank: 1,
                    offset: 5,
                    length: 5,
                    padding: 0,
                    data_offsets: (0, 20),
                    page_crc32: vec![8],
                },
            ]
        );
        // Written back under the same name, so builds before the rename read it too.
        let written = serde_json::to_value(&meta).unwrap();
        let tensor = &written["tensors"]["param/fc.weight"];
        assert!(tensor.get("pieces").is_none(), "{tensor}");
        assert_eq!(tensor["chunks"][1]["offset"], 5);
        let original: serde_json::Value = serde_json::from_str(VERSION_1_METADATA).unwrap();
        assert_eq!(written, original, "a read and rewrite changes nothing");
    }

    #[test]
    fn owned_ranges_cover_every_element_once_with_the_padding_of_the_last_blocks() {
        for numel in [0, 1, 7, 10, 130] {
            for world in 1..6 {
                let mut next = 0;
                for rank in 0..world {
                    let (start, end, padding) = owned_range(numel, rank, world);
                    assert_eq!(start, next.min(numel));
                    assert_eq!(end - start + padding, numel.div_ceil(world));
                    next = end;
                }
                assert_eq!(next, numel);
            }
        }
    }
}
