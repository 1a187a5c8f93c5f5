//! Gradient reduction: from autodiff's gradient hooks to each rank's reduced gradient.
//!
//! - `hook`: Burn's static hook entry and the per-thread registry it looks in.
//! - `reducer`: [`GradientReducer`], the owner of the layout, the communication thread and
//!   the backward pass in progress.
//! - `bucket`: the static bucket layout; `reduction`: one bucket's pack, collective and
//!   unpack; `queue`: gradients
//!   waiting for their bucket, reduced in layout order; `thread`: the communication thread
//!   that reduces buckets while backward runs.
//! - `deliver`: reduced gradients into autodiff's slots; `slot`: autodiff's slot;
//!   [`stats`]: what a pass spent.
//!
//! Dependencies run one way: `hook` → `reducer` → `deliver`, `thread` → `queue` →
//! `reduction` → `bucket` (and `slot`, `stats` below them).

pub(crate) mod bucket;
mod deliver;
pub(crate) mod hook;
mod queue;
mod reducer;
mod reduction;
mod slot;
pub mod stats;
pub(crate) mod thread;

pub use reducer::GradientReducer;
pub use stats::ReductionStats;
