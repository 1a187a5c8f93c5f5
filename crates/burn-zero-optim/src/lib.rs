//! The optimizer half of ZeRO: [`ZeroOptimizer`] steps each rank's share of every chunk — its
//! fp32 master and optimizer state, where the module's placement keeps them, on the device or
//! on a host backend — with the fused Adam, AdamW or SGD built from Burn's configs, or any
//! Burn optimizer tensor by tensor ([`PerTensor`]), and writes the result back into the
//! parameters: as their new shard (stage 3), or all-gathered into the replicated parameters
//! (stages 1 and 2).

mod clip;
mod error;
mod fused;
mod fused_sgd;
mod loss_scale;
mod master;
mod masters;
mod one_pass;
mod optimizer;
mod place;
mod record;
mod rule;
mod side;
mod state;
pub mod state_tree;

pub use clip::NormType;
pub use error::OptimizerError;
pub use fused::{FusedAdam, FusedAdamW, FusedConfigError};
pub use fused_sgd::{FusedSgd, FusedSgdState, Velocity};
pub use loss_scale::{DynamicLossScaler, LossScalerConfig};
pub use one_pass::{FlatStep, OnePass, OnePassFn};
pub use optimizer::{MarginReport, ZeroOptimizer};
pub use record::{MasterEntry, ZeroOptimizerRecord, ZeroOptimizerRecordItem};
pub use rule::{OptimizerConfig, PerTensor};
pub use state::StateBytes;
