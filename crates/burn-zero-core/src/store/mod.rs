//! The parameter store: what one rank holds of a sharded module's parameters, and how it gets
//! the full values back.
//!
//! - [`table`]: what the store knows of each parameter (key, path, shape, dtype).
//! - `cache`: the bounded cache of gathered parameters.
//! - [`block`]: a rank's block of one tensor, owned memory that can be released, or a range
//!   of a chunk's shard kept as one tensor ([`SharedRow`]) with its other members' blocks.
//! - [`groups`]: [`Groups`], the communicators of a rank: every rank, its shard group and (with
//!   hybrid sharding) its replica group.
//! - [`param_store`]: [`ParamStore`], the communicators, configuration, parameter table, gathers,
//!   gather cache, memory accounting and live parameter blocks of one rank.
//! - [`param`]: [`ShardedParam`], a handle on one block that points to its store.
//! - `prefetch`: the recorded gather order of a pass and the gathers issued ahead of use.
//! - `shard_placement`: where each parameter shard lives (static fractions, or the auto
//!   placement), what the store asks before it moves or uploads a shard.
//! - `auto_placement`: the auto placement's warm-up readings and its decision of which
//!   parameter shards move to the device.
//! - `residency`: after that decision, the host shards kept on the device between uses,
//!   period by period, evicting the one used furthest ahead.
//! - `kept_shard`: one kept shard's device copy, a slot the upload that makes it fills.
//! - `upload`: a shard's host bytes uploaded by the thread that gathers it.
//!
//! Dependencies run one way: `param` → `param_store` → `shard_placement`, `upload`, `block`,
//! `cache`, `groups`, `prefetch`, `table`; `shard_placement` → `auto_placement`, `residency`,
//! `kept_shard`; `upload` → `block`, `kept_shard`. Where each rank's padded block of a tensor
//! lies is [`crate::chunk::BlockLayout`]'s.

pub(crate) mod auto_placement;
pub mod block;
mod cache;
pub mod groups;
pub mod host_gradients;
mod kept_shard;
pub mod param;
pub mod param_store;
pub(crate) mod prefetch;
mod residency;
mod shard_placement;
pub mod table;
mod upload;

/// Where each rank's padded block of a flat tensor lies (defined with the chunk layout).
pub use crate::chunk::BlockLayout;
pub use auto_placement::CapacityExceeded;
pub use block::{Block, SharedRow, host_slices};
pub use groups::Groups;
pub use host_gradients::StepSite;
pub use param::{ShardRole, ShardedParam};
pub use param_store::ParamStore;
pub use prefetch::GatherStats;
pub use table::ParamInfo;
