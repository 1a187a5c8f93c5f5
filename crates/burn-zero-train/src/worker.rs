//! One rank's training: its copy of the learner, sharded; its blocks of each epoch; the
//! agreement before every step; validation, checkpoints and early stopping at each epoch's end.

use std::path::Path;
use std::sync::{Arc, Mutex};

use burn::data::dataloader::{DataLoaderIterator, Progress};
use burn::module::AutodiffModule;
use burn::optim::SimpleOptimizer;
use burn::optim::lr_scheduler::LrScheduler;
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    CloneEarlyStoppingStrategy, InferenceStep, Interrupter, Learner, LearningComponentsMarker,
    LearningComponentsTypes, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingItem, ValidLoader,
};
use burn_zero_checkpoint::{SaveOptions, list, load_record, read_metadata, save_record};
use burn_zero_comm::sync::lock;
use burn_zero_comm::{RankContext, agree};
use burn_zero_core::{Zero, ZeroConfig, ZeroState, shard, unshard};
use burn_zero_optim::{ZeroOptimizer, ZeroOptimizerRecord};

use crate::error::TrainError;
use crate::events::{Funnel, Split};
use crate::state;

/// Output of a training step of `LC`'s model.
pub(crate) type TrainOutput<LC> =
    <<LC as LearningComponentsTypes>::TrainingModel as TrainStep>::Output;
/// Output of a validation step of `LC`'s model.
pub(crate) type ValidOutput<LC> =
    <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Output;
/// The funnel of `LC`'s events.
pub(crate) type EventFunnel<LC> =
    Funnel<SupervisedTrainingEventProcessor<LC>, TrainOutput<LC>, ValidOutput<LC>>;

/// Gathers every rank's output of a step, in rank order (a collective): how items reach rank
/// 0's metrics when each rank is a process.
pub(crate) struct Across<LC: LearningComponentsTypes> {
    pub train: Gathered<TrainOutput<LC>>,
    pub valid: Gathered<ValidOutput<LC>>,
}

/// Every rank's copy of this rank's output `T` (a collective).
pub(crate) type Gathered<T> = Box<dyn Fn(T) -> Result<Vec<T>, TrainError> + Sync>;

/// What every rank of this process reads.
pub(crate) struct Shared<'a, LC: LearningComponentsTypes> {
    /// One learner per rank of this process, taken by its rank.
    pub learners: Mutex<Vec<Option<Learner<LC>>>>,
    /// Every rank's training block of every epoch: `train[epoch - starting_epoch][rank]`.
    pub train: Vec<Vec<TrainLoader<LC>>>,
    /// Every rank's validation block of every epoch.
    pub valid: Vec<Vec<ValidLoader<LC>>>,
    /// Where items go; `None` in a process whose rank does not render.
    pub funnel: Option<&'a EventFunnel<LC>>,
    /// Each rank a process, items of every rank wanted: every rank's outputs, gathered.
    pub across: Option<Across<LC>>,
    pub config: &'a ZeroConfig,
    pub checkpoints: Option<&'a Path>,
    pub keep_last: usize,
    pub interrupter: &'a Interrupter,
    /// Consulted on rank 0 only; its decision is shared.
    pub early_stopping: Mutex<Option<Box<dyn CloneEarlyStoppingStrategy>>>,
    pub event_store: &'a Arc<EventStoreClient>,
    pub starting_epoch: usize,
    pub num_epochs: usize,
}

/// What the ranks agreed before a step.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// Every rank has a batch: step.
    Step,
    /// A rank has no batch left: the epoch (or validation) ends here for every rank.
    EndOfData,
    /// A rank was asked to stop (its interrupter, or early stopping on rank 0).
    Stop,
}

/// Runs `step` on each of this rank's `batches`, with the progress counted over every rank's
/// items, for as long as every rank has a batch; returns whether a rank asked to stop.
fn in_lockstep<B: Backend, T>(
    ctx: &RankContext<B>,
    interrupter: &Interrupter,
    mut batches: Box<dyn DataLoaderIterator<T> + '_>,
    mut step: impl FnMut(T, Progress) -> Result<(), TrainError>,
) -> Result<bool, TrainError> {
    loop {
        let batch = batches.next();
        match agree(ctx, batch.is_some(), interrupter.should_stop())? {
            Next::Step => {}
            Next::EndOfData => return Ok(false),
            Next::Stop => return Ok(true),
        }
        let Some(batch) = batch else {
            return Ok(false);
        };
        let mut progress = batches.progress();
        progress.items_processed *= ctx.world_size();
        progress.items_total *= ctx.world_size();
        step(batch, progress)?;
    }
}

/// Every rank says whether it has a batch and whether it must stop; all decide alike, so no
/// rank enters a collective the others skip.
fn agree<B: Backend>(
    ctx: &RankContext<B>,
    has_batch: bool,
    stop: bool,
) -> Result<Next, TrainError> {
    let flag = |b: bool| if b { 1.0f32 } else { 0.0 };
    let all = agree::exchange(
        ctx.comm().as_ref(),
        ctx.device(),
        &[flag(has_batch), flag(stop)],
    )?;
    let ranks: Vec<(bool, bool)> = all.iter().map(|c| (c[0] > 0.5, c[1] > 0.5)).collect();
    if ranks.iter().any(|&(_, stop)| stop) {
        return Ok(Next::Stop);
    }
    if ranks.iter().all(|&(has, _)| has) {
        return Ok(Next::Step);
    }
    if has_batch {
        let without: Vec<usize> = (0..ranks.len()).filter(|&r| !ranks[r].0).collect();
        tracing::warn!(
            rank = ctx.rank(),
            ?without,
            "this rank has batches left but other ranks have none: the epoch ends for all"
        );
    }
    Ok(Next::EndOfData)
}

/// The components of a learner that trains through burn-zero.
type ZeroComponents<AB, LR, M, O, B, H> =
    LearningComponentsMarker<AB, LR, M, ZeroOptimizer<B, O, H>>;

/// Trains rank `ctx.rank()` (learner and event slot `slot` of this process) and returns the
/// trained model, gathered (every rank gathers; a collective).
pub(crate) fn run<AB, B, LR, M, O, H>(
    ctx: RankContext<B>,
    slot: usize,
    shared: &Shared<'_, ZeroComponents<AB, LR, M, O, B, H>>,
) -> Result<M, TrainError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = B::Device>,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<AB> + std::fmt::Display + 'static,
    M::InnerModule: InferenceStep,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H> + 'static,
{
    RankRun::start(ctx, slot, shared)?.epochs()
}

/// One rank's run: its sharded copy of the learner, its context and what every rank shares.
///
/// The fields drop in the order they are declared: the sharded module's state and the learner
/// before the rank's context.
struct RankRun<'s, 'a, AB, B, LR, M, O, H>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = B::Device>,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<AB> + std::fmt::Display + 'static,
    M::InnerModule: InferenceStep,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H> + 'static,
{
    zero: ZeroState<B>,
    learner: Learner<ZeroComponents<AB, LR, M, O, B, H>>,
    /// Training steps taken, those before a resumed checkpoint included.
    iteration: usize,
    /// The rank's learner and event slot in this process.
    slot: usize,
    shared: &'s Shared<'a, ZeroComponents<AB, LR, M, O, B, H>>,
    ctx: RankContext<B>,
}

impl<'s, 'a, AB, B, LR, M, O, H> RankRun<'s, 'a, AB, B, LR, M, O, H>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = B::Device>,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<AB> + std::fmt::Display + 'static,
    M::InnerModule: InferenceStep,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H> + 'static,
{
    /// Takes the rank's learner, moves it to the rank's device and shards its model, with the
    /// learner's optimizer bound to the sharded module; past the first epoch, loads the
    /// checkpoint saved after the epoch before.
    fn start(
        ctx: RankContext<B>,
        slot: usize,
        shared: &'s Shared<'a, ZeroComponents<AB, LR, M, O, B, H>>,
    ) -> Result<Self, TrainError> {
        let rank = ctx.rank();
        let mut learner = lock(&shared.learners)
            .get_mut(slot)
            .and_then(Option::take)
            .ok_or_else(|| TrainError::Invalid(format!("no learner for rank {rank}")))?;

        // The rank's copy, on its device, sharded. `load_model` rebuilds the parameters and
        // drops their gradient-hook marks: `grad_sharded` puts them back (the same mark `shard`
        // sets).
        learner.fork(ctx.device());
        let (model, zero) = shard::<AB, B, M>(learner.model(), &ctx, shared.config)?;
        learner.load_model(model.into_record());
        learner.grad_sharded();
        // The learner's optimizer (`ZeroOptimizer::unbound`) steps this rank's sharded module
        // from now on: the learner takes optimizer records only, so the binding travels in one.
        learner.load_optim(ZeroOptimizerRecord::binding(&zero));

        let mut iteration = 0;
        if shared.starting_epoch > 1 {
            let root = shared.checkpoints.ok_or_else(|| {
                TrainError::Invalid(format!(
                    "resuming after epoch {} needs the sharded checkpoints: \
                     `ZeroStrategy::with_checkpoints(dir)`",
                    shared.starting_epoch - 1
                ))
            })?;
            iteration = resume::<AB, B, LR, M, O, H>(
                &mut learner,
                &zero,
                root,
                shared.starting_epoch - 1,
                ctx.device(),
            )?;
        }
        Ok(Self {
            zero,
            learner,
            iteration,
            slot,
            shared,
            ctx,
        })
    }

    /// Every epoch left: training, validation, the checkpoint and early stopping, until the
    /// last epoch or a stop; returns the trained model, gathered (a collective).
    fn epochs(mut self) -> Result<M, TrainError> {
        let shared = self.shared;
        let has_early_stopping = lock(&shared.early_stopping).is_some();
        for epoch in shared.starting_epoch..=shared.num_epochs {
            if self.train(epoch)? {
                break;
            }
            if self.validate(epoch)? {
                break;
            }
            if let Some(root) = shared.checkpoints {
                save_epoch::<AB, B, LR, M, O, H>(
                    &self.learner,
                    &self.zero,
                    root,
                    epoch,
                    self.iteration,
                    shared.keep_last,
                    shared.event_store,
                )?;
            }
            if has_early_stopping && self.early_stop(epoch)? {
                break;
            }
        }
        Ok(unshard::<AB, B, M>(self.learner.model()))
    }

    /// Training on the rank's block of `epoch`: one step per batch, as long as every rank has
    /// one, each step's items handed to the metrics; returns whether a rank asked to stop.
    fn train(&mut self, epoch: usize) -> Result<bool, TrainError> {
        let (rank, slot, shared) = (self.ctx.rank(), self.slot, self.shared);
        let global = Progress::new(epoch, shared.num_epochs);
        let (learner, iteration) = (&mut self.learner, &mut self.iteration);
        let batches = shared.train[epoch - shared.starting_epoch][rank].iter();
        let stopped = in_lockstep(&self.ctx, shared.interrupter, batches, |batch, progress| {
            *iteration += 1;
            let iteration = *iteration;
            learner.lr_step();
            let output = learner.train_step(batch);
            learner.optimizer_step(output.grads);
            let lr = learner.lr_current();
            let item = |item| {
                let progress = progress.clone();
                TrainingItem::new(item, progress, global.clone(), Some(iteration), Some(lr))
            };
            let gather = shared.across.as_ref().map(|across| &across.train);
            hand_over(gather, output.item, slot, |from, output| {
                if let Some(funnel) = shared.funnel {
                    funnel.train_item(from, epoch, iteration, item(output));
                }
            })
        })?;
        if let Some(funnel) = shared.funnel {
            funnel.end_epoch(Split::Train, epoch);
        }
        if stopped {
            tracing::info!(rank, epoch, "training stopped");
        }
        Ok(stopped)
    }

    /// Validation on the rank's block of `epoch` (on every rank: at stage 3 each forward
    /// gathers parameters), each step's items handed to the metrics; returns whether a rank
    /// asked to stop.
    fn validate(&self, epoch: usize) -> Result<bool, TrainError> {
        let (rank, slot, shared) = (self.ctx.rank(), self.slot, self.shared);
        let global = Progress::new(epoch, shared.num_epochs);
        let model = self.learner.model().valid();
        let mut step = 0;
        let batches = shared.valid[epoch - shared.starting_epoch][rank].iter();
        let stopped = in_lockstep(&self.ctx, shared.interrupter, batches, |batch, progress| {
            step += 1;
            let output = model.step(batch);
            let item =
                |item| TrainingItem::new(item, progress.clone(), global.clone(), Some(step), None);
            let gather = shared.across.as_ref().map(|across| &across.valid);
            hand_over(gather, output, slot, |from, output| {
                if let Some(funnel) = shared.funnel {
                    funnel.valid_item(from, epoch, step, item(output));
                }
            })
        })?;
        drop(model);
        if let Some(funnel) = shared.funnel {
            funnel.end_epoch(Split::Valid, epoch);
        }
        if stopped {
            tracing::info!(rank, epoch, "training stopped during validation");
        }
        Ok(stopped)
    }

    /// Early stopping after `epoch`: rank 0 decides for all (a barrier, then an agreement);
    /// returns whether training stops.
    fn early_stop(&self, epoch: usize) -> Result<bool, TrainError> {
        let (rank, shared) = (self.ctx.rank(), self.shared);
        // Every rank has handed over its validation items (the last one ended the epoch for
        // the metrics); rank 0 decides for all.
        self.ctx.comm().barrier()?;
        let stop = rank == 0
            && lock(&shared.early_stopping)
                .as_mut()
                .is_some_and(|strategy| strategy.should_stop(epoch, shared.event_store));
        let stop = agree(&self.ctx, true, stop)? == Next::Stop;
        if stop {
            tracing::info!(rank, epoch, "early stopping");
        }
        Ok(stop)
    }
}

/// Hands a step's `output` to `give` with the slot it comes from: every rank's output,
/// gathered across processes (`gather`), in rank order, or this rank's own from `slot`.
fn hand_over<T>(
    gather: Option<&Gathered<T>>,
    output: T,
    slot: usize,
    mut give: impl FnMut(usize, T),
) -> Result<(), TrainError> {
    match gather {
        Some(gather) => {
            for (from, output) in gather(output)?.into_iter().enumerate() {
                give(from, output);
            }
        }
        None => give(slot, output),
    }
    Ok(())
}

/// Saves the sharded checkpoint of the end of `epoch` (a collective).
fn save_epoch<AB, B, LR, M, O, H>(
    learner: &Learner<ZeroComponents<AB, LR, M, O, B, H>>,
    zero: &ZeroState<B>,
    root: &Path,
    epoch: usize,
    iteration: usize,
    keep_last: usize,
    store: &EventStoreClient,
) -> Result<(), TrainError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = B::Device>,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<AB> + std::fmt::Display + 'static,
    M::InnerModule: InferenceStep,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H> + 'static,
{
    let (optimizer, scheduler) = state::take(learner, epoch, store)?;
    let extra = serde_json::json!({
        "epoch": epoch,
        "iteration": iteration,
        "scheduler": state::scheduler_to_json::<ZeroComponents<AB, LR, M, O, B, H>>(scheduler)?,
    });
    let options = SaveOptions { keep_last, extra };
    save_record::<AB, B, M, O, H>(
        root,
        iteration as u64,
        &learner.model(),
        zero,
        optimizer,
        &options,
    )?;
    Ok(())
}

/// Loads the checkpoint saved after `epoch` into the learner; returns the iterations done.
fn resume<AB, B, LR, M, O, H>(
    learner: &mut Learner<ZeroComponents<AB, LR, M, O, B, H>>,
    zero: &ZeroState<B>,
    root: &Path,
    epoch: usize,
    device: &B::Device,
) -> Result<usize, TrainError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = B::Device>,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<AB> + std::fmt::Display + 'static,
    M::InnerModule: InferenceStep,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H> + 'static,
{
    let found = list(root)?
        .into_iter()
        .rev()
        .filter(|d| d.complete)
        .find_map(|dir| {
            let meta = read_metadata(&dir.path).ok()?;
            let saved = meta.extra.get("epoch")?.as_u64()?;
            (saved == epoch as u64).then_some((dir.path, meta))
        });
    let Some((dir, meta)) = found else {
        return Err(TrainError::Invalid(format!(
            "no complete checkpoint of epoch {epoch} under {}",
            root.display()
        )));
    };
    let iteration = meta
        .extra
        .get("iteration")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| TrainError::State(format!("{} does not say its iteration", dir.display())))?
        as usize;
    let scheduler = meta.extra.get("scheduler").cloned().ok_or_else(|| {
        TrainError::State(format!(
            "{} holds no scheduler state: it was not saved by ZeroStrategy",
            dir.display()
        ))
    })?;
    let scheduler =
        state::scheduler_from_json::<ZeroComponents<AB, LR, M, O, B, H>>(scheduler, device)?;
    let (model, optimizer, _) = load_record::<AB, B, M, O, H>(&dir, learner.model(), zero)?;
    learner.load_model(model.into_record());
    learner.grad_sharded();
    learner.load_optim(optimizer);
    learner.load_scheduler(scheduler);
    tracing::info!(epoch, iteration, dir = %dir.display(), "resumed");
    Ok(iteration)
}
