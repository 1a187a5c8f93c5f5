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
//! Burn's `SgdState` keeps its velocity private, so the one-pass path could not read it;
//! [`FusedSgdState`] holds the same tensor under the same field names, so its record is
//! Burn's record, field for field, and checkpoints move between the fused and the per-tensor
//! path.

use burn::optim::{LearningRate, SgdConfig, SimpleOptimizer};
use burn::record::Record;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Device, Tensor};
use burn_zero_kernels::host::{HostBackend, HostTensor, SgdMomentum, SgdStep, sgd_step};
use burn_zero_kernels::{kernel_available, sgd_step_kernel};

use crate::fused::{FusedConfigError, host, primitive, serialised, shaped, writable};

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
    fn step_of(&self, lr: LearningRate, first: bool) -> SgdStep {
        SgdStep {
            lr: lr as f32,
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
        let f32s = tensor.dtype() == DType::F32
            && grad.dtype() == DType::F32
            && velocity.as_ref().is_none_or(|v| v.dtype() == DType::F32);
        let (tensor, velocity) = match HostBackend::of::<B>() {
            Some(backend) if D == 1 && f32s => self.host_step(backend, lr, tensor, grad, velocity),
            None if D == 1 && f32s && kernel_available::<B>() => {
                self.kernel_step(lr, tensor, grad, velocity)
            }
            _ => self.burn_ops_step(lr, tensor, grad, velocity),
        };
        let momentum = velocity.map(|velocity| Velocity { velocity });
        (tensor, Some(FusedSgdState { momentum }))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        state.momentum = state.momentum.map(|m| Velocity {
            velocity: m.velocity.to_device(device),
        });
        state
    }
}

impl FusedSgd {
    /// One pass over host memory: the parameter's and the velocity's buffers updated in place
    /// when nothing else holds them (copies otherwise).
    fn host_step<B: Backend, const D: usize>(
        &self,
        backend: HostBackend,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        velocity: Option<Tensor<B, D>>,
    ) -> (Tensor<B, D>, Option<Tensor<B, D>>) {
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
        sgd_step(
            &self.step_of(lr, first),
            p.as_mut_slice::<f32>().expect("made writable"),
            g.as_slice::<f32>().expect("contiguous f32"),
            v.as_mut()
                .map(|v| v.as_mut_slice::<f32>().expect("made writable")),
            threads,
        );
        let back = |t: HostTensor| shaped::<B, D>(t.into_primitive::<B>(), &shape);
        (back(p), v.map(back))
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
    ) -> (Tensor<B, D>, Option<Tensor<B, D>>) {
        let shape = tensor.shape();
        let step = self.step_of(lr, velocity.is_none());
        // Every tensor was checked to be f32 with the parameter's shape, so the kernel cannot
        // refuse them; they are handed over without another reference, so that their buffers
        // can be updated in place.
        let (p, v) = sgd_step_kernel::<B>(
            &step,
            primitive(tensor),
            primitive(grad),
            velocity.map(primitive::<B, D>),
        )
        .expect("the backend has a kernel (checked by the caller)")
        .unwrap_or_else(|error| panic!("the fused SGD kernel refused an f32 step: {error}"));
        let back = |t| shaped::<B, D>(t, &shape);
        (back(p), v.map(back))
    }
}
