//! The parameter store: what one rank holds of a sharded module's parameters, and how it gets
//! the full values back.
//!
//! - [`layout`]: [`BlockLayout`], where each rank's padded block of a flat tensor lies.
//! - [`table`]: what the store knows of each parameter (key, path, shape, dtype).
//! - `cache`: the bounded cache of gathered parameters.
//! - [`block`]: a rank's block of one tensor, owned memory that can be released.
//! - [`groups`]: [`Groups`], the communicators of a rank: every rank, its shard group and (with
//!   hybrid sharding) its replica group.
//! - [`param_store`]: [`ParamStore`], the communicators, configuration, parameter table, gathers,
//!   gather cache, memory accounting and live parameter blocks of one rank.
//! - [`param`]: [`ShardedParam`], a handle on one block that points to its store.
//! - `prefetch`: the recorded gather order of a pass and the gathers issued ahead of use.
//!
//! Dependencies run one way: `param` → `param_store` → `block`, `cache`, `groups`, `layout`,
//! `prefetch`, `table`.

pub mod block;
mod cache;
pub mod groups;
pub mod layout;
pub mod param;
pub mod param_store;
pub(crate) mod prefetch;
pub mod table;

pub use block::Block;
pub use groups::Groups;
pub use layout::BlockLayout;
pub use param::{ShardRole, ShardedParam};
pub use param_store::ParamStore;
pub use prefetch::GatherStats;
pub use table::ParamInfo;
