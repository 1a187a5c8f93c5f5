//! [`ZeroStrategy`]: what a burn-train `SupervisedTraining` runs when training goes through
//! burn-zero — how the ranks start, and the settings every rank shares.

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::module::AutodiffModule;
use burn::optim::SimpleOptimizer;
use burn::optim::lr_scheduler::LrScheduler;
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearningComponentsMarker, LearningComponentsTypes, LearningResult,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingModel, ValidLoader,
};
use burn_zero_comm::{LaunchOptions, RankContext, launch_with};
use burn_zero_core::{Zero, ZeroConfig};
use burn_zero_optim::ZeroOptimizer;

use crate::data::{self, Deal};
use crate::error::TrainError;
use crate::events::Funnel;
use crate::items::{CrossRank, ErasedExchange};
use crate::worker::{self, Across, EventFunnel, Shared, TrainOutput, ValidOutput};

/// Connects this process's rank of a multi-process job (e.g. `NcclGroup::from_env` under
/// `zero-run`).
pub type ConnectRank<B> = dyn Fn() -> Result<RankContext<B>, String> + Send + Sync;

/// Where the ranks run.
enum Ranks<B: Backend> {
    /// Threads of this process, connected by a `LocalGroup`: one device for all ranks (CPU
    /// ranks) or one per rank.
    Threads {
        world_size: usize,
        devices: Vec<B::Device>,
    },
    /// This process is one rank of a job of several processes.
    Process(Box<ConnectRank<B>>),
}

/// A burn-train learning strategy that trains the `Learner`'s model with ZeRO: every rank holds
/// 1/N of the parameters, gradients and optimizer state.
///
/// Give it to `SupervisedTraining::with_training_strategy(TrainingStrategy::Custom(..))`, with
/// a `Learner` made by `Learner::new` whose backend is `Autodiff<Zero<B>>` and whose optimizer
/// is a [`ZeroOptimizer`].
/// Each rank then
/// - takes a copy of the learner on its device and shards its model ([`ZeroConfig`]);
/// - trains on its own block of every epoch: the blocks are disjoint and equal (the items an
///   equal split leaves over are skipped that epoch) and dealt anew each epoch from the seed
///   ([`Self::with_seed`]), the same on every rank;
/// - steps the learner's scheduler once per global batch and the `ZeroOptimizer` once per
///   batch (gradient accumulation is the optimizer's: `ZeroOptimizer::with_accumulation`);
/// - validates its own block of the validation data (forward gathers parameters, so every rank
///   takes part);
/// - hands its items to the metrics, which count every rank's items (sums and counts of the
///   global batch); Burn's renderer shows them once, on rank 0;
/// - saves a sharded checkpoint after every epoch ([`Self::with_checkpoints`]), from which
///   `SupervisedTraining::checkpoint(epoch)` resumes.
///
/// Before any step the ranks agree to go on: every rank stops at the same step when one runs
/// out of data or the interrupter is triggered. A rank that fails stops every rank, and `fit`
/// panics with a message naming the rank and the cause (burn-train's `fit` has no error
/// channel). The trained model comes back gathered, as an ordinary model.
pub struct ZeroStrategy<B: Backend> {
    ranks: Ranks<B>,
    config: ZeroConfig,
    seed: u64,
    checkpoints: Option<PathBuf>,
    keep_last: usize,
    timeout: Option<Duration>,
    /// Under `this_process`: how step outputs reach rank 0's metrics from every rank.
    items: Option<ErasedExchange>,
}

impl<B: Backend> ZeroStrategy<B> {
    /// `world_size` ranks on threads of this process, all computing on `device` (CPU ranks, or
    /// several ranks sharing one GPU in tests).
    pub fn new(world_size: usize, device: B::Device, config: ZeroConfig) -> Self {
        Self::with_ranks(
            Ranks::Threads {
                world_size,
                devices: vec![device],
            },
            config,
        )
    }

    /// One rank per device, each on a thread of this process (several GPUs of one machine
    /// without NCCL, or wgpu devices).
    pub fn on_devices(devices: Vec<B::Device>, config: ZeroConfig) -> Self {
        Self::with_ranks(
            Ranks::Threads {
                world_size: devices.len(),
                devices,
            },
            config,
        )
    }

    /// This process is one rank of a multi-process job: `connect` builds its [`RankContext`]
    /// (for instance from `NcclGroup::from_env` under `zero-run`). Only rank 0 feeds the
    /// metrics and the renderer; each process passes its own data loaders, built the same
    /// way on every rank.
    pub fn this_process<E: Display>(
        connect: impl Fn() -> Result<RankContext<B>, E> + Send + Sync + 'static,
        config: ZeroConfig,
    ) -> Self {
        Self::with_ranks(
            Ranks::Process(Box::new(move || connect().map_err(|e| e.to_string()))),
            config,
        )
    }

    fn with_ranks(ranks: Ranks<B>, config: ZeroConfig) -> Self {
        Self {
            ranks,
            config,
            seed: 0,
            checkpoints: None,
            keep_last: 2,
            timeout: None,
            items: None,
        }
    }

    /// The seed of each epoch's deal of the training data to the ranks (default 0).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Saves a sharded checkpoint under `root` after every epoch (each rank writes its own
    /// part; see `burn_zero_checkpoint::save`), keeping the last [`Self::with_keep_last`].
    /// `SupervisedTraining::checkpoint(epoch)` resumes from the one saved after `epoch`.
    pub fn with_checkpoints(mut self, root: impl AsRef<Path>) -> Self {
        self.checkpoints = Some(root.as_ref().to_path_buf());
        self
    }

    /// Complete checkpoints kept (default 2; 0 keeps all).
    pub fn with_keep_last(mut self, keep_last: usize) -> Self {
        self.keep_last = keep_last;
        self
    }

    /// How long a collective of in-process ranks waits for the others before failing (the
    /// `LocalGroup` default otherwise).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Under [`Self::this_process`], rank 0's metrics count every rank's items, as they do
    /// for ranks on threads: after each step the ranks all-gather their outputs (two
    /// collectives per step, the outputs' values through host memory), and rank 0 hands them
    /// to burn-train's event processor in rank order. `TO` and `VO` are the model's training
    /// and validation outputs, e.g. `ClassificationOutput<Autodiff<Zero<B>>>` and
    /// `ClassificationOutput<Zero<B>>`; burn-train's outputs implement [`CrossRank`]. Without
    /// it, each process's metrics count its own rank's items only, and only rank 0's are shown.
    /// Ranks on threads share one event processor and need nothing.
    pub fn with_items_from_every_rank<TO, VO>(mut self) -> Self
    where
        TO: CrossRank + 'static,
        VO: CrossRank + 'static,
    {
        self.items = Some(ErasedExchange::new::<B, TO, VO>());
        self
    }

    /// The ZeRO settings every rank shards with.
    pub fn config(&self) -> &ZeroConfig {
        &self.config
    }
}

/// The components of a learner that trains through burn-zero.
type ZeroComponents<AB, LR, M, O, B, H> =
    LearningComponentsMarker<AB, LR, M, ZeroOptimizer<B, O, H>>;

impl<AB, B, LR, M, O, H> SupervisedLearningStrategy<ZeroComponents<AB, LR, M, O, B, H>>
    for ZeroStrategy<B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = B::Device>,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<AB> + Display + 'static,
    M::InnerModule: InferenceStep,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H> + 'static,
{
    /// Replaces burn-train's default, which would resume through its own checkpointer on one
    /// thread: a sharded model's record gathers, and one rank gathering alone never returns.
    fn train(
        &self,
        learner: Learner<ZeroComponents<AB, LR, M, O, B, H>>,
        dataloader_train: TrainLoader<ZeroComponents<AB, LR, M, O, B, H>>,
        dataloader_valid: ValidLoader<ZeroComponents<AB, LR, M, O, B, H>>,
        components: TrainingComponents<ZeroComponents<AB, LR, M, O, B, H>>,
    ) -> LearningResult<M::InnerModule> {
        if let Err(error) = check_components(&components) {
            panic!("burn-zero: ZeroStrategy cannot train: {error}");
        }
        let starting_epoch = components.checkpoint.map_or(1, |epoch| epoch + 1);
        let summary = components.summary.clone();
        let (model, mut processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        // burn-train names the model in its summary through a method private to it.
        let summary = summary.and_then(|config| config.init().ok());
        processor.process_train(LearnerEvent::End(summary));
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<ZeroComponents<AB, LR, M, O, B, H>>,
        learner: Learner<ZeroComponents<AB, LR, M, O, B, H>>,
        dataloader_train: TrainLoader<ZeroComponents<AB, LR, M, O, B, H>>,
        dataloader_valid: ValidLoader<ZeroComponents<AB, LR, M, O, B, H>>,
        starting_epoch: usize,
    ) -> (
        TrainingModel<ZeroComponents<AB, LR, M, O, B, H>>,
        SupervisedTrainingEventProcessor<ZeroComponents<AB, LR, M, O, B, H>>,
    ) {
        let TrainingComponents {
            num_epochs,
            interrupter,
            early_stopping,
            event_processor,
            event_store,
            ..
        } = components;
        let fit = Fit {
            strategy: self,
            train: &dataloader_train,
            valid: &dataloader_valid,
            settings: Settings {
                config: &self.config,
                checkpoints: self.checkpoints.as_deref(),
                keep_last: self.keep_last,
                interrupter: &interrupter,
                early_stopping,
                event_store: &event_store,
                starting_epoch,
                num_epochs,
            },
        };
        let outcome = match &self.ranks {
            Ranks::Threads {
                world_size,
                devices,
            } => fit.on_threads(*world_size, devices, learner, event_processor),
            Ranks::Process(connect) => fit.in_this_process(connect, learner, event_processor),
        };
        match outcome {
            Ok((Some(model), processor)) => {
                if interrupter.should_stop() {
                    let reason = interrupter
                        .get_message()
                        .unwrap_or_else(|| "no reason given".to_string());
                    tracing::info!(%reason, "training interrupted");
                }
                (model, processor)
            }
            Ok((None, _)) => panic!("burn-zero: ZeroStrategy ran no rank"),
            Err(error) => panic!("burn-zero: training under ZeroStrategy stopped: {error}"),
        }
    }
}

/// What the ranks of this process return: the trained model (of the first of them) and the
/// event processor.
type Outcome<LC> = Result<
    (
        Option<TrainingModel<LC>>,
        SupervisedTrainingEventProcessor<LC>,
    ),
    TrainError,
>;

/// Each rank's training and validation blocks of every epoch: `[epoch - starting_epoch][rank]`.
type EpochShares<LC> = (Vec<Vec<TrainLoader<LC>>>, Vec<Vec<ValidLoader<LC>>>);

/// [`EpochShares`] of a learner that trains through burn-zero.
type ZeroShares<AB, LR, M, O, B, H> = EpochShares<ZeroComponents<AB, LR, M, O, B, H>>;

/// The settings of a run that every rank reads: the strategy's, and burn-train's components.
struct Settings<'f> {
    config: &'f ZeroConfig,
    checkpoints: Option<&'f Path>,
    keep_last: usize,
    interrupter: &'f Interrupter,
    early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    event_store: &'f Arc<EventStoreClient>,
    starting_epoch: usize,
    num_epochs: usize,
}

impl<'f> Settings<'f> {
    /// What every rank of this process reads: its learner (one per rank), its blocks of each
    /// epoch, where its items go and how they cross processes, and these settings.
    fn shared<'a, LC: LearningComponentsTypes>(
        self,
        learners: Vec<Option<Learner<LC>>>,
        (train, valid): EpochShares<LC>,
        funnel: Option<&'a EventFunnel<LC>>,
        across: Option<Across<LC>>,
    ) -> Shared<'a, LC>
    where
        'f: 'a,
    {
        Shared {
            learners: Mutex::new(learners),
            train,
            valid,
            funnel,
            across,
            config: self.config,
            checkpoints: self.checkpoints,
            keep_last: self.keep_last,
            interrupter: self.interrupter,
            early_stopping: Mutex::new(self.early_stopping),
            event_store: self.event_store,
            starting_epoch: self.starting_epoch,
            num_epochs: self.num_epochs,
        }
    }
}

/// One [`ZeroStrategy`] `fit`: the strategy, the data loaders each rank's blocks are cut from
/// and the run's settings, whichever way the ranks run.
struct Fit<'f, AB, B, LR, M, O, H>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = B::Device>,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<AB> + Display + 'static,
    M::InnerModule: InferenceStep,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H> + 'static,
{
    strategy: &'f ZeroStrategy<B>,
    train: &'f TrainLoader<ZeroComponents<AB, LR, M, O, B, H>>,
    valid: &'f ValidLoader<ZeroComponents<AB, LR, M, O, B, H>>,
    settings: Settings<'f>,
}

impl<AB, B, LR, M, O, H> Fit<'_, AB, B, LR, M, O, H>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>> + BackendTypes<Device = B::Device>,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<AB> + Display + 'static,
    M::InnerModule: InferenceStep,
    H: Backend,
    O: SimpleOptimizer<B> + SimpleOptimizer<H> + 'static,
{
    /// Ranks on threads of this process, connected by a `LocalGroup`: one learner per rank,
    /// one event processor for all, fed by every rank.
    fn on_threads(
        self,
        world_size: usize,
        devices: &[B::Device],
        learner: Learner<ZeroComponents<AB, LR, M, O, B, H>>,
        event_processor: SupervisedTrainingEventProcessor<ZeroComponents<AB, LR, M, O, B, H>>,
    ) -> Outcome<ZeroComponents<AB, LR, M, O, B, H>> {
        let prepared = check_threads(world_size, devices)
            .and_then(|()| self.epoch_shares(devices, world_size));
        let shares = match prepared {
            Ok(shares) => shares,
            Err(error) => panic!("burn-zero: ZeroStrategy cannot train: {error}"),
        };
        let mut processor = event_processor;
        processor.process_train(LearnerEvent::Start);
        let funnel = Funnel::new(processor, world_size, world_size);
        let learners = (0..world_size).map(|_| Some(learner.clone())).collect();
        let shared = self.settings.shared(learners, shares, Some(&funnel), None);
        let options = match self.strategy.timeout {
            Some(timeout) => LaunchOptions::with_timeout(timeout),
            None => LaunchOptions::default(),
        };
        let result = launch_with::<B, _, _, TrainError>(world_size, devices, &options, |ctx| {
            let rank = ctx.rank();
            worker::run::<AB, B, LR, M, O, H>(ctx, rank, &shared)
        });
        drop(shared);
        let processor = funnel.into_processor();
        result
            .map_err(TrainError::from)
            .map(|models| (models.into_iter().next(), processor))
    }

    /// This process is one rank of a job of several processes: it connects, trains its rank
    /// and, on rank 0 only, feeds the metrics (with every rank's items when they are gathered).
    fn in_this_process(
        self,
        connect: &ConnectRank<B>,
        learner: Learner<ZeroComponents<AB, LR, M, O, B, H>>,
        event_processor: SupervisedTrainingEventProcessor<ZeroComponents<AB, LR, M, O, B, H>>,
    ) -> Outcome<ZeroComponents<AB, LR, M, O, B, H>> {
        let ctx = match connect() {
            Ok(ctx) => ctx,
            Err(error) => {
                panic!("burn-zero: ZeroStrategy could not connect this process's rank: {error}")
            }
        };
        let (rank, world_size) = (ctx.rank(), ctx.world_size());
        let devices = [ctx.device().clone()];
        let prepared = self.epoch_shares(&devices, world_size).and_then(|shares| {
            let across = match &self.strategy.items {
                Some(items) => Some(items_across(items, &ctx)?),
                None => None,
            };
            Ok((shares, across))
        });
        let (shares, across) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => panic!("burn-zero: rank {rank} cannot train: {error}"),
        };
        let mut processor = event_processor;
        if rank == 0 {
            processor.process_train(LearnerEvent::Start);
        }
        // With the items of every rank, rank 0 hands in all of them for each step and ends
        // each epoch once.
        let slots = if across.is_some() { world_size } else { 1 };
        let funnel = Funnel::new(processor, slots, 1);
        let funnel_here = (rank == 0).then_some(&funnel);
        let shared = self
            .settings
            .shared(vec![Some(learner)], shares, funnel_here, across);
        let result = worker::run::<AB, B, LR, M, O, H>(ctx, 0, &shared);
        drop(shared);
        let processor = funnel.into_processor();
        result
            .map_err(|error| TrainError::Rank {
                rank,
                source: Box::new(error),
            })
            .map(|model| (Some(model), processor))
    }

    /// Each rank's share of every epoch: the training data dealt anew each epoch from the
    /// seed, the validation data the same every epoch.
    fn epoch_shares(
        &self,
        devices: &[B::Device],
        world_size: usize,
    ) -> Result<ZeroShares<AB, LR, M, O, B, H>, TrainError> {
        let epochs = self.settings.starting_epoch..=self.settings.num_epochs;
        let train = data::shares(
            self.train,
            devices,
            world_size,
            epochs.clone(),
            Deal::Shuffled {
                seed: self.strategy.seed,
            },
            "training",
        )?;
        let valid = data::shares(
            self.valid,
            devices,
            world_size,
            epochs,
            Deal::Fixed,
            "validation",
        )?;
        Ok((train, valid))
    }
}

/// Under [`ZeroStrategy::with_items_from_every_rank`], how this process's rank gathers every
/// rank's step outputs for the metrics (an error when the model's outputs are not the types it
/// was set for).
fn items_across<B, LC>(
    items: &ErasedExchange,
    ctx: &RankContext<B>,
) -> Result<Across<LC>, TrainError>
where
    B: Backend,
    LC: LearningComponentsTypes,
    TrainOutput<LC>: 'static,
    ValidOutput<LC>: 'static,
{
    let exchange = items.get::<B, TrainOutput<LC>, ValidOutput<LC>>()?;
    let (comm, device) = (ctx.comm().clone(), ctx.device().clone());
    let (comm_valid, device_valid) = (comm.clone(), device.clone());
    let (train_item, valid_item) = (exchange.train, exchange.valid);
    Ok(Across {
        train: Box::new(move |item| train_item(item, comm.as_ref(), &device)),
        valid: Box::new(move |item| valid_item(item, comm_valid.as_ref(), &device_valid)),
    })
}

/// Refuses the burn-train settings that cannot work on sharded ranks, saying what to use.
fn check_components<LC: LearningComponentsTypes>(
    components: &TrainingComponents<LC>,
) -> Result<(), TrainError> {
    if components.checkpointer.is_some() {
        return Err(TrainError::Invalid(
            "burn-train's file checkpointer (`with_file_checkpointer`) saves whole records, and \
             a sharded model's record gathers on one rank alone; save sharded checkpoints with \
             `ZeroStrategy::with_checkpoints(dir)` instead"
                .into(),
        ));
    }
    if let Some(steps) = components.grad_accumulation {
        return Err(TrainError::Invalid(format!(
            "burn-train's `grads_accumulation({steps})` adds whole gradients, and adding sharded \
             gradients gathers them; accumulate in the optimizer instead: \
             `ZeroOptimizer::with_accumulation({steps})`"
        )));
    }
    Ok(())
}

fn check_threads<D>(world_size: usize, devices: &[D]) -> Result<(), TrainError> {
    if world_size == 0 {
        return Err(TrainError::Invalid(
            "ZeroStrategy needs at least one rank".into(),
        ));
    }
    if devices.is_empty() || (devices.len() != 1 && devices.len() != world_size) {
        return Err(TrainError::Invalid(format!(
            "{} devices for {world_size} ranks: give one device for all ranks or one per rank",
            devices.len()
        )));
    }
    Ok(())
}
