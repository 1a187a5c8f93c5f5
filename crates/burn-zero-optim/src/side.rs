//! One side of a `ZeroOptimizer`: the masters, state and step of the parameters kept in one
//! place (the device, or the host backend).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, MultiGradientsParams, SimpleOptimizer};
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{DType, Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_zero_comm::RankCounters;
use burn_zero_core::store::SharedRow;
use burn_zero_core::{MemoryKind, ShardedView, StepSite, Zero, ZeroState, ZeroTensor};

use crate::clip::{LocalStats, NormType, combine};
use crate::loss_scale::{DynamicLossScaler, LossScalerConfig};
use crate::master::{Master, cast_to};
use crate::masters::Masters;
use crate::one_pass::OnePassFn;
use crate::pending::{ChunkGrad, PendingChunks};
use crate::place::Place;

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
    pub(crate) optim: O,
    /// The sharded module's state on this rank: parameter store and gradient reducer. `None`
    /// for an optimizer made with [`ZeroOptimizer::unbound`] until its binding record is
    /// loaded.
    pub(crate) zero: Option<ZeroState<B>>,
    /// The fp32 master copies and their optimizer state, by parameter and by chunk.
    pub(crate) masters: Masters<O, P::Host>,
    clipping: Option<(f32, NormType)>,
    pub(crate) scaler: Option<DynamicLossScaler>,
    pub(crate) skipped: usize,
    last_norm: Option<f32>,
    /// Micro-steps per optimizer step, fp32 gradient accumulators by key, micro-steps so far.
    accumulation: usize,
    pub(crate) accumulated: BTreeMap<usize, Tensor<P::Host, 1>>,
    pub(crate) micro_steps: usize,
    /// The rank and world size of the group this optimizer last stepped (or whose record it
    /// loaded): a record only fits the same rank of a group of the same size.
    pub(crate) placement: Option<(usize, usize)>,
    /// Bytes of one master copy's optimizer state, given the state and the copy's length.
    state_size: StateSize<O, P::Host>,
    /// The optimizer's one-pass step (gradient multiplier and parameter cast in its pass),
    /// when its configuration has one ([`crate::OptimizerConfig::one_pass`]).
    pub(crate) one_pass: Option<OnePassFn<O, P::Host>>,
    /// The bytes of masters, state and accumulators last reported to the memory accounting
    /// (`None` until the first step with a gradient).
    tracked: Option<[usize; 3]>,
    /// The parameters this optimizer steps (all of them, but for a split optimizer's two sides).
    pub(crate) owned: Owned,
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

/// One parameter's gradient, taken out of `GradientsParams` (or the orphans) before the step.
pub(crate) struct Taken<H: Backend> {
    pub key: usize,
    /// This rank's part of the reduced gradient, flat, where the masters live.
    pub grad: Grad<H>,
}

/// A chunk's reduced row on the device, kept for the pass, and the same row where the masters
/// live.
type RowTaken<B, H> = (Arc<SharedRow<B>>, Tensor<H, 1>);

/// A parameter's gradient part: a tensor of its own, or its range of its chunk's reduced row
/// (the reduction delivers a sharded chunk's row whole), cut out only where it is read alone:
/// a chunk whose members are all ranges of one row steps that row as it is.
pub(crate) enum Grad<H: Backend> {
    Whole(Tensor<H, 1>),
    Part {
        row: Tensor<H, 1>,
        /// Which row: the same for every member delivered with it in this step.
        row_id: usize,
        range: Range<usize>,
    },
}

impl<H: Backend> Grad<H> {
    /// The gradient part as a tensor of its own (a view of the row, or a copy where the
    /// device's alignment needs one).
    pub(crate) fn tensor(&self) -> Tensor<H, 1> {
        match self {
            Grad::Whole(grad) => grad.clone(),
            Grad::Part { row, range, .. } if range.len() == row.dims()[0] => row.clone(),
            Grad::Part { row, range, .. } => row.clone().slice(range.clone()),
        }
    }
}

/// The state `zero` holds, or a panic that says the optimizer was never bound.
pub(crate) fn bound<B: Backend>(zero: &Option<ZeroState<B>>) -> &ZeroState<B> {
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

    /// First phase: takes the gradients of the parameters this optimizer steps out of `grads`
    /// (or out of the reducer's `orphans`, taken once for every optimizer of the step), to
    /// where the masters live.
    pub(crate) fn collect<AB, M>(
        &mut self,
        module: &M,
        grads: &mut GradientsParams,
        orphans: &mut Option<Orphans<B>>,
    ) -> Collected<B, P::Host>
    where
        AB: AutodiffBackend<InnerBackend = Zero<B>>,
        M: AutodiffModule<AB>,
    {
        let mut collect = Collect::<B, P> {
            zero: bound(&self.zero),
            owned: &self.owned,
            grads,
            orphans,
            taken: HashMap::new(),
            order: Vec::new(),
            values: HashMap::new(),
            rows: HashMap::new(),
            _placement: std::marker::PhantomData,
        };
        module.visit(&mut collect);
        let collected = Collected {
            taken: collect.taken,
            order: collect.order,
            values: collect.values,
        };
        if !collected.order.is_empty() {
            self.check_placement();
            if self.tracked.is_none() {
                self.tracked = Some([0; 3]);
            }
        }
        collected
    }

    /// Second phase: adds the gradients into the accumulators (`None` inside an accumulation
    /// window: no step this time) and joins each chunk's gradient parts once, for the
    /// statistics and the step alike.
    pub(crate) fn prepare(
        &mut self,
        collected: Collected<B, P::Host>,
    ) -> Option<Prepared<B, P::Host>> {
        let Collected {
            mut taken,
            order,
            values,
        } = collected;
        if self.accumulation > 1 {
            for id in &order {
                let t = &taken[id];
                let grad = t.grad.tensor().cast(DType::F32);
                let sum = match self.accumulated.remove(&t.key) {
                    Some(sum) => sum + grad,
                    None => grad,
                };
                self.accumulated.insert(t.key, sum);
            }
            self.micro_steps += 1;
            if self.micro_steps < self.accumulation {
                return None;
            }
            self.micro_steps = 0;
            let n = self.accumulation as f64;
            for t in taken.values_mut() {
                if let Some(sum) = self.accumulated.remove(&t.key) {
                    t.grad = Grad::Whole(sum.div_scalar(n));
                }
            }
            self.accumulated.clear();
        }
        let chunked = !bound(&self.zero).store().chunks().is_per_parameter();
        let ids: HashMap<usize, ParamId> = taken.iter().map(|(id, t)| (t.key, *id)).collect();
        let chunk_grads = if chunked {
            self.join_chunk_grads(&mut taken)
        } else {
            Vec::new()
        };
        Some(Prepared {
            taken,
            order,
            values,
            ids,
            chunk_grads,
        })
    }

    /// Last phase: steps every prepared gradient, multiplied by `factor`, and writes the new
    /// values into `module`.
    pub(crate) fn apply<AB, M>(
        &mut self,
        lr: f64,
        factor: f64,
        module: M,
        prepared: Prepared<B, P::Host>,
    ) -> M
    where
        AB: AutodiffBackend<InnerBackend = Zero<B>>,
        M: AutodiffModule<AB>,
    {
        let Prepared {
            taken,
            values,
            ids,
            chunk_grads,
            ..
        } = prepared;
        let chunks = PendingChunks::new(bound(&self.zero).store(), chunk_grads, values, ids);
        let mut apply = Apply {
            optimizer: self,
            lr,
            factor,
            taken,
            chunks,
        };
        let module = module.map(&mut apply);
        debug_assert!(
            apply.chunks.is_done(),
            "every chunk with a gradient has a member in the module it was collected from"
        );
        module
    }

    /// Parameter `key`'s master values on the model's `device` in `dtype`, when this
    /// optimizer holds them (to refill a shard `reuse_fp16_shard` released).
    pub(crate) fn master_on_model(
        &self,
        key: usize,
        device: &B::Device,
        dtype: DType,
    ) -> Option<Tensor<B, 1>> {
        let layout = self.zero.as_ref().map(|zero| zero.store().chunks());
        let master = self.masters.values_of(key, layout)?;
        let counters = bound(&self.zero).store().counters();
        Some(written_back::<B, P>(master, device, dtype, counters))
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

    /// The step's gradient factor from this rank's statistics, which `local` gives on the
    /// model's device for a norm type (one all-reduce combines every rank's): `None` when a
    /// gradient overflowed on any rank, or when no gradient was collected (`empty`). Updates
    /// the loss scaler. Without clipping or loss scaling the factor is 1 and nothing is read.
    /// A split optimizer's device side computes it for both sides.
    pub(crate) fn factor_of(
        &mut self,
        empty: bool,
        local: impl FnOnce(&Self, NormType) -> Tensor<B, 1>,
    ) -> Option<f64> {
        if self.clipping.is_none() && self.scaler.is_none() {
            return Some(1.0);
        }
        if empty {
            return None;
        }
        let norm_type = self.clipping.map_or(NormType::L2, |(_, n)| n);
        let local = local(self, norm_type);
        let zero = bound(&self.zero);
        let (norm, overflow) = combine(
            zero.comm().as_ref(),
            local,
            norm_type,
            zero.store().counters(),
        )
        .unwrap_or_else(|error| {
            panic!(
                "burn-zero: rank {} could not combine gradient norms: {error}",
                zero.rank()
            )
        });
        self.factor_from(norm, overflow)
    }

    /// This rank's statistics of `prepared` on the model's device: the norm's part (sum of
    /// squares or largest magnitude) and the count of non-finite values.
    pub(crate) fn local_stats(
        &self,
        prepared: &Prepared<B, P::Host>,
        norm_type: NormType,
    ) -> Tensor<B, 1> {
        let zero = bound(&self.zero);
        let host = P::host_device(zero.device());
        let mut stats = LocalStats::<P::Host>::default();
        // One statistic per chunk (its flat gradient), then per parameter outside chunks.
        for chunk in &prepared.chunk_grads {
            stats.add(&chunk.grad, norm_type, chunk.sharded || zero.rank() == 0);
        }
        for id in &prepared.order {
            let Some(t) = prepared.taken.get(id) else {
                continue;
            };
            let counts = zero.gradient_is_sharded(t.key) || zero.rank() == 0;
            stats.add(&t.grad.tensor(), norm_type, counts);
        }
        P::to_model(
            stats.into_local(&host),
            zero.device(),
            zero.store().counters(),
        )
    }

    /// The step's factor from the global `norm` and `overflow`, updating the loss scaler;
    /// `None` on an overflow.
    fn factor_from(&mut self, norm: f32, overflow: bool) -> Option<f64> {
        let scale = self.loss_scale();
        if let Some(scaler) = &mut self.scaler {
            scaler.update(overflow);
        }
        if overflow {
            self.last_norm = None;
            return None;
        }
        let norm = norm as f64 / scale;
        self.last_norm = Some(norm as f32);
        let clip = match self.clipping {
            Some((max_norm, _)) => (max_norm as f64 / (norm + 1e-6)).min(1.0),
            None => 1.0,
        };
        Some(clip / scale)
    }
}

/// Asks `zero`'s reduction to read the gradients of the `owned` parameters back to host memory
/// as they are reduced, when `P` steps them there.
pub(crate) fn keep_host_gradients<B: Backend, P: Place<B>>(zero: &ZeroState<B>, owned: &Owned) {
    if !P::GRADIENTS_ON_HOST {
        return;
    }
    match owned {
        Owned::All => zero.store().step_on(None, StepSite::Host),
        Owned::Only(keys) => zero.store().step_on(Some(keys), StepSite::Host),
        // A part that steps on the host everything but some keys is not made.
        Owned::Except(_) => {}
    }
}

/// The one device's gradients of Burn's multi-device gradients: burn-zero runs one rank per
/// device instead of one process driving several, so `optimizer` (named in the message)
/// accepts exactly one entry.
pub(crate) fn one_device(grads: MultiGradientsParams, optimizer: &str) -> GradientsParams {
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
pub(crate) fn check_lr(lr: f64) {
    assert!(
        lr.is_finite() && lr >= 0.0,
        "burn-zero: the learning rate {lr} is not a finite number of 0 or more; nothing was \
         stepped"
    );
}

/// The gradients of one step that an optimizer steps, taken out of `GradientsParams`.
pub(crate) struct Collected<B: Backend, H: Backend> {
    taken: HashMap<ParamId, Taken<H>>,
    order: Vec<ParamId>,
    /// The current value of every parameter that has a gradient, by key.
    values: HashMap<usize, ZeroTensor<B>>,
}

/// Collected gradients ready for the step: accumulated, and joined per chunk.
pub(crate) struct Prepared<B: Backend, H: Backend> {
    /// Gradients of parameters outside chunks.
    taken: HashMap<ParamId, Taken<H>>,
    order: Vec<ParamId>,
    values: HashMap<usize, ZeroTensor<B>>,
    /// Every collected parameter's id by key.
    ids: HashMap<usize, ParamId>,
    chunk_grads: Vec<ChunkGrad<H>>,
}

impl<B: Backend, H: Backend> Prepared<B, H> {
    /// Whether no gradient was collected.
    pub(crate) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// Which parameters of its module an optimizer steps.
#[derive(Debug, Clone, Default)]
pub(crate) enum Owned {
    /// Every trainable parameter.
    #[default]
    All,
    /// Those of these keys (a split optimizer's host side).
    Only(Arc<HashSet<usize>>),
    /// All but those of these keys (its device part: frozen parameters are checked here).
    Except(Arc<HashSet<usize>>),
}

impl Owned {
    pub(crate) fn steps(&self, key: usize) -> bool {
        match self {
            Owned::All => true,
            Owned::Only(keys) => keys.contains(&key),
            Owned::Except(keys) => !keys.contains(&key),
        }
    }
}

/// A 1-D tensor of the inner backend from a primitive.
pub(crate) fn flat<B: Backend>(primitive: B::FloatTensorPrimitive) -> Tensor<B, 1> {
    let numel = primitive.shape().num_elements();
    Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(
        primitive,
        Shape::new([numel]),
    )))
}

/// Reduced gradients of parameters a rank did not use, by parameter key.
pub(crate) type Orphans<B> = BTreeMap<usize, ZeroTensor<B>>;

/// First pass: takes every sharded parameter's gradient, in visit order, to where the masters
/// live.
struct Collect<'a, B: Backend, P: Place<B>> {
    zero: &'a ZeroState<B>,
    /// The parameters this optimizer steps; the others' gradients are left in `grads`.
    owned: &'a Owned,
    grads: &'a mut GradientsParams,
    /// The reducer's orphan gradients, taken at the first parameter that needs one.
    orphans: &'a mut Option<Orphans<B>>,
    taken: HashMap<ParamId, Taken<P::Host>>,
    order: Vec<ParamId>,
    /// The current value of every parameter that has a gradient, by key (a chunked step makes
    /// a chunk's master from its members' values).
    values: HashMap<usize, ZeroTensor<B>>,
    /// The chunks' reduced rows met so far, by address, where the masters live: each taken
    /// there once. Holding them keeps every address unique for the pass.
    rows: HashMap<usize, RowTaken<B, P::Host>>,
    _placement: std::marker::PhantomData<P>,
}

impl<B: Backend, P: Place<B>> Collect<'_, B, P> {
    /// Parameter `key`'s path in the module, for messages.
    fn path_of(&self, key: usize) -> String {
        self.zero
            .params()
            .get(key)
            .map_or_else(String::new, |info| info.path.clone())
    }

    fn orphan(&mut self, key: usize) -> Option<ZeroTensor<B>> {
        let zero = self.zero;
        self.orphans
            .get_or_insert_with(|| zero.take_orphan_gradients())
            .remove(&key)
    }
}

impl<AB, B, P> ModuleVisitor<AB> for Collect<'_, B, P>
where
    B: Backend,
    P: Place<B>,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        // A parameter sharded by another `shard` call would be stepped with the wrong state,
        // or silently never learn.
        if let ZeroTensor::Sharded(view) = param.val().inner().into_primitive().tensor()
            && !Arc::ptr_eq(view.param().store(), self.zero.store())
        {
            panic!(
                "burn-zero: parameter {} was sharded by another `shard` call than the one this \
                 ZeroOptimizer was built from; build one optimizer per sharded module, from the \
                 ZeroState its `shard` returned",
                param.id
            );
        }
        let Some(key) = self
            .zero
            .store()
            .key_of(&DistributedParamId::from(param.id.val()))
        else {
            // Not a parameter of the module this optimizer's state belongs to: not ours.
            return;
        };
        if !self.owned.steps(key) {
            return;
        }
        // Frozen when sharded: never reduced, never stepped. A gradient means the parameter
        // was unfrozen afterwards, and it would be stepped unreduced, differently on each rank.
        if !self.zero.is_trainable(key) {
            if self.grads.remove::<Zero<B>, D>(param.id).is_some() {
                panic!(
                    "burn-zero: parameter #{key} `{}` has a gradient, but it was frozen (did not \
                     require a gradient) when the module was sharded, so it has no place in the \
                     gradient buckets; set `require_grad` as training needs it before `shard`",
                    self.path_of(key)
                );
            }
            return;
        }
        // Trainable when sharded: its bucket reduced it on every rank. Frozen since, it would
        // be stepped with the zeros that stood in for its gradient.
        if !param.val().is_require_grad() {
            panic!(
                "burn-zero: parameter #{key} `{}` was trainable when the module was sharded but \
                 no longer requires a gradient; its bucket still reduces it and the optimizer \
                 would step it. Freeze parameters before `shard` (shard again to change which \
                 are frozen)",
                self.path_of(key)
            );
        }
        let grad = self
            .grads
            .remove::<Zero<B>, D>(param.id)
            .map(|g| g.into_primitive().tensor())
            .or_else(|| self.orphan(key));
        let Some(grad) = grad else { return };
        let sharded = self.zero.gradient_is_sharded(key);
        let counters = self.zero.store().counters();
        let grad = match grad {
            // Moved to host memory as it arrived (an offloaded optimizer): no device transfer.
            ZeroTensor::Sharded(view) if sharded => match view.param().host_data() {
                Some(data) => Grad::Whole(P::from_host_data(data, self.zero.device())),
                None => match view.param().row_part() {
                    Some((row, range)) => {
                        let row_id = Arc::as_ptr(&row) as usize;
                        let (_, row) = self.rows.entry(row_id).or_insert_with(|| {
                            let values = P::to_host(flat(row.values()), counters);
                            (row, values)
                        });
                        Grad::Part {
                            row: row.clone(),
                            row_id,
                            range,
                        }
                    }
                    None => Grad::Whole(P::to_host(flat(view.param().shard()), counters)),
                },
            },
            ZeroTensor::Local(full) if !sharded => Grad::Whole(P::to_host(flat(full), counters)),
            ZeroTensor::Local(_) => panic!(
                "burn-zero: the gradient of parameter #{key} `{}` is whole, but this stage \
                 reduces it to shards: it was not reduced. A backward pass uses up the \
                 parameters' gradient marks and `ZeroOptimizer::step` renews them, so a second \
                 backward pass before a step is not reduced; call `step` after every backward \
                 (`with_accumulation(n)` accumulates n of them)",
                self.path_of(key)
            ),
            ZeroTensor::Sharded(_) => panic!(
                "burn-zero: the gradient of parameter #{key} `{}` is sharded but this stage \
                 reduces it whole",
                self.path_of(key)
            ),
        };
        self.order.push(param.id);
        self.taken.insert(param.id, Taken { key, grad });
        self.values
            .insert(key, param.val().inner().into_primitive().tensor());
    }
}

/// Second pass: steps every parameter that has a gradient.
struct Apply<'a, O, B: Backend, P: Place<B>>
where
    O: SimpleOptimizer<P::Host>,
{
    optimizer: &'a mut Side<O, B, P>,
    lr: f64,
    factor: f64,
    taken: HashMap<ParamId, Taken<P::Host>>,
    /// The chunks to step, each when the walk reaches its first member.
    chunks: PendingChunks<B, P::Host>,
}

impl<O, B: Backend, P: Place<B>> Apply<'_, O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// The new value of a parameter (currently `value`) after a step with its gradient.
    fn update(&mut self, taken: Taken<P::Host>, value: ZeroTensor<B>) -> ZeroTensor<B> {
        let Taken { key, grad } = taken;
        let grad = grad.tensor();
        let store = bound(&self.optimizer.zero).store().clone();
        let sharded_grad = store.gradient_is_sharded(key);
        let shape = value.shape();
        let dtype = value.dtype();
        let master = self.optimizer.masters.param_or_make(key, || {
            let values = match &value {
                ZeroTensor::Sharded(view) => flat(view.param().shard().clone()),
                ZeroTensor::Local(full) if sharded_grad => store.own_block(flat(full.clone())),
                ZeroTensor::Local(full) => flat(full.clone()),
            };
            Master::new(P::to_host(values, store.counters()))
        });
        if master.values.dims() != grad.dims() {
            panic!(
                "burn-zero: rank {}: parameter #{key} has a gradient part of {} elements but its \
                 optimizer state holds {}; was the optimizer record saved by another rank or a \
                 group of another size?",
                store.rank(),
                grad.dims()[0],
                master.values.dims()[0]
            );
        }
        if matches!(value, ZeroTensor::Sharded(_)) {
            store.hold_master(key);
        }
        let one_pass = self.optimizer.one_pass;
        let optim = &self.optimizer.optim;
        let updated = master.step(optim, one_pass, self.lr, grad, self.factor, dtype);
        if let ZeroTensor::Sharded(view) = &value
            && store.is_on_host(key)
        {
            // An offloaded shard goes (or stays) in host memory, without a trip to the device.
            let data = P::into_host_data(cast_to(updated, dtype), store.counters());
            let param = view.param().with_host_shard(data);
            return ZeroTensor::Sharded(ShardedView::new(Arc::new(param)));
        }
        let updated = written_back::<B, P>(updated, store.device(), dtype, store.counters());
        match value {
            ZeroTensor::Sharded(view) => {
                let param = view.param().with_shard(updated.into_primitive().tensor());
                ZeroTensor::Sharded(ShardedView::new(Arc::new(param)))
            }
            ZeroTensor::Local(_) if sharded_grad => {
                // Stages 1 and 2: every rank stepped its block; gather the whole parameter.
                let full = store
                    .all_gather_full(updated, &shape)
                    .unwrap_or_else(|error| {
                        panic!(
                            "burn-zero: rank {} could not gather updated parameter #{key}: {error}",
                            store.rank()
                        )
                    });
                ZeroTensor::Local(full)
            }
            ZeroTensor::Local(_) => {
                ZeroTensor::Local(B::float_reshape(updated.into_primitive().tensor(), shape))
            }
        }
    }
}

impl<AB, O, B, P> ModuleMapper<AB> for Apply<'_, O, B, P>
where
    B: Backend,
    P: Place<B>,
    O: SimpleOptimizer<P::Host>,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let stepped = self
            .optimizer
            .take_stepped(self.lr, self.factor, &mut self.chunks, param.id);
        if let Some(value) = stepped {
            let (id, tensor, mapper) = param.consume();
            let tensor = marked_parameter::<AB, B, D>(id, value, tensor.is_require_grad());
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let Some(taken) = self.taken.remove(&param.id) else {
            return <Remark as ModuleMapper<AB>>::map_float(&mut Remark, param);
        };
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let value = tensor.inner().into_primitive().tensor();
        self.chunks.forget(taken.key);
        let updated = self.update(taken, value);
        let tensor = marked_parameter::<AB, B, D>(id, updated, require_grad);
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// A master copy's fp32 values as a parameter's values: on the model's `device`, in `dtype`
/// (an upload counted in `counters` when the master is offloaded).
fn written_back<B: Backend, P: Place<B>>(
    values: Tensor<P::Host, 1>,
    device: &B::Device,
    dtype: DType,
    counters: &RankCounters,
) -> Tensor<B, 1> {
    cast_to(P::to_model(values, device, counters), dtype)
}

/// A parameter tensor holding `value`, marked for the gradient hooks.
fn marked_parameter<AB, B, const D: usize>(
    id: ParamId,
    value: ZeroTensor<B>,
    require_grad: bool,
) -> Tensor<AB, D>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    let inner = Tensor::<Zero<B>, D>::from_primitive(TensorPrimitive::Float(value));
    Tensor::<AB, D>::from_inner(inner)
        .set_require_grad(require_grad)
        .set_distributed(DistributedParamId::from(id.val()))
}

/// A parameter's master values on the model's device in a dtype, by key, when held.
pub(crate) type MasterOnModel<'a, B> =
    dyn Fn(usize, &<B as BackendTypes>::Device, DType) -> Option<Tensor<B, 1>> + 'a;

/// For steps that leave values as they are (a skipped step, a micro-step inside an
/// accumulation window): renews every parameter's gradient-hook mark, and rewrites shards
/// released by `reuse_fp16_shard` from their fp32 masters (found by `master`).
pub(crate) struct Refill<'a, B: Backend> {
    pub master: &'a MasterOnModel<'a, B>,
}

impl<AB, B> ModuleMapper<AB> for Refill<'_, B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let param = <Remark as ModuleMapper<AB>>::map_float(&mut Remark, param);
        let (id, tensor, mapper) = param.consume();
        let tensor = match tensor.clone().inner().into_primitive().tensor() {
            ZeroTensor::Sharded(view) if view.param().is_released() => {
                let shard = view.param();
                let values = (self.master)(shard.key(), shard.device(), shard.dtype())
                    .unwrap_or_else(|| {
                        panic!(
                            "burn-zero: parameter #{} was released but this optimizer has no \
                             master copy of it",
                            shard.key()
                        )
                    });
                let refilled = shard.with_shard(values.into_primitive().tensor());
                let value = ZeroTensor::Sharded(ShardedView::new(Arc::new(refilled)));
                marked_parameter::<AB, B, D>(id, value, tensor.is_require_grad())
            }
            _ => tensor,
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Renews the gradient-hook mark of every parameter of a sharded module (each backward
/// consumes it), leaving values as they are.
struct Remark;

impl<AB: AutodiffBackend> ModuleMapper<AB> for Remark {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        // Only parameters of a sharded module carry a mark to renew.
        let tensor = if tensor.is_distributed() {
            tensor.set_distributed(DistributedParamId::from(id.val()))
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}
