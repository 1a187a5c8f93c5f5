//! One-pass steps: the gradient's multiplier and the parameter's cast folded into the step.
//!
//! Around every optimizer step `ZeroOptimizer` does two more elementwise passes over a master
//! shard: the gradient is multiplied by the unscaling and clipping factor before the step, and
//! the new fp32 values are cast to the parameter's dtype after it (a half-precision model).
//! With Burn's per-tensor optimizers these are two more operations among a dozen; with a fused
//! optimizer they would be two of three passes through memory — on a GPU, two of three kernel
//! launches per chunk. An optimizer that implements [`OnePass`] takes both into its own pass,
//! and `ZeroOptimizer` calls it in place of the step when it was built with
//! `AdamConfig`, `AdamWConfig` or `SgdConfig` (their `OptimizerConfig::one_pass`).
//!
//! The results are bitwise those of the separate passes: the factor is applied to the f32
//! gradient exactly as `mul_scalar` applies it (rounded to f32 first), and the cast rounds to
//! nearest even as Burn's casts do.

use burn::optim::{LearningRate, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// An optimizer whose step of a flat fp32 master can also multiply the gradient and write the
/// parameter's new values in its own dtype, in the same pass.
pub trait OnePass<B: Backend>: SimpleOptimizer<B> {
    /// One step of the flat fp32 `master` with the f32 `grad` multiplied by `factor`; with a
    /// `dtype` other than f32, also the new values in `dtype` when the pass can write them
    /// (`written`: `None` when it cannot, and the caller casts).
    fn step_flat(
        &self,
        lr: LearningRate,
        master: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        factor: f64,
        state: Option<Self::State<1>>,
        dtype: DType,
    ) -> FlatStep<B, Self::State<1>>;
}

/// What [`OnePass::step_flat`] produced.
pub struct FlatStep<B: Backend, S> {
    /// The new fp32 master.
    pub master: Tensor<B, 1>,
    /// The optimizer's new state for it.
    pub state: Option<S>,
    /// The new values in the parameter's dtype, when the pass wrote them.
    pub written: Option<Tensor<B, 1>>,
}

/// [`OnePass::step_flat`] of an optimizer `O` on backend `H`, kept by `ZeroOptimizer` as a
/// plain function so that it can hold any `SimpleOptimizer` and use the one pass where there
/// is one.
pub type OnePassFn<O, H> = fn(
    &O,
    LearningRate,
    Tensor<H, 1>,
    Tensor<H, 1>,
    f64,
    Option<<O as SimpleOptimizer<H>>::State<1>>,
    DType,
) -> FlatStep<H, <O as SimpleOptimizer<H>>::State<1>>;

/// What a one-pass step does besides the step itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Extras {
    /// The gradient's multiplier (unscaling and clipping), `None` for 1.
    pub factor: Option<f32>,
    /// The dtype (f16 or bf16) of a copy of the new parameter to write in the same pass.
    pub copy: Option<DType>,
}

impl Extras {
    /// The step alone.
    pub const NONE: Self = Self {
        factor: None,
        copy: None,
    };

    /// What [`OnePass::step_flat`] asks for with `factor` and a parameter of `dtype`: the
    /// factor rounded to f32 as Burn's `mul_scalar` rounds its scalar for an f32 tensor (none
    /// for 1), and a copy for a half-precision parameter only (an f32 parameter is the
    /// master's values, an f64 one is cast by the caller).
    pub fn of(factor: f64, dtype: DType) -> Self {
        Self {
            factor: (factor != 1.0).then_some(factor as f32),
            copy: matches!(dtype, DType::F16 | DType::BF16).then_some(dtype),
        }
    }
}
