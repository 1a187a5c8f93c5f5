//! One side of a `ZeroOptimizer`: the masters, state and step of the parameters kept in one
//! place (the device, or the host backend).
//!
//! A step runs in phases, each in its own module: [`collect`] takes this side's gradients out
//! of Burn's `GradientsParams`, [`prepare`] accumulates them and joins each chunk's, [`factor`]
//! turns every rank's statistics into the unscale/clip factor, and [`apply`] steps the masters
//! ([`chunked`] one flat master per chunk, with [`pending`] holding what waits for the module
//! walk) and writes the new values back. [`owned`] says which parameters this side steps;
//! [`record`] saves and restores its state.

pub(crate) mod apply;
mod chunked;
mod collect;
mod factor;
pub(crate) mod owned;
mod pending;
pub(crate) mod prepare;
mod record;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_zero_core::{MemoryKind, ZeroState};

use crate::clip::NormType;
use crate::loss_scale::{DynamicLossScaler, LossScalerConfig};
use crate::master::Master;
use crate::masters::Masters;
use crate::one_pass::OnePassFn;
use crate::place::Place;
use owned::{Owned, keep_host_gradients};

/// One side of a [`crate::ZeroOptimizer`]: the parameters whose fp32 masters, optimizer
/// state and gradient accumulators live where `P` places them (the model's device, or the
/// optimizer's host backend), stepped there with the [`SimpleOptimizer`] `O`.
///
/// - The gradient of each parameter is this rank's shard of the mean over ranks (stages 1–3),
///   or the whole mean (stage 0 and replicated parameters).
/// - The optimizer runs on an fp32 master copy of that part, whatever the parameter's dtype;
///   its state covers that part only, so it is 1/N of the usual size.
/// - The result is written back in the parameter's dtype: as the parameter's new shard
///   (stage 3), or all-gathered into the replicated parameter (stages 1 and 2). Every
///   parameter stays marked for the gradient hooks.
/// - The device side also holds the step's clipping, loss scaler and skipped steps: the global
///   norm and the overflow flag of both sides travel in one all-reduce.
pub(crate) struct Side<O, B: Backend, P: Place<B>>
where
    O: SimpleOptimizer<P::Host>,
{
    optim: O,
    /// The sharded module's state on this rank: parameter store and gradient reducer. `None`
    /// for an optimizer made with [`ZeroOptimizer::unbound`] until its binding record is
    /// loaded.
    zero: Option<ZeroState<B>>,
    /// The fp32 master copies and their optimizer state, by parameter and by chunk.
    masters: Masters<O, P::Host>,
    clipping: Option<(f32, NormType)>,
    scaler: Option<DynamicLossScaler>,
    skipped: usize,
    last_norm: Option<f32>,
    /// Micro-steps per optimizer step, fp32 gradient accumulators by key, micro-steps so far.
    accumulation: usize,
    accumulated: BTreeMap<usize, Tensor<P::Host, 1>>,
    micro_steps: usize,
    /// The rank and world size of the group this optimizer last stepped (or whose record it
    /// loaded): a record only fits the same rank of a group of the same size.
    placement: Option<(usize, usize)>,
    /// Bytes of one master copy's optimizer state, given the state and the copy's length.
    state_size: StateSize<O, P::Host>,
    /// The optimizer's one-pass step (gradient multiplier and parameter cast in its pass),
    /// when its configuration has one ([`crate::OptimizerConfig::one_pass`]).
    one_pass: Option<OnePassFn<O, P::Host>>,
    /// The bytes of masters, state and accumulators last reported to the memory accounting
    /// (`None` until the first step with a gradient).
    tracked: Option<[usize; 3]>,
    /// The parameters this optimizer steps (all of them, but for a split optimizer's two sides).
    owned: Owned,
}

/// Bytes of an optimizer's state for a master copy of `numel` elements.
pub(crate) type StateSize<O, H> = fn(&<O as SimpleOptimizer<H>>::State<1>, usize) -> usize;

impl<O, B: Backend, P: Place<B>> Clone for Side<O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    fn clone(&self) -> Self {
        Self {
            optim: self.optim.clone(),
            zero: self.zero.clone(),
            masters: self.masters.clone(),
            clipping: self.clipping,
            scaler: self.scaler.clone(),
            skipped: self.skipped,
            last_norm: self.last_norm,
            accumulation: self.accumulation,
            accumulated: self.accumulated.clone(),
            micro_steps: self.micro_steps,
            placement: self.placement,
            state_size: self.state_size,
            one_pass: self.one_pass,
            tracked: self.tracked,
            owned: self.owned.clone(),
        }
    }
}

/// The state `zero` holds, or a panic that says the optimizer was never bound.
fn bound<B: Backend>(zero: &Option<ZeroState<B>>) -> &ZeroState<B> {
    zero.as_ref().unwrap_or_else(|| {
        panic!(
            "burn-zero: this ZeroOptimizer was made with `ZeroOptimizer::unbound` and never bound \
             to a sharded module: load `ZeroOptimizerRecord::binding(zero_state)` into it on each \
             rank (or build it with `ZeroOptimizer::new(&zero_state, config)`)"
        )
    })
}

impl<O, B: Backend, P: Place<B>> Side<O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// An optimizer with no state yet that steps the `owned` parameters.
    pub(crate) fn fresh_owning(
        zero: Option<ZeroState<B>>,
        optim: O,
        state_size: StateSize<O, P::Host>,
        owned: Owned,
    ) -> Self {
        if let Some(zero) = &zero {
            keep_host_gradients::<B, P>(zero, &owned);
        }
        Self {
            optim,
            zero,
            masters: Masters::default(),
            clipping: None,
            scaler: None,
            skipped: 0,
            last_norm: None,
            accumulation: 1,
            accumulated: BTreeMap::new(),
            micro_steps: 0,
            placement: None,
            state_size,
            one_pass: None,
            tracked: None,
            owned,
        }
    }

    /// The sharded module's state this side steps (`None` while an optimizer made with
    /// [`crate::ZeroOptimizer::unbound`] is not bound yet).
    pub(crate) fn zero_state(&self) -> Option<&ZeroState<B>> {
        self.zero.as_ref()
    }

    /// Binds this side to `zero`, stepping its `owned` parameters.
    pub(crate) fn bind(&mut self, zero: &ZeroState<B>, owned: Owned) {
        keep_host_gradients::<B, P>(zero, &owned);
        self.zero = Some(zero.clone());
        self.owned = owned;
    }

    /// Steps with `one_pass` (the optimizer's one-pass step on this side's backend), or with
    /// the optimizer's own step when there is none.
    pub(crate) fn set_one_pass(&mut self, one_pass: Option<OnePassFn<O, P::Host>>) {
        self.one_pass = one_pass;
    }

    /// Gradient accumulation: [`Self::step`] is called every micro-step and updates the
    /// parameters every `micro_steps` calls, with the mean of the micro-steps' gradients.
    ///
    /// Each micro-step's gradients are still reduced across ranks when its backward ends, and
    /// added here into fp32 accumulators of this rank's shard: communication every micro-step,
    /// in exchange for accumulators of 1/N of the model (4Ψ/N bytes) instead of full unreduced
    /// gradients. No micro-step's gradient is dropped: one a rank did not compute is reduced
    /// as zeros and arrives as an orphan.
    pub(crate) fn with_accumulation(mut self, micro_steps: usize) -> Self {
        self.accumulation = micro_steps.max(1);
        self
    }

    /// Scales every gradient so that their global `norm` (over all ranks' shards, counting
    /// replicated parameters once) is at most `max_norm`, as `clip_grad_norm_` does.
    pub(crate) fn with_clipping(mut self, max_norm: f32, norm: NormType) -> Self {
        self.clipping = Some((max_norm, norm));
        self
    }

    /// Dynamic loss scaling: multiply the loss by [`Self::loss_scale`] before backward; the
    /// step unscales the gradients, and skips itself on every rank when any gradient is not
    /// finite.
    pub(crate) fn with_loss_scaler(mut self, config: LossScalerConfig) -> Self {
        self.scaler = Some(DynamicLossScaler::new(config));
        self
    }

    /// The current loss scale (1 without a scaler).
    pub(crate) fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, DynamicLossScaler::scale)
    }

    /// Steps skipped because a gradient overflowed.
    pub(crate) fn skipped_steps(&self) -> usize {
        self.skipped
    }

    /// The global gradient norm (unscaled) of the last step, when clipping or scaling is on.
    pub(crate) fn last_grad_norm(&self) -> Option<f32> {
        self.last_norm
    }

    /// Bytes of fp32 gradient accumulators this rank holds.
    pub(crate) fn accumulator_bytes(&self) -> usize {
        self.accumulated
            .values()
            .map(|t| t.shape().num_elements() * DType::F32.size())
            .sum()
    }

    /// Bytes of optimizer state this rank holds (e.g. Adam's two moments per master copy).
    pub(crate) fn state_bytes(&self) -> usize {
        self.masters
            .iter()
            .filter_map(|m| {
                let numel = m.values.shape().num_elements();
                m.state.as_ref().map(|s| (self.state_size)(s, numel))
            })
            .sum()
    }

    /// Bytes of chunk `id`'s flat master and its state, when it has one.
    pub(crate) fn flat_bytes(&self, id: usize) -> Option<usize> {
        self.masters
            .of_chunk(id)
            .map(|m| self.master_state_bytes(m))
    }

    /// Bytes of parameter `key`'s own master and its state, when it has one.
    pub(crate) fn master_entry_bytes(&self, key: usize) -> Option<usize> {
        self.masters
            .of_param(key)
            .map(|m| self.master_state_bytes(m))
    }

    fn master_state_bytes(&self, master: &Master<O, P::Host>) -> usize {
        let numel = master.values.shape().num_elements();
        numel * DType::F32.size()
            + master
                .state
                .as_ref()
                .map_or(0, |state| (self.state_size)(state, numel))
    }

    /// Shows the current masters, state and accumulators in the module's memory accounting.
    pub(crate) fn report_memory(&mut self) {
        let now = [
            self.master_bytes(),
            self.state_bytes(),
            self.accumulator_bytes(),
        ];
        let Some(zero) = &self.zero else {
            // Unbound: nothing to account in yet; the first step after binding reports it.
            return;
        };
        let memory = zero.memory();
        if let Some(reported) = &mut self.tracked {
            let kinds = if P::STATE_ON_HOST {
                [
                    MemoryKind::HostMasterWeights,
                    MemoryKind::HostOptimizerState,
                    MemoryKind::HostGradientAccumulators,
                ]
            } else {
                [
                    MemoryKind::MasterWeights,
                    MemoryKind::OptimizerState,
                    MemoryKind::GradientAccumulators,
                ]
            };
            for ((kind, was), is) in kinds.into_iter().zip(reported.iter_mut()).zip(now) {
                memory.sub(kind, *was);
                memory.add(kind, is);
                *was = is;
            }
        }
    }

    /// Bytes of fp32 master copies this rank holds.
    pub(crate) fn master_bytes(&self) -> usize {
        self.masters
            .iter()
            .map(|m| m.values.shape().num_elements() * DType::F32.size())
            .sum()
    }

    /// Remembers which rank of which group size this optimizer steps for; refuses state that
    /// another rank, or a group of another size, produced.
    fn check_placement(&mut self) {
        let zero = bound(&self.zero);
        let here = (zero.rank(), zero.world_size());
        match self.placement {
            Some(saved) if saved != here => panic!(
                "burn-zero: this optimizer's state belongs to rank {} of {} but it steps rank {} \
                 of {}: load each rank's own record, into a group of the same size",
                saved.0, saved.1, here.0, here.1
            ),
            _ => self.placement = Some(here),
        }
    }

    /// The sharded module's state, or a panic that says the optimizer was never bound.
    pub(crate) fn bound_state(&self) -> &ZeroState<B> {
        bound(&self.zero)
    }

    /// Micro-steps taken in the current accumulation window.
    pub(crate) fn micro_steps(&self) -> usize {
        self.micro_steps
    }

    /// Whether this side steps the parameter of `key`.
    pub(crate) fn steps(&self, key: usize) -> bool {
        self.owned.steps(key)
    }

    /// Counts a step skipped on every rank (a gradient overflowed).
    pub(crate) fn count_skipped(&mut self) {
        self.skipped += 1;
    }

    /// The masters and their optimizer state, to move some between sides.
    pub(crate) fn masters_mut(&mut self) -> &mut Masters<O, P::Host> {
        &mut self.masters
    }

    /// Stops stepping the parameters of `keys` (a host side, whose keys are listed).
    pub(crate) fn give_up(&mut self, keys: &HashSet<usize>) -> Arc<HashSet<usize>> {
        let kept: HashSet<usize> = match &self.owned {
            Owned::Only(owned) => owned.difference(keys).copied().collect(),
            Owned::All | Owned::Except(_) => unreachable!("only a host side gives keys up"),
        };
        let kept = Arc::new(kept);
        self.owned = Owned::Only(kept.clone());
        kept
    }

    /// Steps every parameter but those of `keys` (a device side, after a host side gave some up).
    pub(crate) fn step_all_but(&mut self, keys: Arc<HashSet<usize>>) {
        self.owned = Owned::Except(keys);
    }
}
