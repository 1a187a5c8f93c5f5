//! Saving and loading a [`crate::ZeroOptimizer`]: each rank records its own part — fp32 master
//! shards, optimizer state, gradient accumulators and the loss scaler — with no gathering.

use std::marker::PhantomData;

use burn::optim::SimpleOptimizer;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{Device, Tensor};
use burn_zero_core::{Zero, ZeroState};
use serde::{Deserialize, Serialize};

/// One rank's optimizer state, every parameter's entry on the host backend `H` whichever side
/// stepped it: a Burn [`Record`] of the autodiff backend, so Burn's recorders save it
/// (`BinFileRecorder`, `NamedMpkFileRecorder`, … with `FullPrecisionSettings` to keep the
/// masters in fp32). Save one file per rank and load it into the same rank of a group of the
/// same size (the optimizer refuses anything else at its next step), under any placement; a
/// sharded checkpoint (`burn-zero-checkpoint`) also resumes it at another world size.
pub struct ZeroOptimizerRecord<B: Backend, O, H: Backend>
where
    O: SimpleOptimizer<H>,
{
    /// Rank and world size of the group the state belongs to (`None` before the first step).
    pub placement: Option<(usize, usize)>,
    /// Per parameter key: the fp32 master part and the optimizer's state for it.
    pub masters: Vec<MasterEntry<O, H>>,
    /// Per parameter key: fp32 gradient sums of the current accumulation window.
    pub accumulated: Vec<(usize, Tensor<H, 1>)>,
    /// Micro-steps taken in the current accumulation window.
    pub micro_steps: usize,
    /// Loss scaler state: scale, clean steps since the last change, overflows counted towards
    /// hysteresis.
    pub scaler: Option<(f64, usize, usize)>,
    /// Steps skipped because of overflow.
    pub skipped: usize,
    /// The sharded module's state to bind an optimizer to when the record is loaded (see
    /// [`ZeroOptimizerRecord::binding`]). Never saved: a loaded record has none, and loading
    /// a record without one leaves the optimizer's binding as it was.
    pub binding: Option<ZeroState<B>>,
    _model: PhantomData<B>,
}

impl<B: Backend, O, H: Backend> ZeroOptimizerRecord<B, O, H>
where
    O: SimpleOptimizer<H>,
{
    /// A record from its parts, for state assembled elsewhere (a sharded checkpoint re-chunked
    /// for another group): `placement` is the rank and world size it is for.
    pub fn new(
        placement: Option<(usize, usize)>,
        masters: Vec<MasterEntry<O, H>>,
        accumulated: Vec<(usize, Tensor<H, 1>)>,
        micro_steps: usize,
        scaler: Option<(f64, usize, usize)>,
        skipped: usize,
    ) -> Self {
        Self {
            placement,
            masters,
            accumulated,
            micro_steps,
            scaler,
            skipped,
            binding: None,
            _model: PhantomData,
        }
    }
}

impl<B: Backend, O, H: Backend> ZeroOptimizerRecord<B, O, H>
where
    O: SimpleOptimizer<H>,
{
    /// A record with no state that, loaded into an optimizer made with
    /// [`crate::ZeroOptimizer::unbound`], binds it to `zero`, the state `shard` returned on this
    /// rank: the way a training framework that owns the optimizer (burn-train's `Learner`,
    /// through `load_optim`) hands it the sharded module it steps.
    pub fn binding(zero: &ZeroState<B>) -> Self {
        Self::new(None, Vec::new(), Vec::new(), 0, None, 0).bound_to(zero)
    }

    /// This record, binding the optimizer it is loaded into to `zero` as well.
    pub fn bound_to(mut self, zero: &ZeroState<B>) -> Self {
        self.binding = Some(zero.clone());
        self
    }
}

/// One parameter's entry in a record: its key, fp32 master part and optimizer state.
pub type MasterEntry<O, H> = (
    usize,
    Tensor<H, 1>,
    Option<<O as SimpleOptimizer<H>>::State<1>>,
);

/// The serialisable form of a flat tensor on `H`.
type TensorItem<H, S> = <Tensor<H, 1> as Record<H>>::Item<S>;

/// The serialisable form of a [`ZeroOptimizerRecord`].
#[derive(Serialize, Deserialize, Clone)]
#[serde(bound = "")]
pub struct ZeroOptimizerRecordItem<O: SimpleOptimizer<H>, H: Backend, S: PrecisionSettings> {
    placement: Option<(usize, usize)>,
    masters: Vec<MasterItem<O, H, S>>,
    accumulated: Vec<(usize, TensorItem<H, S>)>,
    micro_steps: usize,
    scaler: Option<(f64, usize, usize)>,
    skipped: usize,
}

/// One master copy in serialisable form.
#[derive(Serialize, Deserialize, Clone)]
#[serde(bound = "")]
struct MasterItem<O: SimpleOptimizer<H>, H: Backend, S: PrecisionSettings> {
    key: usize,
    values: TensorItem<H, S>,
    state: Option<<O::State<1> as Record<H>>::Item<S>>,
}

impl<AB, B, O, H> Record<AB> for ZeroOptimizerRecord<B, O, H>
where
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = Device<B>>,
    B: Backend,
    H: Backend,
    O: SimpleOptimizer<H>,
{
    type Item<S: PrecisionSettings> = ZeroOptimizerRecordItem<O, H, S>;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        ZeroOptimizerRecordItem {
            placement: self.placement,
            masters: self
                .masters
                .into_iter()
                .map(|(key, values, state)| MasterItem {
                    key,
                    values: Record::<H>::into_item::<S>(values),
                    state: state.map(|s| Record::<H>::into_item::<S>(s)),
                })
                .collect(),
            accumulated: self
                .accumulated
                .into_iter()
                .map(|(key, sum)| (key, Record::<H>::into_item::<S>(sum)))
                .collect(),
            micro_steps: self.micro_steps,
            scaler: self.scaler,
            skipped: self.skipped,
        }
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, _device: &AB::Device) -> Self {
        // The entries live on the host backend's default device, as the optimizer keeps them.
        let host = H::Device::default();
        Self {
            placement: item.placement,
            masters: item
                .masters
                .into_iter()
                .map(|m| {
                    let values = <Tensor<H, 1> as Record<H>>::from_item(m.values, &host);
                    let state = m
                        .state
                        .map(|s| <O::State<1> as Record<H>>::from_item(s, &host));
                    (m.key, values, state)
                })
                .collect(),
            accumulated: item
                .accumulated
                .into_iter()
                .map(|(key, sum)| {
                    let sum = <Tensor<H, 1> as Record<H>>::from_item(sum, &host);
                    (key, sum)
                })
                .collect(),
            micro_steps: item.micro_steps,
            scaler: item.scaler,
            skipped: item.skipped,
            binding: None,
            _model: PhantomData,
        }
    }
}
