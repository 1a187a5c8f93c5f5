//! Optimizer state split between the device and the host by chunk: ColossalAI's HybridAdam
//! under Gemini's `offload_optim_frac`.
//!
//! A fraction of the trainable chunks (whole chunks in layout order, by the bytes of their
//! masters on this rank) keep their fp32 masters, optimizer state and accumulators on a host
//! backend and step there; the others keep them on the device and step there. Offloading
//! everything (`ZeroOptimizer::offloaded`) frees the most device memory but moves every
//! gradient and every new parameter value across the bus each step; keeping everything on the
//! device moves nothing but holds 12 bytes per parameter there (Adam). The fraction trades
//! one for the other where the device has room for part of the state.
//!
//! Two [`ZeroOptimizer`]s do the work, one per side, each stepping only its own parameters;
//! the step's statistics (the clipping norm and the overflow flag) are taken over both and
//! combined in one all-reduce, so clipping and loss scaling see the whole model. The host
//! chunks' gradient shards go to host memory as their reduction delivers them, during backward;
//! the device chunks' stay on the device.
//!
//! Elementwise optimizers (Burn's Adam, AdamW and SGD; the fused ones) give each parameter the
//! same values on either side when both sides compute alike (Flex beside Flex, bitwise). The
//! clipping norm is summed per side and then across sides, so with clipping the sum is added
//! in another order than with one side: equal within the rounding of that sum.

use std::collections::HashSet;
use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::optim::{
    GradientsParams, LearningRate, MultiGradientsParams, Optimizer, SimpleOptimizer,
};
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{DType, Device};
use burn_zero_core::chunk::placement::{member_keys, optimizer_host_chunks};
use burn_zero_core::{Zero, ZeroState};

use crate::clip::{NormType, merge};
use crate::loss_scale::LossScalerConfig;
use crate::one_pass::OnePass;
use crate::optimizer::{Owned, Prepared, Refill, ZeroOptimizer, check_lr, one_device};
use crate::placement::{Offload, OnDevice};
use crate::record::ZeroOptimizerRecord;
use crate::state::StateBytes;

mod margin;
mod migrate;
mod record;

pub use margin::MarginReport;

use margin::Margin;

/// A split that cannot be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SplitError {
    /// The fraction is not one.
    #[error("offload_optim_frac must be a fraction from 0 to 1, not {0}")]
    Fraction(f64),
    /// The margin ratio is not one.
    #[error("gpu_margin_mem_ratio must be a fraction from 0 to 1, not {0}")]
    MarginRatio(f64),
    /// The margin is shared out of the auto placement's room, and there is none.
    #[error(
        "gpu_margin_mem_ratio shares out the device memory the auto placement leaves over; \
         shard with auto_placement_capacity_mib or auto_placement_device_capacity"
    )]
    NoAutoPlacement,
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

/// [`ZeroOptimizer`] with the optimizer state of a fraction of the chunks on host backend `H`
/// (stepped there) and the rest on the model's device (stepped there); see the module docs.
pub struct SplitZeroOptimizer<O, B: Backend, H: Backend>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// The device side; it also holds the step's clipping, loss scaler and skipped steps.
    device: ZeroOptimizer<O, B, OnDevice>,
    host: ZeroOptimizer<O, B, Offload<H>>,
    /// The chunks that step on the host, in layout order.
    host_chunks: Vec<usize>,
    /// The `gpu_margin_mem_ratio` policy, when asked for.
    margin: Option<Margin>,
}

impl<O, B: Backend, H: Backend> Clone for SplitZeroOptimizer<O, B, H>
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

impl<O, B: Backend, H: Backend> SplitZeroOptimizer<O, B, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
    <O as SimpleOptimizer<B>>::State<1>: StateBytes,
    <O as SimpleOptimizer<H>>::State<1>: StateBytes,
{
    /// Wraps `optim` to step the module `zero` belongs to, with the state of the first
    /// `offload_optim_frac` (0 to 1) of the trainable chunks' bytes on `H`'s default device.
    /// The layout is the module's chunk layout (`ZeroConfig::chunk_size`; with one parameter
    /// per chunk the fraction is taken parameter by parameter).
    pub fn new(zero: &ZeroState<B>, optim: O, offload_optim_frac: f64) -> Result<Self, SplitError> {
        if !(0.0..=1.0).contains(&offload_optim_frac) {
            return Err(SplitError::Fraction(offload_optim_frac));
        }
        let layout = zero.store().chunks();
        let ids = optimizer_host_chunks(layout, offload_optim_frac);
        let keys: Arc<HashSet<usize>> = Arc::new(member_keys(layout, &ids));
        let device = ZeroOptimizer::fresh_owning(
            Some(zero.clone()),
            optim.clone(),
            <<O as SimpleOptimizer<B>>::State<1> as StateBytes>::state_bytes,
            Owned::Except(keys.clone()),
        );
        let host = ZeroOptimizer::fresh_owning(
            Some(zero.clone()),
            optim,
            <<O as SimpleOptimizer<H>>::State<1> as StateBytes>::state_bytes,
            Owned::Only(keys),
        );
        Ok(Self {
            device,
            host,
            host_chunks: ids,
            margin: None,
        })
    }
}

impl<O, B: Backend, H: Backend> SplitZeroOptimizer<O, B, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// Steps with the optimizer's one pass on both sides ([`ZeroOptimizer::with_one_pass`]).
    pub fn with_one_pass(mut self) -> Self
    where
        O: OnePass<B> + OnePass<H>,
    {
        self.device = self.device.with_one_pass();
        self.host = self.host.with_one_pass();
        self
    }

    /// Gradient accumulation over `micro_steps` ([`ZeroOptimizer::with_accumulation`]).
    pub fn with_accumulation(mut self, micro_steps: usize) -> Self {
        self.device = self.device.with_accumulation(micro_steps);
        self.host = self.host.with_accumulation(micro_steps);
        self
    }

    /// Global gradient clipping over both sides ([`ZeroOptimizer::with_clipping`]).
    pub fn with_clipping(mut self, max_norm: f32, norm: NormType) -> Self {
        self.device = self.device.with_clipping(max_norm, norm);
        self
    }

    /// Dynamic loss scaling over both sides ([`ZeroOptimizer::with_loss_scaler`]).
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

    /// One optimizer step with learning rate `lr`, as [`ZeroOptimizer::step`]: each side
    /// steps its own parameters with one factor from statistics over both.
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
                    self.device.skipped += 1;
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

impl<M, AB, O, B, H> Optimizer<M, AB> for SplitZeroOptimizer<O, B, H>
where
    M: AutodiffModule<AB>,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = Device<B>>,
    B: Backend,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// The whole state on the host backend (see [`SplitZeroOptimizer::record`]).
    type Record = ZeroOptimizerRecord<O, B, Offload<H>>;

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        SplitZeroOptimizer::step::<AB, M>(self, lr, module, grads)
    }

    /// One entry, as [`ZeroOptimizer`] accepts: one rank per device.
    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        let grads = one_device(grads, "SplitZeroOptimizer");
        SplitZeroOptimizer::step::<AB, M>(self, lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        self.restore(record)
    }
}
