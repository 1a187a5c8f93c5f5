//! Burn's SGD (L2 weight decay, momentum with dampening and Nesterov) stepped in one pass.
//!
//! Burn's `Sgd` is up to seven tensor operations per step, each a pass over the shard.
//! [`FusedSgd`] is a `SimpleOptimizer` built from Burn's `SgdConfig` whose step on a host
//! backend (Flex, NdArray, and offloaded state) is one pass over host memory split over
//! threads (`burn_zero_kernels::host::sgd_step`), and on a cubecl backend compiled into
//! `burn-zero-kernels` (wgpu, CUDA; plain or Burn's fused backends) one kernel launch
//! (`burn_zero_kernels::sgd_step_kernel`), each bitwise equal to Burn's optimizer: the same
//! operations in the same order, each rounded to f32. Every option is fused. On every other
//! backend, for f64/f16/bf16 tensors and for tensors of more than one dimension, it steps with
//! Burn's operations in Burn's order. Burn's per-parameter gradient clipping is refused, as for Adam.
//!
//! Like the fused Adam it is a [`OnePass`] optimizer: inside `ZeroOptimizer` the gradient's
//! multiplier (loss-scale unscaling, clipping) and a half-precision parameter's cast are done
//! by the same pass or launch, bitwise equal to a separate multiply before the step and Burn's
//! cast after it.
//!
//! Burn's `SgdState` keeps its velocity private, so the one-pass path could not read it;
//! [`FusedSgdState`] holds the same tensor under the same field names, so its record is
//! Burn's record, field for field, and checkpoints move between the fused and the per-tensor
//! path.

use burn::optim::{LearningRate, SgdConfig, SimpleOptimizer};
use burn::record::Record;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Device, Tensor};
use burn_zero_kernels::host::{
    HostBackend, HostTensor, SgdMomentum, SgdStep, sgd_step, sgd_step_copying,
};
use burn_zero_kernels::{kernel_available, sgd_step_kernel_copying};

use crate::fused::{
    FusedConfigError, host, primitive, serialised, shaped, stepped_with_copy, writable,
};
use crate::master::scaled;
use crate::one_pass::{Extras, FlatStep, OnePass};

/// [`FusedSgd`]'s state: Burn's `SgdState` with a readable velocity. Its record has the
/// shape of Burn's (`momentum.velocity`), so the two read each other's records.
#[derive(Record, Clone)]
pub struct FusedSgdState<B: Backend, const D: usize> {
    /// The velocity, when momentum is on.
    pub momentum: Option<Velocity<B, D>>,
}

/// Momentum's state: Burn's `MomentumState`, field for field.
#[derive(Record, Clone)]
pub struct Velocity<B: Backend, const D: usize> {
    /// The velocity.
    pub velocity: Tensor<B, D>,
}

/// Momentum's settings, read from Burn's config.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Momentum {
    momentum: f64,
    dampening: f64,
    nesterov: bool,
}

/// Burn's SGD stepped in one pass on host backends (see the module documentation).
#[derive(Clone)]
pub struct FusedSgd {
    weight_decay: Option<f32>,
    momentum: Option<Momentum>,
}

impl FusedSgd {
    /// SGD with `config`'s weight decay and momentum. Refuses a non-finite or negative
    /// penalty or momentum, a non-finite dampening, and Burn's gradient clipping, by name.
    pub fn new(config: &SgdConfig) -> Result<Self, FusedConfigError> {
        let read = serialised(config)?;
        if !read["gradient_clipping"].is_null() {
            return Err(FusedConfigError::GradientClipping);
        }
        let checked = |name: &'static str,
                       value: Option<f64>,
                       ok: fn(f64) -> bool,
                       what: &'static str|
         -> Result<f64, FusedConfigError> {
            let value =
                value.ok_or_else(|| FusedConfigError::Unreadable(format!("no number `{name}`")))?;
            if ok(value) {
                Ok(value)
            } else {
                Err(FusedConfigError::Hyperparameter { name, value, what })
            }
        };
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        let weight_decay = match &read["weight_decay"] {
            serde_json::Value::Null => None,
            decay => Some(checked(
                "weight_decay",
                decay["penalty"].as_f64(),
                non_negative,
                "weight decay (a finite number, 0 or more)",
            )? as f32),
        };
        let momentum = match &read["momentum"] {
            serde_json::Value::Null => None,
            m => Some(Momentum {
                momentum: checked(
                    "momentum",
                    m["momentum"].as_f64(),
                    non_negative,
                    "momentum (a finite number, 0 or more)",
                )?,
                dampening: checked(
                    "dampening",
                    m["dampening"].as_f64(),
                    f64::is_finite,
                    "dampening (a finite number)",
                )?,
                nesterov: m["nesterov"].as_bool().unwrap_or(false),
            }),
        };
        Ok(Self {
            weight_decay,
            momentum,
        })
    }

    /// Whether a step of an f32 flat shard on backend `B` takes a one-pass path: the host
    /// pass on Flex and NdArray, the kernel on a cubecl backend with kernels in this build.
    pub fn fuses<B: Backend>(&self) -> bool {
        HostBackend::of::<B>().is_some() || kernel_available::<B>()
    }

    /// The step's scalars as Burn rounds them; `first` when there is no velocity yet.
    fn step_of(&self, lr: LearningRate, first: bool, factor: Option<f32>) -> SgdStep {
        SgdStep {
            lr: lr as f32,
            factor,
            weight_decay: self.weight_decay,
            momentum: self.momentum.map(|m| SgdMomentum {
                momentum: m.momentum as f32,
                keep_grad: (1.0 - m.dampening) as f32,
                nesterov: m.nesterov,
                first,
            }),
        }
    }
}

impl<B: Backend> SimpleOptimizer<B> for FusedSgd {
    type State<const D: usize> = FusedSgdState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let velocity = state.and_then(|s| s.momentum).map(|m| m.velocity);
        let (tensor, velocity) = match self.one_pass(lr, tensor, grad, velocity, Extras::NONE) {
            Ok((tensor, velocity, _)) => (tensor, velocity),
            Err((tensor, grad, velocity)) => self.burn_ops_step(lr, tensor, grad, velocity),
        };
        (tensor, Some(state_of(velocity)))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        state.momentum = state.momentum.map(|m| Velocity {
            velocity: m.velocity.to_device(device),
        });
        state
    }
}

impl<B: Backend> OnePass<B> for FusedSgd {
    fn step_flat(
        &self,
        lr: LearningRate,
        master: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        factor: f64,
        state: Option<Self::State<1>>,
        dtype: DType,
    ) -> FlatStep<B, Self::State<1>> {
        let velocity = state.and_then(|s| s.momentum).map(|m| m.velocity);
        let extras = Extras::of(factor, dtype);
        let (master, velocity, written) = match self.one_pass(lr, master, grad, velocity, extras) {
            Ok(passed) => passed,
            Err((master, grad, velocity)) => {
                let (master, velocity) =
                    self.burn_ops_step(lr, master, scaled(grad, factor), velocity);
                (master, velocity, None)
            }
        };
        FlatStep {
            master,
            state: Some(state_of(velocity)),
            written,
        }
    }
}

/// The optimizer's state holding `velocity`.
fn state_of<B: Backend, const D: usize>(velocity: Option<Tensor<B, D>>) -> FusedSgdState<B, D> {
    FusedSgdState {
        momentum: velocity.map(|velocity| Velocity { velocity }),
    }
}

/// A one-pass step's results: the new parameter, its velocity, and its copy in half precision
/// when one was written.
type Passed<B, const D: usize> = (Tensor<B, D>, Option<Tensor<B, D>>, Option<Tensor<B, D>>);

/// The inputs back, untouched, when the one-pass path cannot take them.
type Declined<B, const D: usize> = (Tensor<B, D>, Tensor<B, D>, Option<Tensor<B, D>>);

impl FusedSgd {
    /// The host pass on a host backend, the kernel on a cubecl backend, for flat f32 tensors;
    /// declines (handing everything back) otherwise.
    fn one_pass<B: Backend, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        velocity: Option<Tensor<B, D>>,
        extras: Extras,
    ) -> Result<Passed<B, D>, Declined<B, D>> {
        let f32s = tensor.dtype() == DType::F32
            && grad.dtype() == DType::F32
            && velocity.as_ref().is_none_or(|v| v.dtype() == DType::F32);
        if D != 1 || !f32s {
            return Err((tensor, grad, velocity));
        }
        match HostBackend::of::<B>() {
            Some(backend) => Ok(self.host_step(backend, lr, tensor, grad, velocity, extras)),
            None if kernel_available::<B>() => {
                Ok(self.kernel_step(lr, tensor, grad, velocity, extras))
            }
            None => Err((tensor, grad, velocity)),
        }
    }
}

impl FusedSgd {
    /// One pass over host memory: the parameter's and the velocity's buffers updated in place
    /// when nothing else holds them (copies otherwise). A half-precision copy the backend
    /// cannot hold (NdArray) is left to the caller.
    fn host_step<B: Backend, const D: usize>(
        &self,
        backend: HostBackend,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        velocity: Option<Tensor<B, D>>,
        extras: Extras,
    ) -> Passed<B, D> {
        let shape = tensor.shape();
        let numel = shape.num_elements();
        let first = velocity.is_none();
        let mut v = self.momentum.map(|_| match velocity {
            Some(v) => writable(host(v), backend),
            None => HostTensor::zeros::<f32>(backend, numel),
        });
        let mut p = writable(host(tensor), backend);
        let g = host(grad).into_contiguous();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let step = self.step_of(lr, first, extras.factor);
        let param = p.as_mut_slice::<f32>().expect("made writable");
        let grad = g.as_slice::<f32>().expect("contiguous f32");
        let velocity = v
            .as_mut()
            .map(|v| v.as_mut_slice::<f32>().expect("made writable"));
        let copy = extras.copy.filter(|&dtype| backend.supports(dtype));
        let copy = stepped_with_copy(backend, copy, numel, |copy| match copy {
            None => sgd_step(&step, param, grad, velocity, threads),
            Some(into) => sgd_step_copying(&step, param, grad, velocity, into, threads),
        });
        let back = |t: HostTensor| shaped::<B, D>(t.into_primitive::<B>(), &shape);
        (back(p), v.map(back), copy.map(back))
    }
}

impl FusedSgd {
    /// Burn's `Sgd` step as Burn writes it, operation by operation, for the backends and
    /// dtypes the one-pass path does not take.
    pub(crate) fn burn_ops_step<B: Backend, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        velocity: Option<Tensor<B, D>>,
    ) -> (Tensor<B, D>, Option<Tensor<B, D>>) {
        let mut grad = grad;
        if let Some(penalty) = self.weight_decay {
            grad = tensor.clone().mul_scalar(penalty).add(grad);
        }
        let mut kept = None;
        if let Some(m) = self.momentum {
            let momentum = m.momentum as f32;
            let v = match velocity {
                Some(v) => grad
                    .clone()
                    .mul_scalar(1.0 - m.dampening)
                    .add(v.mul_scalar(momentum)),
                None => grad.clone(),
            };
            grad = if m.nesterov {
                v.clone().mul_scalar(momentum).add(grad)
            } else {
                v.clone()
            };
            kept = Some(v);
        }
        (tensor - grad.mul_scalar(lr), kept)
    }
}

impl FusedSgd {
    /// One kernel launch: the parameter and velocity are written in their own buffers when
    /// nothing else holds them, new ones otherwise.
    fn kernel_step<B: Backend, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        velocity: Option<Tensor<B, D>>,
        extras: Extras,
    ) -> Passed<B, D> {
        let shape = tensor.shape();
        let step = self.step_of(lr, velocity.is_none(), extras.factor);
        // Every tensor was checked to be f32 with the parameter's shape, so the kernel cannot
        // refuse them; they are handed over without another reference, so that their buffers
        // can be updated in place.
        let (p, v, copy) = sgd_step_kernel_copying::<B>(
            &step,
            primitive(tensor),
            primitive(grad),
            velocity.map(primitive::<B, D>),
            extras.copy,
        )
        .expect("the backend has a kernel (checked by the caller)")
        .unwrap_or_else(|error| panic!("the fused SGD kernel refused an f32 step: {error}"));
        let back = |t| shaped::<B, D>(t, &shape);
        (back(p), v.map(back), copy.map(back))
    }
}
