//! `Zero<B>`: a Burn backend decorator whose float tensors may be parameters sharded across
//! ranks (ZeRO stage 3). Compute ops gather sharded operands at dispatch; autodiff's gradient
//! hooks reduce each gradient across ranks and leave this rank's shard.
//!
//! Module map:
//! - [`backend`]: the `Zero<B>` type; `ops/`: its op traits, forwarded by macro.
//! - [`tensor`]: the float primitive (local or sharded view); [`view`]: lazy view ops.
//! - [`sharded`]: a rank's shard of a parameter or gradient; [`gather`]: the gather cache.
//! - [`group`]: one rank's state for a sharded module; `grads`: gradient reduction, in
//!   buckets (`bucket`) of a static layout, queued in order (`queue`) and reduced on a
//!   communication thread (`reducer`) while backward runs.
//! - [`shard()`]: sharding a module; [`hooks`]: how autodiff's hooks find the group.
//! - [`config`], [`memory`], [`error`].

pub mod backend;
mod bucket;
pub mod config;
pub mod error;
mod gather;
mod grads;
pub mod group;
pub mod hooks;
pub mod memory;
mod ops;
mod queue;
mod reducer;
pub mod shard;
pub mod sharded;
pub mod tensor;
pub mod view;

pub use backend::Zero;
pub use config::ZeroConfig;
pub use error::ZeroError;
pub use group::{ParamInfo, ReductionStats, ZeroGroup};
pub use hooks::{current_group, group_of};
pub use memory::{MemoryKind, MemoryReport, Usage};
pub use shard::{shard, unshard};
pub use sharded::{ShardRole, ShardedParam};
pub use tensor::{ShardedView, ZeroTensor};
