//! Sharded checkpoints for burn-zero that outlive the world size: save at N ranks, resume at M
//! ranks and any ZeRO stage, or consolidate into one file that plain Burn loads.
//!
//! - [`save`]: a collective; each rank writes what it owns (its piece of every parameter, fp32 masters,
//!   optimizer state, gradient accumulators) into its own safetensors file, then rank 0 commits
//!   the checkpoint by writing `metadata.json`; older checkpoints are rotated out.
//! - [`load`]: a collective at any world size; each rank reads only the byte ranges it needs.
//! - [`consolidate`] / [`consolidate_checkpoint`] (and the `zero-consolidate` binary): one
//!   safetensors file of whole parameters for plain Burn, or a world-size-1 checkpoint.
//! - [`list`], [`latest`], [`resolve`]: what a checkpoint root holds, complete or not.
//!
//! Module map: [`format`](mod@format) (the files and `metadata.json`), `write` (atomic writes), `read`
//! (checked range reads), `state` (optimizer state through its record), `params` (a sharded
//! module's parameters), `save`, `load`, `consolidate`, `dir` (roots and rotation), [`error`].

mod consolidate;
mod dir;
pub mod error;
pub mod format;
mod load;
mod params;
mod read;
mod save;
mod write;

pub use consolidate::{Consolidated, OutputDtype, consolidate, consolidate_checkpoint};
pub use dir::{CheckpointDir, latest, list, read_metadata, resolve};
pub use error::CheckpointError;
pub use format::Metadata;
pub use load::{Loaded, Resumed, ResumedRecord, load, load_record};
pub use save::{SaveOptions, save, save_record};
