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
use burn_zero_kernels::host::{AdamRule, AdamStep, HostBackend, HostTensor, adam_step};
use burn_zero_kernels::{adam_step_kernel, kernel_available};

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
            match fused_step(&self.hyper, rule, lr, tensor, grad, momentum) {
                Ok((tensor, momentum)) => return (tensor, Some(AdamState::new(momentum))),
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
        let decay = lr * self.hyper.weight_decay.map_or(0.0, f64::from);
        let rule = AdamRule::AdamW {
            keep: (decay != 0.0).then_some((1.0 - decay) as f32),
        };
        if self.fuses::<B>() && D == 1 {
            let momentum = state.map(|s| s.momentum);
            match fused_step(&self.hyper, rule, lr, tensor, grad, momentum) {
                Ok((tensor, momentum)) => return (tensor, Some(AdamWState::new(momentum))),
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
fn one_step(hyper: &Hyper, rule: AdamRule, lr: LearningRate, time: usize) -> AdamStep {
    AdamStep {
        rule,
        lr: lr as f32,
        beta_1: hyper.beta_1,
        beta_2: hyper.beta_2,
        epsilon: hyper.epsilon,
        time: time as i32,
        factor: None,
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
) -> Result<(Tensor<B, D>, AdaptiveMomentumState<B, D>), Declined<B, D>> {
    if HostBackend::of::<B>().is_some() {
        host_step(hyper, rule, lr, tensor, grad, momentum)
    } else {
        kernel_step(hyper, rule, lr, tensor, grad, momentum)
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
) -> Result<(Tensor<B, D>, AdaptiveMomentumState<B, D>), Declined<B, D>> {
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
    let step = one_step(hyper, rule, lr, time);
    // Every tensor was checked to be f32 with the parameter's shape (Burn's state and
    // gradient keep it), so the kernel cannot refuse them; the tensors are handed over
    // without another reference, so that their buffers can be updated in place.
    let (p, m, v) = adam_step_kernel::<B>(&step, primitive(tensor), primitive(grad), moments)
        .expect("the backend has a kernel (checked above)")
        .unwrap_or_else(|error| panic!("the fused Adam kernel refused an f32 step: {error}"));
    let back = |t| shaped::<B, D>(t, &shape);
    let momentum = AdaptiveMomentumState::new(time, back(m), back(v));
    Ok((back(p), momentum))
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
) -> Result<(Tensor<B, D>, AdaptiveMomentumState<B, D>), Declined<B, D>> {
    let Some(backend) = HostBackend::of::<B>() else {
        return Err((tensor, grad, momentum));
    };
    if !all_f32(&tensor, &grad, momentum.as_ref()) {
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
    let step = one_step(hyper, rule, lr, time);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    adam_step(
        &step,
        p.as_mut_slice::<f32>().expect("made writable"),
        g.as_slice::<f32>().expect("contiguous f32"),
        m.as_mut_slice::<f32>().expect("made writable"),
        v.as_mut_slice::<f32>().expect("made writable"),
        threads,
    );
    let back = |t: HostTensor| shaped::<B, D>(t.into_primitive::<B>(), &shape);
    let momentum = AdaptiveMomentumState::new(time, back(m), back(v));
    Ok((back(p), momentum))
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
