//! [`ZeroOptimizer`]: each rank steps its own share of the model — every chunk where the
//! placement keeps it, on the device or on a host backend — with the fused step by default.
//!
//! The placement comes from the sharded module's `ZeroConfig::placement` (ColossalAI Gemini's
//! `placement_policy` with `offload_optim_frac` and `gpu_margin_mem_ratio`; DeepSpeed's
//! `offload_optimizer`): the first `offload_optim_frac` of the trainable chunks (whole chunks
//! in layout order, by the bytes of their masters on this rank) keep their fp32 masters,
//! optimizer state and accumulators on the host backend `H` and step there; the others keep
//! them on the device and step there. Keeping everything on the device moves nothing but holds
//! 12 bytes per parameter there (Adam); offloading everything frees that memory but moves every
//! gradient and every new parameter value across the bus each step.
//!
//! Two sides do the work, one per place, each stepping only its own parameters; the step's
//! statistics (the clipping norm and the overflow flag) are taken over both and combined in
//! one all-reduce, so clipping and loss scaling see the whole model. The host chunks' gradient
//! shards go to host memory as their reduction delivers them, during backward; the device
//! chunks' stay on the device.
//!
//! Elementwise optimizers (Burn's Adam, AdamW and SGD; the fused ones) give each parameter the
//! same values on either side when both sides compute alike (Flex beside Flex, bitwise). The
//! clipping norm is summed per side and then across sides, so with clipping and both sides
//! holding parameters the sum is added in another order than with one side: equal within the
//! rounding of that sum.

use std::collections::HashSet;
use std::sync::Arc;

use burn::backend::Flex;
use burn::module::AutodiffModule;
use burn::optim::{
    GradientsParams, LearningRate, MultiGradientsParams, Optimizer, SimpleOptimizer,
};
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{DType, Device};
use burn_zero_core::chunk::placement::{member_keys, optimizer_host_chunks};
use burn_zero_core::{Zero, ZeroState};

use crate::clip::{NormType, merge};
use crate::error::OptimizerError;
use crate::fused::FusedAdam;
use crate::loss_scale::LossScalerConfig;
use crate::place::{Offload, OnDevice};
use crate::record::ZeroOptimizerRecord;
use crate::rule::OptimizerConfig;
use crate::side::Side;
use crate::side::apply::Refill;
use crate::side::owned::Owned;
use crate::side::prepare::Prepared;
use crate::state::StateBytes;

mod margin;
mod migrate;
mod record;

pub use margin::MarginReport;

use margin::Margin;

/// Steps every parameter of a module sharded with `burn_zero_core::shard` on this rank's part
/// only: the fp32 master of each chunk's shard (the whole of a replicated chunk), with the
/// optimizer `O` built from a Burn config ([`OptimizerConfig`]: `AdamConfig`, `AdamWConfig`
/// and `SgdConfig` give the fused step; [`crate::PerTensor`] any Burn `SimpleOptimizer`),
/// each chunk where the module's placement keeps it: on the device, or on the host backend `H`
/// (Flex unless named). See the module documentation.
///
/// - The result is written back in the parameter's dtype: as the parameter's new shard
///   (stage 3), or all-gathered into the replicated parameter (stages 1 and 2).
/// - Optional global gradient clipping ([`Self::with_clipping`]), dynamic loss scaling
///   ([`Self::with_loss_scaler`]) and gradient accumulation ([`Self::with_accumulation`]).
/// - It is a Burn [`Optimizer`], so it drops into an ordinary training loop and burn-train's
///   `Learner`; its record ([`ZeroOptimizerRecord`]) is this rank's part only, every entry on
///   the host backend, and loads under any placement.
///
/// It is built from the [`ZeroState`] that `shard` returned for the module, and steps that
/// module's parameters; the handle is an `Arc`, so the optimizer may be moved to and stepped on
/// any thread. Call [`ZeroOptimizer::step`] on every rank with that rank's gradients.
pub struct ZeroOptimizer<B: Backend, O = FusedAdam, H: Backend = Flex>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// The device side; it also holds the step's clipping, loss scaler and skipped steps.
    device: Side<O, B, OnDevice>,
    host: Side<O, B, Offload<H>>,
    /// The chunks that step on the host, in layout order.
    host_chunks: Vec<usize>,
    /// The `gpu_margin_mem_ratio` policy, when asked for.
    margin: Option<Margin>,
}

impl<B: Backend, O, H: Backend> Clone for ZeroOptimizer<B, O, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    fn clone(&self) -> Self {
        Self {
            device: self.device.clone(),
            host: self.host.clone(),
            host_chunks: self.host_chunks.clone(),
            margin: self.margin,
        }
    }
}

impl<B: Backend, O> ZeroOptimizer<B, O, Flex>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<Flex>,
    <O as SimpleOptimizer<B>>::State<1>: StateBytes,
    <O as SimpleOptimizer<Flex>>::State<1>: StateBytes,
{
    /// Steps the module `zero` belongs to with the optimizer `config` makes (fused for
    /// `AdamConfig`, `AdamWConfig` and `SgdConfig`), each chunk where the module's placement
    /// keeps it, Flex holding what lives on the host. Refuses a configuration that cannot work,
    /// by name.
    pub fn new<C>(zero: &ZeroState<B>, config: C) -> Result<Self, OptimizerError>
    where
        C: OptimizerConfig<Optimizer = O>,
    {
        Self::with_host(zero, config)
    }

    /// [`Self::new`] before the module it will step is sharded, for a training framework that
    /// takes the optimizer first and shards on each rank later (burn-train's `Learner` under
    /// `ZeroStrategy`). The framework binds it to the rank's [`ZeroState`] by loading
    /// [`ZeroOptimizerRecord::binding`] into it; stepping it unbound panics, naming the
    /// problem.
    pub fn unbound<C>(config: C) -> Result<Self, OptimizerError>
    where
        C: OptimizerConfig<Optimizer = O>,
    {
        Self::unbound_with_host(config)
    }
}

impl<B: Backend, O, H: Backend> ZeroOptimizer<B, O, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
    <O as SimpleOptimizer<B>>::State<1>: StateBytes,
    <O as SimpleOptimizer<H>>::State<1>: StateBytes,
{
    /// [`ZeroOptimizer::new`] with `H` (NdArray, or another host backend) holding what lives
    /// on the host: `ZeroOptimizer::<B, _, NdArray>::with_host(&zero, AdamConfig::new())`.
    pub fn with_host<C>(zero: &ZeroState<B>, config: C) -> Result<Self, OptimizerError>
    where
        C: OptimizerConfig<Optimizer = O>,
    {
        let mut optimizer = Self::unbound_with_host(config)?;
        optimizer.bind(zero);
        Ok(optimizer)
    }

    /// [`ZeroOptimizer::unbound`] with `H` holding what lives on the host.
    pub fn unbound_with_host<C>(config: C) -> Result<Self, OptimizerError>
    where
        C: OptimizerConfig<Optimizer = O>,
    {
        let optim = config.optimizer()?;
        let mut device = Side::fresh_owning(
            None,
            optim.clone(),
            <<O as SimpleOptimizer<B>>::State<1> as StateBytes>::state_bytes,
            Owned::All,
        );
        device.set_one_pass(C::one_pass::<B>());
        let mut host = Side::fresh_owning(
            None,
            optim,
            <<O as SimpleOptimizer<H>>::State<1> as StateBytes>::state_bytes,
            Owned::Only(Arc::default()),
        );
        host.set_one_pass(C::one_pass::<H>());
        Ok(Self {
            device,
            host,
            host_chunks: Vec::new(),
            margin: None,
        })
    }
}

impl<B: Backend, O, H: Backend> ZeroOptimizer<B, O, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// Binds both sides to `zero`, placing each trainable chunk's state as the module's
    /// placement says.
    fn bind(&mut self, zero: &ZeroState<B>) {
        let placement = zero.store().config().placement;
        let layout = zero.store().chunks();
        let ids = optimizer_host_chunks(layout, placement.offload_optim_frac);
        let keys: Arc<HashSet<usize>> = Arc::new(member_keys(layout, &ids));
        self.device.bind(zero, Owned::Except(keys.clone()));
        self.host.bind(zero, Owned::Only(keys));
        self.host_chunks = ids;
        self.margin = (placement.gpu_margin_mem_ratio > 0.0).then_some(Margin {
            ratio: placement.gpu_margin_mem_ratio,
            shared: None,
        });
    }

    /// The sharded module's state this optimizer steps (`None` while an optimizer made with
    /// [`ZeroOptimizer::unbound`] is not bound yet).
    pub fn zero_state(&self) -> Option<&ZeroState<B>> {
        self.device.zero_state()
    }

    /// Bytes of fp32 master copies this rank holds, device and host together.
    pub fn master_bytes(&self) -> usize {
        self.device.master_bytes() + self.host.master_bytes()
    }

    /// Bytes of optimizer state this rank holds (e.g. Adam's two moments per master copy),
    /// device and host together.
    pub fn state_bytes(&self) -> usize {
        self.device.state_bytes() + self.host.state_bytes()
    }

    /// Bytes of fp32 gradient accumulators this rank holds, device and host together.
    pub fn accumulator_bytes(&self) -> usize {
        self.device.accumulator_bytes() + self.host.accumulator_bytes()
    }
}

impl<B: Backend, O, H: Backend> ZeroOptimizer<B, O, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// Gradient accumulation: [`Self::step`] is called every micro-step and updates the
    /// parameters every `micro_steps` calls, with the mean of the micro-steps' gradients.
    ///
    /// Each micro-step's gradients are still reduced across ranks when its backward ends, and
    /// added into fp32 accumulators of this rank's shard: communication every micro-step, in
    /// exchange for accumulators of 1/N of the model (4Ψ/N bytes) instead of full unreduced
    /// gradients. No micro-step's gradient is dropped: one a rank did not compute is reduced
    /// as zeros and arrives as an orphan.
    pub fn with_accumulation(mut self, micro_steps: usize) -> Self {
        self.device = self.device.with_accumulation(micro_steps);
        self.host = self.host.with_accumulation(micro_steps);
        self
    }

    /// Scales every gradient so that their global `norm` (over all ranks' shards, both sides,
    /// counting replicated parameters once) is at most `max_norm`, as `clip_grad_norm_` does.
    pub fn with_clipping(mut self, max_norm: f32, norm: NormType) -> Self {
        self.device = self.device.with_clipping(max_norm, norm);
        self
    }

    /// Dynamic loss scaling: multiply the loss by [`Self::loss_scale`] before backward; the
    /// step unscales the gradients, and skips itself on every rank when any gradient is not
    /// finite.
    pub fn with_loss_scaler(mut self, config: LossScalerConfig) -> Self {
        self.device = self.device.with_loss_scaler(config);
        self
    }

    /// The current loss scale (1 without a scaler).
    pub fn loss_scale(&self) -> f64 {
        self.device.loss_scale()
    }

    /// Steps skipped because a gradient overflowed.
    pub fn skipped_steps(&self) -> usize {
        self.device.skipped_steps()
    }

    /// The global gradient norm (unscaled) of the last step, when clipping or scaling is on.
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.device.last_grad_norm()
    }

    /// The ids of the chunks that step on the host, in layout order.
    pub fn host_chunks(&self) -> &[usize] {
        &self.host_chunks
    }

    /// Bytes of fp32 masters and of optimizer state on the device and on the host:
    /// `((device masters, device state), (host masters, host state))`.
    pub fn bytes(&self) -> ((usize, usize), (usize, usize)) {
        (
            (self.device.master_bytes(), self.device.state_bytes()),
            (self.host.master_bytes(), self.host.state_bytes()),
        )
    }

    /// One optimizer step with learning rate `lr`: `module` updated with `grads` (from
    /// `GradientsParams::from_grads`), each side stepping its own parameters with one factor
    /// from statistics over both. Parameters without a gradient on any rank are left as they
    /// are; on an overflow every parameter and all optimizer state are left as they are.
    ///
    /// # Panics
    /// When `lr` is negative or not finite, before anything changes; when the optimizer was
    /// made unbound and never bound.
    pub fn step<AB, M>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M
    where
        AB: AutodiffBackend<InnerBackend = Zero<B>>,
        M: AutodiffModule<AB>,
    {
        check_lr(lr);
        self.share_margin();
        let mut grads = grads;
        // The reducer's orphans are taken once, by whichever side meets one first.
        let mut orphans = None;
        let on_device = self
            .device
            .collect::<AB, M>(&module, &mut grads, &mut orphans);
        let on_host = self
            .host
            .collect::<AB, M>(&module, &mut grads, &mut orphans);
        // Both sides count the same micro-steps: an accumulation window ends for both at once.
        let module = match (self.device.prepare(on_device), self.host.prepare(on_host)) {
            (Some(on_device), Some(on_host)) => match self.factor(&on_device, &on_host) {
                Some(factor) => {
                    let module = self.device.apply::<AB, M>(lr, factor, module, on_device);
                    self.host.apply::<AB, M>(lr, factor, module, on_host)
                }
                None => {
                    self.device.count_skipped();
                    tracing::warn!(scale = self.loss_scale(), "gradient overflow: step skipped");
                    self.refill::<AB, M>(module)
                }
            },
            _ => self.refill::<AB, M>(module),
        };
        self.device.report_memory();
        self.host.report_memory();
        module
    }

    /// The step's gradient factor from both sides' statistics, in one all-reduce.
    fn factor(&mut self, on_device: &Prepared<B, B>, on_host: &Prepared<B, H>) -> Option<f64> {
        let host = &self.host;
        let empty = on_device.is_empty() && on_host.is_empty();
        self.device.factor_of(empty, |device, norm_type| {
            merge(
                device.local_stats(on_device, norm_type),
                host.local_stats(on_host, norm_type),
                norm_type,
            )
        })
    }

    /// `module` with values as they are and gradient marks renewed; a shard released by
    /// `reuse_fp16_shard` is refilled from whichever side holds its master.
    fn refill<AB, M>(&self, module: M) -> M
    where
        AB: AutodiffBackend<InnerBackend = Zero<B>>,
        M: AutodiffModule<AB>,
    {
        let master = |key: usize, device: &B::Device, dtype: DType| {
            self.device
                .master_on_model(key, device, dtype)
                .or_else(|| self.host.master_on_model(key, device, dtype))
        };
        module.map(&mut Refill { master: &master })
    }
}

impl<M, AB, O, B, H> Optimizer<M, AB> for ZeroOptimizer<B, O, H>
where
    M: AutodiffModule<AB>,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = Device<B>>,
    B: Backend,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// The whole state on the host backend (see [`ZeroOptimizer::record`]).
    type Record = ZeroOptimizerRecord<B, O, H>;

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        ZeroOptimizer::step::<AB, M>(self, lr, module, grads)
    }

    /// Burn's multi-device gradients (one training process driving several devices) have one
    /// entry per device; burn-zero runs one rank per device instead, so exactly one entry is
    /// accepted.
    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        let grads = one_device(grads, "ZeroOptimizer");
        ZeroOptimizer::step::<AB, M>(self, lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        self.restore(record)
    }
}

/// The one device's gradients of Burn's multi-device gradients: burn-zero runs one rank per
/// device instead of one process driving several, so `optimizer` (named in the message)
/// accepts exactly one entry.
fn one_device(grads: MultiGradientsParams, optimizer: &str) -> GradientsParams {
    let devices = grads.grads.len();
    let mut grads = grads.grads.into_iter();
    match (grads.next(), grads.next()) {
        (Some((grads, _)), None) => grads,
        _ => panic!(
            "burn-zero: {optimizer} got gradients from {devices} devices in one step; burn-zero \
             runs one rank per device (burn_zero::comm::launch), each stepping its own gradients"
        ),
    }
}

/// Refuses a learning rate that cannot work, before anything changes.
fn check_lr(lr: f64) {
    assert!(
        lr.is_finite() && lr >= 0.0,
        "burn-zero: the learning rate {lr} is not a finite number of 0 or more; nothing was \
         stepped"
    );
}
