//! What a [`crate::ZeroOptimizer`] steps with: Burn's optimizer configs, fused by default.
//!
//! `AdamConfig`, `AdamWConfig` and `SgdConfig` give the fused optimizers ([`FusedAdam`],
//! [`FusedAdamW`], [`FusedSgd`]): one pass over each chunk's flat master on the host backends,
//! one kernel launch on wgpu and CUDA, Burn's own step elsewhere. Any other Burn
//! [`SimpleOptimizer`] (or Burn's own Adam, for comparison) steps tensor by tensor through
//! [`PerTensor`].

use burn::optim::{AdamConfig, AdamWConfig, SgdConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;

use crate::fused::{FusedAdam, FusedAdamW, FusedConfigError};
use crate::fused_sgd::FusedSgd;
use crate::one_pass::{OnePass, OnePassFn};

/// A configuration `ZeroOptimizer` builds its step from.
pub trait OptimizerConfig {
    /// The optimizer that steps each master.
    type Optimizer: Clone + Send + Sync + 'static;

    /// The optimizer, or why this configuration cannot make one.
    fn optimizer(&self) -> Result<Self::Optimizer, FusedConfigError>;

    /// The optimizer's one-pass step on backend `X` (the gradient's multiplier and a
    /// half-precision parameter's cast in the step's own pass), when it has one.
    fn one_pass<X: Backend>() -> Option<OnePassFn<Self::Optimizer, X>>
    where
        Self::Optimizer: SimpleOptimizer<X>,
    {
        None
    }
}

impl OptimizerConfig for AdamConfig {
    type Optimizer = FusedAdam;

    /// [`FusedAdam`]: refuses hyperparameters that cannot work, and Burn's per-parameter
    /// gradient clipping (use `ZeroOptimizer::with_clipping`), by name.
    fn optimizer(&self) -> Result<FusedAdam, FusedConfigError> {
        FusedAdam::new(self)
    }

    fn one_pass<X: Backend>() -> Option<OnePassFn<FusedAdam, X>> {
        Some(<FusedAdam as OnePass<X>>::step_flat)
    }
}

impl OptimizerConfig for AdamWConfig {
    type Optimizer = FusedAdamW;

    /// [`FusedAdamW`], refusing what [`FusedAdam`] refuses.
    fn optimizer(&self) -> Result<FusedAdamW, FusedConfigError> {
        FusedAdamW::new(self)
    }

    fn one_pass<X: Backend>() -> Option<OnePassFn<FusedAdamW, X>> {
        Some(<FusedAdamW as OnePass<X>>::step_flat)
    }
}

impl OptimizerConfig for SgdConfig {
    type Optimizer = FusedSgd;

    /// [`FusedSgd`]: weight decay and momentum in its one pass.
    fn optimizer(&self) -> Result<FusedSgd, FusedConfigError> {
        FusedSgd::new(self)
    }

    fn one_pass<X: Backend>() -> Option<OnePassFn<FusedSgd, X>> {
        Some(<FusedSgd as OnePass<X>>::step_flat)
    }
}

/// Any Burn [`SimpleOptimizer`] (Burn's own Adam, AdamW, SGD, or one of your own), stepped
/// tensor by tensor with Burn's ops: `PerTensor(AdamConfig::new().build())`. Bitwise what
/// Burn's optimizer computes on every backend; slower than the fused step, which launches one
/// kernel per chunk where this launches a dozen per parameter.
#[derive(Debug, Clone)]
pub struct PerTensor<O>(pub O);

impl<O: Clone + Send + Sync + 'static> OptimizerConfig for PerTensor<O> {
    type Optimizer = O;

    fn optimizer(&self) -> Result<O, FusedConfigError> {
        Ok(self.0.clone())
    }
}
