#![doc = include_str!("../README.md")]
//!
//! ## Crates
//! - [`checkpoint`]: sharded checkpoints: save at N ranks, load at any world size and stage,
//!   consolidate into one file plain Burn loads.
//! - [`comm`]: the [`comm::Communicator`] trait, the in-process [`comm::LocalGroup`] engine
//!   and the [`comm::launch()`] rank launcher.
//! - [`core`]: the [`Zero`] backend decorator, [`shard()`] and [`ZeroConfig`].
//! - [`launcher`]: multi-process jobs: the launcher environment ([`launcher::DistEnv`]), the
//!   TCP rendezvous and the supervisor behind the `zero-run` binary.
//! - [`optim`]: [`ZeroOptimizer`], Burn's optimizers on each rank's fp32 master shard.

pub use burn_zero_checkpoint as checkpoint;
pub use burn_zero_comm as comm;
pub use burn_zero_core as core;
pub use burn_zero_core::{
    Capacity, ChunkSearch, ChunkSize, MemoryReport, Placement, Zero, ZeroConfig, ZeroError,
    ZeroState, shard, unshard,
};
pub use burn_zero_launch as launcher;
pub use burn_zero_optim as optim;
pub use burn_zero_optim::{OptimizerConfig, PerTensor, ZeroOptimizer};
