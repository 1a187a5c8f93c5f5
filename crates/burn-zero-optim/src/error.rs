//! Why a [`crate::ZeroOptimizer`] cannot be made or asked something.

use crate::fused::FusedConfigError;

/// An optimizer that cannot be made as asked, or a request it cannot carry out.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimizerError {
    /// The optimizer's configuration cannot work.
    #[error(transparent)]
    Config(#[from] FusedConfigError),
    /// The placement the module was sharded with cannot work (see `ZeroConfig::placement`).
    #[error("placement: {0}")]
    Placement(String),
    /// Chunks cannot move inside an accumulation window.
    #[error(
        "optimizer chunks move between host and device at a step boundary, not {0} micro-step(s) \
         into an accumulation window"
    )]
    InsideAccumulation(usize),
    /// A chunk that does not step on the host.
    #[error(
        "chunk #{0} does not step on the host (a trainable chunk of the layout whose state is there)"
    )]
    NotOnHost(usize),
}

impl From<OptimizerError> for burn_zero_core::ZeroError {
    /// So that a rank's code returning `ZeroError` can `?` the optimizer's construction.
    fn from(error: OptimizerError) -> Self {
        burn_zero_core::ZeroError::Optimizer(error.to_string())
    }
}
