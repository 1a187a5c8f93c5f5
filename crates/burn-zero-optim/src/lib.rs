//! The optimizer half of ZeRO: [`ZeroOptimizer`] steps each rank's shard of every parameter
//! with one of Burn's own optimizers (Adam, AdamW, SGD, …) on fp32 master copies, and writes
//! the result back into the parameter — as its new shard (stage 3) or all-gathered into the
//! replicated parameter (stages 1 and 2).

mod chunked;
mod clip;
mod fused;
mod fused_sgd;
mod loss_scale;
mod master;
mod one_pass;
mod optimizer;
mod placement;
mod record;
mod split;
mod state;
pub mod state_tree;

pub use clip::NormType;
pub use fused::{FusedAdam, FusedAdamW, FusedConfigError};
pub use fused_sgd::{FusedSgd, FusedSgdState, Velocity};
pub use loss_scale::{DynamicLossScaler, LossScalerConfig};
pub use one_pass::{FlatStep, OnePass, OnePassFn};
pub use optimizer::{StateSize, ZeroOptimizer};
pub use placement::{Offload, OnDevice, Placement};
pub use record::{MasterEntry, ZeroOptimizerRecord, ZeroOptimizerRecordItem};
pub use split::{MarginReport, SplitError, SplitZeroOptimizer};
pub use state::StateBytes;
