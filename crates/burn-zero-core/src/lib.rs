//! `Zero<B>`: a Burn backend decorator whose float tensors may be parameters sharded across
//! ranks (ZeRO stage 3). Compute ops gather sharded operands at dispatch; autodiff's gradient
//! hooks reduce each gradient across ranks and leave this rank's shard.
//!
//! Module map (each module uses only those listed before it; `docs/architecture.md` draws the
//! tree and a test checks the order):
//! - [`chunk`]: the chunk layout — which parameters are gathered, reduced and stepped
//!   together — and each rank's padded block of a tensor.
//! - [`config`], [`error`], [`memory`], [`view`]: the configuration, errors, memory
//!   accounting and lazy view ops.
//! - [`store`]: the parameter store — table, gathers and their cache, blocks, memory —
//!   and [`ShardedParam`], a handle on one block that points to its store.
//! - [`tensor`]: the float primitive (local or sharded view); [`backend`]: the `Zero<B>` type.
//! - [`reduce`]: gradient reduction — Burn's hook entry, buckets of a static layout, queued
//!   in order and reduced on a communication thread while backward runs, delivered into
//!   autodiff's slots.
//! - `ops/`: `Zero<B>`'s op traits, forwarded by macro.
//! - [`state`]: [`ZeroState`], the handle on a rank's store and reducer.
//! - [`shard()`]: sharding a module, and unsharding it.

pub mod backend;
pub mod chunk;
pub mod config;
pub mod error;
pub mod memory;
mod ops;
pub mod placement;
pub mod reduce;
pub mod shard;
pub mod state;
pub mod store;
pub mod tensor;
pub mod view;

pub use backend::Zero;
pub use chunk::{ChunkSearch, ChunkSize};
pub use config::ZeroConfig;
pub use error::ZeroError;
pub use memory::{
    AutoPlacementReport, ChunkCounts, KeptShardStats, MemoryKind, MemoryReport, Usage,
};
pub use placement::{Capacity, Placement};
pub use reduce::{GradientReducer, ReductionStats};
pub use shard::{shard, unshard};
pub use state::ZeroState;
pub use store::{
    CapacityExceeded, GatherStats, ParamInfo, ParamStore, ShardRole, ShardedParam, StepSite,
};
pub use tensor::{ShardedView, ZeroTensor};
