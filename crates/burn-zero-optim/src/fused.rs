//! Fused Adam and AdamW: the step over a flat master shard in one pass through memory.
//!
//! Burn's `Adam` is a dozen tensor operations per step (moment updates, bias corrections, a
//! square root, a division, the learning-rate step), each a pass over the shard — or, on a GPU,
//! a kernel launch. [`FusedAdam`] and [`FusedAdamW`] are `SimpleOptimizer`s with Burn's own
//! state types (`AdamState`, `AdamWState`), built from Burn's configs, whose step is one pass
//! over the shard with Burn's operations in Burn's order, each rounded to f32:
//!
//! - on a host backend (Flex, NdArray, and offloaded state), one vectorised pass over host
//!   memory split over threads (`burn_zero_kernels::host::adam_step`), bitwise equal to Burn's
//!   optimizer on that backend;
//! - on a cubecl backend compiled into `burn-zero-kernels` (its features `wgpu` and `cuda`:
//!   `CubeBackend<WgpuRuntime>`/`<CudaRuntime>`, and Burn's fused `Wgpu`/`Cuda`), one kernel
//!   launch per step of a shard (`burn_zero_kernels::adam_step_kernel`), bitwise equal to the
//!   host pass on Mesa's lavapipe (tested over 1,000 steps); the parameter and moments are
//!   updated in their own buffers when nothing else holds them;
//! - on every other backend, and for the options neither covers, Burn's own optimizer.
//!
//! Their records are Burn's, so checkpoints move between the fused and the per-tensor path.
//!
//! Both are [`OnePass`] optimizers: inside `ZeroOptimizer` (built from `AdamConfig` or
//! `AdamWConfig`, its default), the gradient's multiplier (loss-scale unscaling,
//! clipping) and, for a half-precision parameter, the cast of the new values to its dtype are
//! done by the same pass or launch (`adam_step_copying`, `adam_step_kernel_copying`), bitwise
//! equal to a separate multiply before the step and Burn's cast after it.
//!
//! What is fused: Adam with or without L2 weight decay; AdamW with its decoupled weight decay;
//! f32 parameters, gradients and moments. What falls back to Burn's optimizer: AMSGrad, AdamW's
//! cautious weight decay, f64/f16/bf16 tensors (masters are f32 in `ZeroOptimizer`), tensors of
//! more than one dimension (masters are flat), and every backend with neither host memory
//! access nor a kernel. Burn's own per-parameter gradient clipping (`grad_clipping` in the
//! config) is refused: `ZeroOptimizer::with_clipping` clips by the global norm over every
//! rank. [`FusedAdam::fuses`] and [`FusedAdamW::fuses`] say whether a backend takes a fused
//! path.

use burn::optim::{
    Adam, AdamConfig, AdamState, AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState,
    LearningRate, SimpleOptimizer,
};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Device, Shape, Tensor, TensorPrimitive};
use burn_zero_kernels::host::{
    AdamRule, AdamStep, HalfCopy, HostBackend, HostTensor, adam_step, adam_step_copying,
};
use burn_zero_kernels::{adam_step_kernel_copying, kernel_available};
use half::{bf16, f16};

use crate::master::scaled;
use crate::one_pass::{Extras, FlatStep, OnePass};

/// Why a config cannot be fused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FusedConfigError {
    /// A hyperparameter that is not a finite number, or outside its range.
    #[error("{name} = {value} is not a valid {what}")]
    Hyperparameter {
        /// The config field.
        name: &'static str,
        /// Its value.
        value: f64,
        /// What it must be.
        what: &'static str,
    },
    /// Burn's per-parameter gradient clipping, which `ZeroOptimizer` replaces with its own.
    #[error(
        "the config asks for Burn's gradient clipping, which clips each parameter's gradient on \
         its own; use `ZeroOptimizer::with_clipping`, which clips by the global norm over every \
         rank's shards"
    )]
    GradientClipping,
    /// The config could not be read.
    #[error("the optimizer config cannot be read: {0}")]
    Unreadable(String),
}

/// The hyperparameters of Adam and AdamW, read from Burn's configs (which keep their fields
/// private but serialise them).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Hyper {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    amsgrad: bool,
    /// Adam: the L2 penalty; AdamW: the decoupled weight decay.
    weight_decay: Option<f32>,
    cautious: bool,
}

impl Hyper {
    fn read(config: serde_json::Value) -> Result<Self, FusedConfigError> {
        if !config["grad_clipping"].is_null() {
            return Err(FusedConfigError::GradientClipping);
        }
        let number = |name: &'static str| -> Result<f64, FusedConfigError> {
            config[name]
                .as_f64()
                .ok_or_else(|| FusedConfigError::Unreadable(format!("no number `{name}`")))
        };
        let beta = |name| -> Result<f32, FusedConfigError> {
            let value = number(name)?;
            if !(0.0..1.0).contains(&value) {
                return Err(FusedConfigError::Hyperparameter {
                    name,
                    value,
                    what: "moment decay (0 ≤ β < 1)",
                });
            }
            Ok(value as f32)
        };
        let epsilon = number("epsilon")?;
        if !(epsilon.is_finite() && epsilon > 0.0) {
            return Err(FusedConfigError::Hyperparameter {
                name: "epsilon",
                value: epsilon,
                what: "epsilon (a positive finite number)",
            });
        }
        let weight_decay = match &config["weight_decay"] {
            serde_json::Value::Null => None,
            serde_json::Value::Number(n) => n.as_f64(),
            other => other["penalty"].as_f64(),
        };
        if let Some(value) = weight_decay
            && !(value.is_finite() && value >= 0.0)
        {
            return Err(FusedConfigError::Hyperparameter {
                name: "weight_decay",
                value,
                what: "weight decay (a finite number, 0 or more)",
            });
        }
        Ok(Self {
            beta_1: beta("beta_1")?,
            beta_2: beta("beta_2")?,
            epsilon: epsilon as f32,
            amsgrad: config["amsgrad"].as_bool().unwrap_or(false),
            weight_decay: weight_decay.map(|w| w as f32).filter(|&w| w != 0.0),
            cautious: config["cautious_weight_decay"].as_bool().unwrap_or(false),
        })
    }

    /// Whether the one-pass step covers these options.
    fn fusable(&self) -> bool {
        !self.amsgrad && !self.cautious
    }
}

pub(crate) fn serialised(
    config: &impl serde::Serialize,
) -> Result<serde_json::Value, FusedConfigError> {
    serde_json::to_value(config).map_err(|e| FusedConfigError::Unreadable(e.to_string()))
}

/// Burn's Adam stepped in one pass on host and cubecl backends (see the module documentation).
#[derive(Clone)]
pub struct FusedAdam {
    hyper: Hyper,
    burn: Adam,
}

impl FusedAdam {
    /// The fused Adam of `config`, or why it cannot be.
    pub fn new(config: &AdamConfig) -> Result<Self, FusedConfigError> {
        Ok(Self {
            hyper: Hyper::read(serialised(config)?)?,
            burn: config.build(),
        })
    }

    /// Whether a step of an f32 flat shard on backend `B` takes a one-pass path: the host
    /// pass on Flex and NdArray, the kernel on a cubecl backend with kernels in this build.
    pub fn fuses<B: Backend>(&self) -> bool {
        self.hyper.fusable() && fused_backend::<B>()
    }
}

/// Burn's AdamW stepped in one pass on host and cubecl backends (see the module documentation).
#[derive(Clone)]
pub struct FusedAdamW {
    hyper: Hyper,
    burn: AdamW,
}

impl FusedAdamW {
    /// The fused AdamW of `config`, or why it cannot be.
    pub fn new(config: &AdamWConfig) -> Result<Self, FusedConfigError> {
        Ok(Self {
            hyper: Hyper::read(serialised(config)?)?,
            burn: config.build(),
        })
    }

    /// Whether a step of an f32 flat shard on backend `B` takes a one-pass path: the host
    /// pass on Flex and NdArray, the kernel on a cubecl backend with kernels in this build.
    pub fn fuses<B: Backend>(&self) -> bool {
        self.hyper.fusable() && fused_backend::<B>()
    }
}

impl<B: Backend> SimpleOptimizer<B> for FusedAdam {
    type State<const D: usize> = AdamState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let rule = AdamRule::Adam {
            weight_decay: self.hyper.weight_decay,
        };
        if self.fuses::<B>() && D == 1 {
            let momentum = state.map(|s| s.momentum);
            match fused_step(&self.hyper, rule, lr, tensor, grad, momentum, Extras::NONE) {
                Ok((tensor, momentum, _)) => return (tensor, Some(AdamState::new(momentum))),
                Err((tensor, grad, momentum)) => {
                    let state = momentum.map(AdamState::new);
                    return self.burn.step(lr, tensor, grad, state);
                }
            }
        }
        self.burn.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        <Adam as SimpleOptimizer<B>>::to_device(state, device)
    }
}

impl<B: Backend> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let rule = self.rule(lr);
        if self.fuses::<B>() && D == 1 {
            let momentum = state.map(|s| s.momentum);
            match fused_step(&self.hyper, rule, lr, tensor, grad, momentum, Extras::NONE) {
                Ok((tensor, momentum, _)) => return (tensor, Some(AdamWState::new(momentum))),
                Err((tensor, grad, momentum)) => {
                    let state = momentum.map(AdamWState::new);
                    return self.burn.step(lr, tensor, grad, state);
                }
            }
        }
        self.burn.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        <AdamW as SimpleOptimizer<B>>::to_device(state, device)
    }
}

impl FusedAdamW {
    /// AdamW's decoupled decay as Burn applies it at learning rate `lr`.
    fn rule(&self, lr: LearningRate) -> AdamRule {
        let decay = lr * self.hyper.weight_decay.map_or(0.0, f64::from);
        AdamRule::AdamW {
            keep: (decay != 0.0).then_some((1.0 - decay) as f32),
        }
    }
}

impl<B: Backend> OnePass<B> for FusedAdam {
    fn step_flat(
        &self,
        lr: LearningRate,
        master: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        factor: f64,
        state: Option<Self::State<1>>,
        dtype: DType,
    ) -> FlatStep<B, Self::State<1>> {
        let rule = AdamRule::Adam {
            weight_decay: self.hyper.weight_decay,
        };
        let pass = FlatPass {
            hyper: &self.hyper,
            rule,
            lr,
            factor,
            dtype,
            fuses: self.fuses::<B>(),
        };
        let momentum = state.map(|s| s.momentum);
        pass.run(
            master,
            grad,
            momentum,
            AdamState::new,
            |master, grad, state| self.burn.step(lr, master, grad, state),
        )
    }
}

impl<B: Backend> OnePass<B> for FusedAdamW {
    fn step_flat(
        &self,
        lr: LearningRate,
        master: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        factor: f64,
        state: Option<Self::State<1>>,
        dtype: DType,
    ) -> FlatStep<B, Self::State<1>> {
        let pass = FlatPass {
            hyper: &self.hyper,
            rule: self.rule(lr),
            lr,
            factor,
            dtype,
            fuses: self.fuses::<B>(),
        };
        let momentum = state.map(|s| s.momentum);
        pass.run(
            master,
            grad,
            momentum,
            AdamWState::new,
            |master, grad, state| self.burn.step(lr, master, grad, state),
        )
    }
}

/// One `OnePass` step of Adam or AdamW: the one pass where it applies, else Burn's step on the
/// gradient multiplied first (the caller casts).
struct FlatPass<'a> {
    hyper: &'a Hyper,
    rule: AdamRule,
    lr: LearningRate,
    factor: f64,
    dtype: DType,
    fuses: bool,
}

impl FlatPass<'_> {
    /// Steps `master`; `state` wraps the moments as the optimizer's state, `burn` is Burn's own
    /// step for when the pass does not apply.
    fn run<B: Backend, S>(
        &self,
        master: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        momentum: Option<AdaptiveMomentumState<B, 1>>,
        state: fn(AdaptiveMomentumState<B, 1>) -> S,
        burn: impl FnOnce(Tensor<B, 1>, Tensor<B, 1>, Option<S>) -> (Tensor<B, 1>, Option<S>),
    ) -> FlatStep<B, S> {
        let passed = if self.fuses {
            let extras = Extras::of(self.factor, self.dtype);
            fused_step(
                self.hyper, self.rule, self.lr, master, grad, momentum, extras,
            )
        } else {
            Err((master, grad, momentum))
        };
        match passed {
            Ok((master, momentum, written)) => FlatStep {
                master,
                state: Some(state(momentum)),
                written,
            },
            Err((master, grad, momentum)) => {
                let (master, state) = burn(master, scaled(grad, self.factor), momentum.map(state));
                FlatStep {
                    master,
                    state,
                    written: None,
                }
            }
        }
    }
}

/// A one-pass step's results: the new parameter, its moments, and its copy in half precision
/// when one was asked for.
type Passed<B, const D: usize> = (
    Tensor<B, D>,
    AdaptiveMomentumState<B, D>,
    Option<Tensor<B, D>>,
);

/// The inputs back, untouched, when the one-pass path cannot take them.
type Declined<B, const D: usize> = (
    Tensor<B, D>,
    Tensor<B, D>,
    Option<AdaptiveMomentumState<B, D>>,
);

/// Whether `B` has a one-pass path: host memory or a kernel.
fn fused_backend<B: Backend>() -> bool {
    HostBackend::of::<B>().is_some() || kernel_available::<B>()
}

/// Whether every tensor of the step is f32 (the one-pass paths' element type).
fn all_f32<B: Backend, const D: usize>(
    tensor: &Tensor<B, D>,
    grad: &Tensor<B, D>,
    momentum: Option<&AdaptiveMomentumState<B, D>>,
) -> bool {
    tensor.dtype() == DType::F32
        && grad.dtype() == DType::F32
        && momentum
            .is_none_or(|m| m.moment_1.dtype() == DType::F32 && m.moment_2.dtype() == DType::F32)
}

/// The step's scalars as Burn rounds them, for both one-pass paths.
fn one_step(
    hyper: &Hyper,
    rule: AdamRule,
    lr: LearningRate,
    time: usize,
    factor: Option<f32>,
) -> AdamStep {
    AdamStep {
        rule,
        lr: lr as f32,
        beta_1: hyper.beta_1,
        beta_2: hyper.beta_2,
        epsilon: hyper.epsilon,
        time: time as i32,
        factor,
    }
}

/// The host pass on a host backend, the kernel on a cubecl backend; declines (handing
/// everything back) when neither applies.
fn fused_step<B: Backend, const D: usize>(
    hyper: &Hyper,
    rule: AdamRule,
    lr: LearningRate,
    tensor: Tensor<B, D>,
    grad: Tensor<B, D>,
    momentum: Option<AdaptiveMomentumState<B, D>>,
    extras: Extras,
) -> Result<Passed<B, D>, Declined<B, D>> {
    if HostBackend::of::<B>().is_some() {
        host_step(hyper, rule, lr, tensor, grad, momentum, extras)
    } else {
        kernel_step(hyper, rule, lr, tensor, grad, momentum, extras)
    }
}

/// One kernel launch (`adam_step_kernel`): the parameter and moments are written in their
/// own buffers when nothing else holds them, new ones otherwise. Declines (handing everything
/// back) when a tensor is not f32 or the backend has no kernel.
fn kernel_step<B: Backend, const D: usize>(
    hyper: &Hyper,
    rule: AdamRule,
    lr: LearningRate,
    tensor: Tensor<B, D>,
    grad: Tensor<B, D>,
    momentum: Option<AdaptiveMomentumState<B, D>>,
    extras: Extras,
) -> Result<Passed<B, D>, Declined<B, D>> {
    if !kernel_available::<B>() || !all_f32(&tensor, &grad, momentum.as_ref()) {
        return Err((tensor, grad, momentum));
    }
    let shape = tensor.shape();
    let (time, moments) = match momentum {
        Some(state) => (
            state.time + 1,
            Some((primitive(state.moment_1), primitive(state.moment_2))),
        ),
        None => (1, None),
    };
    let step = one_step(hyper, rule, lr, time, extras.factor);
    // Every tensor was checked to be f32 with the parameter's shape (Burn's state and
    // gradient keep it), so the kernel cannot refuse them; the tensors are handed over
    // without another reference, so that their buffers can be updated in place.
    let (p, g) = (primitive(tensor), primitive(grad));
    let (p, m, v, copy) = adam_step_kernel_copying::<B>(&step, p, g, moments, extras.copy)
        .expect("the backend has a kernel (checked above)")
        .unwrap_or_else(|error| panic!("the fused Adam kernel refused an f32 step: {error}"));
    let back = |t| shaped::<B, D>(t, &shape);
    let momentum = AdaptiveMomentumState::new(time, back(m), back(v));
    Ok((back(p), momentum, copy.map(back)))
}

/// A float tensor's primitive.
pub(crate) fn primitive<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
) -> B::FloatTensorPrimitive {
    tensor.into_primitive().tensor()
}

/// A flat float primitive (a one-pass path's result) as a tensor of `shape` again.
pub(crate) fn shaped<B: Backend, const D: usize>(
    flat: B::FloatTensorPrimitive,
    shape: &Shape,
) -> Tensor<B, D> {
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(flat)).reshape(shape.clone())
}

/// One pass over host memory: the parameter's buffer updated in place when nothing else holds
/// it (a copy otherwise), the moments likewise. Declines (handing everything back) when a
/// tensor is not f32 or the backend has no host memory access.
fn host_step<B: Backend, const D: usize>(
    hyper: &Hyper,
    rule: AdamRule,
    lr: LearningRate,
    tensor: Tensor<B, D>,
    grad: Tensor<B, D>,
    momentum: Option<AdaptiveMomentumState<B, D>>,
    extras: Extras,
) -> Result<Passed<B, D>, Declined<B, D>> {
    let Some(backend) = HostBackend::of::<B>() else {
        return Err((tensor, grad, momentum));
    };
    if !all_f32(&tensor, &grad, momentum.as_ref())
        || extras.copy.is_some_and(|dtype| !backend.supports(dtype))
    {
        return Err((tensor, grad, momentum));
    }
    let shape = tensor.shape();
    let numel = shape.num_elements();
    let (time, m, v) = match momentum {
        Some(state) => (state.time + 1, host(state.moment_1), host(state.moment_2)),
        None => (
            1,
            HostTensor::zeros::<f32>(backend, numel),
            HostTensor::zeros::<f32>(backend, numel),
        ),
    };
    let (mut p, g) = (
        writable(host(tensor), backend),
        host(grad).into_contiguous(),
    );
    let (mut m, mut v) = (writable(m, backend), writable(v, backend));
    let step = one_step(hyper, rule, lr, time, extras.factor);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let param = p.as_mut_slice::<f32>().expect("made writable");
    let grad = g.as_slice::<f32>().expect("contiguous f32");
    let m_slice = m.as_mut_slice::<f32>().expect("made writable");
    let v_slice = v.as_mut_slice::<f32>().expect("made writable");
    let copy = stepped_with_copy(backend, extras.copy, numel, |copy| match copy {
        None => adam_step(&step, param, grad, m_slice, v_slice, threads),
        Some(into) => adam_step_copying(&step, param, grad, m_slice, v_slice, into, threads),
    });
    let back = |t: HostTensor| shaped::<B, D>(t.into_primitive::<B>(), &shape);
    let momentum = AdaptiveMomentumState::new(time, back(m), back(v));
    Ok((back(p), momentum, copy.map(back)))
}

/// Runs a host pass `step`, given where to write the new parameter in `copy`'s dtype (f16 or
/// bf16; nothing without a copy), and returns that copy as a host tensor of `backend`.
pub(crate) fn stepped_with_copy(
    backend: HostBackend,
    copy: Option<DType>,
    numel: usize,
    step: impl FnOnce(Option<HalfCopy<'_>>),
) -> Option<HostTensor> {
    match copy {
        None => {
            step(None);
            None
        }
        Some(DType::F16) => {
            let mut copy = vec![f16::ZERO; numel];
            step(Some(HalfCopy::F16(&mut copy)));
            Some(HostTensor::from_vec(backend, copy))
        }
        Some(DType::BF16) => {
            let mut copy = vec![bf16::ZERO; numel];
            step(Some(HalfCopy::Bf16(&mut copy)));
            Some(HostTensor::from_vec(backend, copy))
        }
        Some(other) => unreachable!("a copy in {other:?} is never asked for (see Extras)"),
    }
}

/// A float tensor of a host backend as host memory.
pub(crate) fn host<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> HostTensor {
    HostTensor::from_primitive::<B>(tensor.into_primitive().tensor())
        .unwrap_or_else(|_| unreachable!("the backend was checked to be a host backend"))
}

/// `tensor` if its f32 buffer may be written in place, else a contiguous copy of it.
pub(crate) fn writable(mut tensor: HostTensor, backend: HostBackend) -> HostTensor {
    if tensor.as_mut_slice::<f32>().is_some() {
        return tensor;
    }
    let tensor = tensor.into_contiguous();
    let values = tensor.as_slice::<f32>().expect("contiguous f32").to_vec();
    HostTensor::from_vec(backend, values)
}
