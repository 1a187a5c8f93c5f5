//! burn-train's Learner under `ZeroStrategy`, against the hand-written ZeRO loop on the same
//! batches: 2 ranks, stage 3, on Flex (bitwise reproducible on the CPU).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::module::Module;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::lr_scheduler::linear::{LinearLrScheduler, LinearLrSchedulerConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::backend::Backend;
use burn_train::logger::MetricLogger;
use burn_train::metric::store::EventStoreClient;
use burn_train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn_train::metric::{LossMetric, MetricDefinition, NumericEntry};
use burn_train::{
    ClassificationOutput, EarlyStoppingStrategy, Interrupter, Learner, RegressionOutput,
    SupervisedTraining, TrainingStrategy,
};
use burn_zero_comm::{Communicator, LocalGroup, RankContext, launch};
use burn_zero_core::{Placement, Zero, ZeroConfig, ZeroError, shard};
use burn_zero_gpt::learner::{TextBatch, TextGpt, WindowBatcher, windows};
use burn_zero_gpt::{Corpus, GptConfig, Materialise, TEXT, param_values};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_train::ZeroStrategy;

type Train = Autodiff<Zero<Flex>>;
type Valid = Zero<Flex>;

const WORLD: usize = 2;
const SEQ: usize = 16;
const BATCH: usize = 4;
/// 25 training windows: 3 batches of 4 per rank and epoch, one window left over.
const TRAIN_WINDOWS: usize = WORLD * 3 * BATCH + 1;
/// 9 validation windows: 2 batches (of 2) per rank, one left over.
const VALID_WINDOWS: usize = 9;

/// Burn's seeded generator is process-wide: one model initialisation at a time.
static SEEDED: Mutex<()> = Mutex::new(());

fn zero_config() -> ZeroConfig {
    stage_config(3)
}

fn stage_config(stage: u8) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(stage)
        .with_persist_below_numel(0)
}

fn base_model(corpus: &Corpus) -> TextGpt<Train> {
    let _seeded = SEEDED.lock().unwrap_or_else(|p| p.into_inner());
    let device = Default::default();
    Train::seed(&device, 7);
    let gpt = GptConfig::new(corpus.vocab(), SEQ, 32, 2, 1, 64).init::<Train>(&device);
    gpt.visit(&mut Materialise);
    TextGpt { gpt }
}

fn scheduler() -> LinearLrScheduler {
    LinearLrSchedulerConfig::new(1e-2, 2e-3, 8)
        .init()
        .expect("a valid schedule")
}

/// The batches each rank drew, in order, as window starts (ranks are threads named `rank-N`).
#[derive(Clone, Default)]
struct Drawn(Arc<Mutex<Vec<Batch>>>);

/// A batch as the thread that drew it and its window starts.
type Batch = (String, Vec<usize>);

impl Drawn {
    fn of_rank(&self, rank: usize) -> Vec<Vec<usize>> {
        let name = format!("rank-{rank}");
        let drawn = self.0.lock().unwrap();
        drawn
            .iter()
            .filter(|(thread, _)| *thread == name)
            .map(|(_, starts)| starts.clone())
            .collect()
    }
}

/// A batcher that notes every batch it makes, and can fail on one.
#[derive(Clone)]
struct Recording {
    inner: WindowBatcher,
    drawn: Drawn,
    /// Panic at this (rank thread, batch number on that rank) instead of batching.
    fail_at: Option<(String, usize)>,
    /// Ask the run to stop while making this (rank thread, batch number).
    interrupt_at: Option<(String, usize, Interrupter)>,
}

impl<B: Backend> Batcher<B, usize, TextBatch<B>> for Recording {
    fn batch(&self, starts: Vec<usize>, device: &B::Device) -> TextBatch<B> {
        let thread = std::thread::current().name().unwrap_or("").to_string();
        let mut drawn = self.drawn.0.lock().unwrap();
        let before = drawn.iter().filter(|(t, _)| *t == thread).count();
        if self.fail_at == Some((thread.clone(), before)) {
            drop(drawn);
            panic!("injected failure: the data source of {thread} broke");
        }
        if let Some((at, batch, interrupter)) = &self.interrupt_at
            && (at.as_str(), *batch) == (thread.as_str(), before)
        {
            interrupter.stop(Some("asked by the test"));
        }
        drawn.push((thread, starts.clone()));
        drop(drawn);
        self.inner.tensors(&starts, device)
    }
}

/// Every numeric metric entry burn-train logs: (split, epoch, value, running value).
#[derive(Clone, Default)]
struct Logged(Arc<Mutex<Vec<Entry>>>);

/// A logged entry: split, epoch, value, running value.
type Entry = (String, usize, f64, f64);

fn value(entry: &NumericEntry) -> f64 {
    match entry {
        NumericEntry::Value(v) => *v,
        NumericEntry::Aggregated {
            aggregated_value, ..
        } => *aggregated_value,
    }
}

impl MetricLogger for Logged {
    fn log(&mut self, update: MetricsUpdate, epoch: usize, split: &Split) {
        let split = match split {
            Split::Train => "train",
            Split::Valid => "valid",
            Split::Test(_) => "test",
        };
        let mut logged = self.0.lock().unwrap();
        for numeric in update.entries_numeric {
            logged.push((
                split.to_string(),
                epoch,
                value(&numeric.numeric_entry),
                value(&numeric.running_entry),
            ));
        }
    }

    fn read_numeric(&mut self, _: &str, _: usize, _: &Split) -> Result<Vec<NumericEntry>, String> {
        Err("not kept".into())
    }

    fn log_metric_definition(&mut self, _: MetricDefinition) {}

    fn log_epoch_summary(&mut self, _: EpochSummary) {}
}

impl Logged {
    fn values(&self, split: &str, epoch: usize) -> Vec<(f64, f64)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, e, _, _)| s == split && *e == epoch)
            .map(|&(_, _, v, r)| (v, r))
            .collect()
    }
}

/// One Learner run and what it saw.
struct Run {
    params: Vec<Vec<f32>>,
    drawn: Drawn,
    logged: Logged,
}

#[derive(Default)]
struct Setup {
    /// `None`: two in-process ranks (`ZeroStrategy::new`).
    strategy: Option<ZeroStrategy<Flex>>,
    epochs: usize,
    resume_after: Option<usize>,
    checkpoints: Option<std::path::PathBuf>,
    fail_at: Option<(String, usize)>,
    /// Trigger the interrupter while this (rank thread, batch) is drawn.
    interrupt_at: Option<(String, usize)>,
    /// `ZeroOptimizer::with_accumulation` (1 when 0).
    accumulation: usize,
    /// burn-train's own `grads_accumulation`, which the strategy refuses.
    burn_accumulation: Option<usize>,
    /// ZeRO stage of the in-process ranks (3 when `None`).
    stage: Option<u8>,
    /// Stop after this epoch through burn-train's early stopping.
    stop_after: Option<usize>,
    /// Training windows (`TRAIN_WINDOWS` when `None`).
    train_windows: Option<usize>,
}

/// Early stopping that stops after a given epoch.
#[derive(Clone)]
struct StopAfter(usize);

impl EarlyStoppingStrategy for StopAfter {
    fn should_stop(&mut self, epoch: usize, _: &EventStoreClient) -> bool {
        epoch >= self.0
    }
}

fn learner_run(corpus: &Corpus, dir: &Path, setup: Setup) -> Run {
    let device = Default::default();
    let drawn = Drawn::default();
    let logged = Logged::default();
    let interrupter = Interrupter::new();
    let train_windows = setup.train_windows.unwrap_or(TRAIN_WINDOWS);
    let batcher = Recording {
        inner: WindowBatcher::new(corpus, SEQ),
        drawn: drawn.clone(),
        fail_at: setup.fail_at,
        interrupt_at: setup
            .interrupt_at
            .map(|(thread, batch)| (thread, batch, interrupter.clone())),
    };
    let train: Arc<dyn DataLoader<Train, TextBatch<Train>>> = DataLoaderBuilder::new(batcher)
        .batch_size(BATCH)
        .build(windows(corpus, 0..(train_windows + 1) * SEQ, SEQ));
    assert_eq!(train.num_items(), train_windows);
    let valid_batcher = Recording {
        inner: WindowBatcher::new(corpus, SEQ),
        drawn: Drawn::default(),
        fail_at: None,
        interrupt_at: None,
    };
    let start = 2000;
    let valid: Arc<dyn DataLoader<Valid, TextBatch<Valid>>> = DataLoaderBuilder::new(valid_batcher)
        .batch_size(2)
        .build(windows(
            corpus,
            start..start + (VALID_WINDOWS + 1) * SEQ,
            SEQ,
        ));
    assert_eq!(valid.num_items(), VALID_WINDOWS);

    let mut strategy = setup.strategy.unwrap_or_else(|| {
        ZeroStrategy::<Flex>::new(WORLD, device, stage_config(setup.stage.unwrap_or(3)))
            .with_seed(3)
            .with_timeout(Duration::from_secs(60))
    });
    if let Some(root) = &setup.checkpoints {
        strategy = strategy.with_checkpoints(root);
    }
    let learner = Learner::new(
        base_model(corpus),
        ZeroOptimizer::unbound(PerTensor(AdamConfig::new().build()))
            .unwrap()
            .with_accumulation(setup.accumulation),
        scheduler(),
    );
    let mut training = SupervisedTraining::new(dir, train, valid)
        .metric_train_numeric(LossMetric::<Flex>::new())
        .metric_valid_numeric(LossMetric::<Flex>::new())
        .with_metric_logger(logged.clone())
        .with_application_logger(None)
        .num_epochs(setup.epochs)
        .with_interrupter(interrupter)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
    if let Some(epoch) = setup.resume_after {
        training = training.checkpoint(epoch);
    }
    if let Some(steps) = setup.burn_accumulation {
        training = training.grads_accumulation(steps);
    }
    if let Some(epoch) = setup.stop_after {
        training = training.early_stopping(StopAfter(epoch));
    }
    let result = training.launch(learner);
    Run {
        params: param_values(&result.model),
        drawn,
        logged,
    }
}

/// The hand-written ZeRO loop: each rank steps through `batches[rank]` (window starts) with
/// the same model, optimizer and schedule. Returns each rank's losses and the final parameters.
fn hand_written(
    corpus: &Corpus,
    batches: &[Vec<Vec<usize>>],
    accumulation: usize,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    hand_written_at(corpus, batches, accumulation, 3)
}

fn hand_written_at(
    corpus: &Corpus,
    batches: &[Vec<Vec<usize>>],
    accumulation: usize,
    stage: u8,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let base = base_model(corpus);
    let batcher = WindowBatcher::new(corpus, SEQ);
    let outcomes = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &stage_config(stage))?;
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))
            .unwrap()
            .with_accumulation(accumulation);
        let mut schedule = scheduler();
        let mut losses = Vec::new();
        for starts in &batches[ctx.rank()] {
            let lr = LrScheduler::step(&mut schedule);
            let batch = batcher.tensors::<Train>(starts, ctx.device());
            let loss = model.gpt.loss(batch.inputs, batch.targets);
            losses.push(loss.clone().into_scalar());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(lr, model, grads);
        }
        Ok((losses, param_values(&model)))
    })
    .expect("the hand-written loop runs");
    let params = outcomes[0].1.clone();
    (outcomes.into_iter().map(|(l, _)| l).collect(), params)
}

fn bits(values: &[Vec<f32>]) -> Vec<Vec<u32>> {
    values
        .iter()
        .map(|v| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// An empty directory of this test, removed when dropped (also when the test fails).
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("burn-zero-train-{name}-"))
        .tempdir()
        .unwrap()
}

/// Which items each rank saw in each epoch: disjoint blocks of equal size, every item but the
/// one left over, dealt differently across epochs.
fn check_deal(drawn: &Drawn, epochs: usize) {
    let batches_per_epoch = 3;
    let mut deals = Vec::new();
    for epoch in 0..epochs {
        let mut seen: Vec<usize> = Vec::new();
        let mut per_rank = Vec::new();
        for rank in 0..WORLD {
            let batches = drawn.of_rank(rank);
            assert_eq!(
                batches.len(),
                epochs * batches_per_epoch,
                "rank {rank}'s batches"
            );
            let mine: Vec<usize> = batches
                [epoch * batches_per_epoch..(epoch + 1) * batches_per_epoch]
                .iter()
                .flatten()
                .copied()
                .collect();
            assert_eq!(mine.len(), batches_per_epoch * BATCH);
            per_rank.push(mine[0]);
            seen.extend(mine);
        }
        let count = seen.len();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), count, "epoch {}: ranks share items", epoch + 1);
        assert_eq!(count, TRAIN_WINDOWS - 1);
        deals.push(per_rank);
    }
    assert!(
        deals.windows(2).any(|w| w[0] != w[1]),
        "the deal never changes: {deals:?}"
    );
}

#[test]
fn learner_matches_the_hand_written_loop_bitwise() {
    let corpus = Corpus::new(TEXT);
    let dir = temp_dir("parity");
    let epochs = 3;
    let run = learner_run(
        &corpus,
        dir.path(),
        Setup {
            epochs,
            ..Default::default()
        },
    );
    check_deal(&run.drawn, epochs);

    let batches: Vec<_> = (0..WORLD).map(|r| run.drawn.of_rank(r)).collect();
    let (losses, params) = hand_written(&corpus, &batches, 1);
    assert_eq!(
        bits(&run.params),
        bits(&params),
        "the Learner's model differs from the hand-written loop's"
    );

    // Metrics: every rank's loss of every step, in rank order, and the epoch's mean over all
    // of them (a sum and a count over ranks, not a mean of per-rank means).
    for epoch in 1..=epochs {
        let logged = run.logged.values("train", epoch);
        let steps = 3;
        let mut expected = Vec::new();
        let (mut sum, mut count) = (0.0f64, 0usize);
        for step in (epoch - 1) * steps..epoch * steps {
            for rank_losses in &losses {
                let loss = rank_losses[step] as f64;
                sum += loss;
                count += 1;
                expected.push((loss, sum / count as f64));
            }
        }
        assert_eq!(logged, expected, "train loss of epoch {epoch}");
        // Validation: 2 batches per rank and epoch, every rank's counted.
        assert_eq!(run.logged.values("valid", epoch).len(), 2 * WORLD);
    }
}

#[test]
fn resume_continues_where_it_stopped() {
    let corpus = Corpus::new(TEXT);
    let (whole_dir, first_dir, second_dir) =
        (temp_dir("whole"), temp_dir("first"), temp_dir("second"));
    let checkpoints = temp_dir("checkpoints");
    let whole = learner_run(
        &corpus,
        whole_dir.path(),
        Setup {
            epochs: 2,
            ..Default::default()
        },
    );
    // The same run, stopped after epoch 1 and resumed from its sharded checkpoint.
    learner_run(
        &corpus,
        first_dir.path(),
        Setup {
            epochs: 1,
            checkpoints: Some(checkpoints.path().to_path_buf()),
            ..Default::default()
        },
    );
    let resumed = learner_run(
        &corpus,
        second_dir.path(),
        Setup {
            epochs: 2,
            resume_after: Some(1),
            checkpoints: Some(checkpoints.path().to_path_buf()),
            ..Default::default()
        },
    );
    assert_eq!(
        bits(&resumed.params),
        bits(&whole.params),
        "the resumed run ends elsewhere than the uninterrupted one"
    );
    // The resumed run trained epoch 2 only, on the same batches, with the same losses.
    for rank in 0..WORLD {
        assert_eq!(resumed.drawn.of_rank(rank), whole.drawn.of_rank(rank)[3..]);
    }
    // burn-train's metric store numbers a run's epochs from 1 until the first one ends, so
    // the resumed epoch 2 is logged under 1.
    assert_eq!(
        resumed.logged.values("train", 1),
        whole.logged.values("train", 2),
        "the resumed epoch's losses differ"
    );
    assert_eq!(
        resumed.logged.values("valid", 1),
        whole.logged.values("valid", 2)
    );
}

#[test]
fn a_failing_rank_stops_every_rank_and_names_itself() {
    let corpus = Corpus::new(TEXT);
    let dir = temp_dir("failure");
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        learner_run(
            &corpus,
            dir.path(),
            Setup {
                epochs: 2,
                // Rank 1's second batch of the first epoch.
                fail_at: Some(("rank-1".into(), 1)),
                ..Default::default()
            },
        )
    }));
    let payload = outcome.err().expect("the run must fail");
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(message.contains("rank 1"), "{message}");
    assert!(
        message.contains("injected failure: the data source of rank-1 broke"),
        "{message}"
    );
}

/// Runs each of `WORLD` ranks as its own "process" (`ZeroStrategy::this_process`; here threads
/// that share nothing but their communicators), its strategy set up by `setup`; returns each
/// rank's run, or its panic.
fn as_processes(
    corpus: &Corpus,
    name: &str,
    setup: impl Fn(ZeroStrategy<Flex>) -> ZeroStrategy<Flex> + Sync,
) -> Vec<std::thread::Result<Run>> {
    let groups = LocalGroup::<Flex>::new(WORLD).expect("a group");
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let setup = &setup;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let comm: Arc<dyn Communicator<Flex>> = Arc::new(group);
                        let strategy = ZeroStrategy::this_process(
                            move || {
                                Ok::<_, String>(RankContext::new(Default::default(), comm.clone()))
                            },
                            zero_config(),
                        )
                        .with_seed(3);
                        let dir = temp_dir(&format!("{name}-{rank}"));
                        catch_unwind(AssertUnwindSafe(|| {
                            learner_run(
                                corpus,
                                dir.path(),
                                Setup {
                                    strategy: Some(setup(strategy)),
                                    epochs: 2,
                                    ..Default::default()
                                },
                            )
                        }))
                    })
                    .expect("a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("the rank thread"))
            .collect()
    })
}

/// The two ranks as threads, for the processes to match.
fn as_threads(corpus: &Corpus) -> Run {
    let dir = temp_dir("threads");
    learner_run(
        corpus,
        dir.path(),
        Setup {
            epochs: 2,
            ..Default::default()
        },
    )
}

fn loss_values(run: &Run, split: &str, epoch: usize) -> Vec<u64> {
    run.logged
        .values(split, epoch)
        .iter()
        .map(|v| v.0.to_bits())
        .collect()
}

/// Each rank as its own process: every rank ends with the model the in-process ranks end
/// with, and by default only rank 0's items reach rank 0's metrics.
#[test]
fn ranks_as_processes_train_like_ranks_as_threads() {
    let corpus = Corpus::new(TEXT);
    let threads = as_threads(&corpus);
    let runs: Vec<Run> = as_processes(&corpus, "process", |strategy| strategy)
        .into_iter()
        .map(|run| run.expect("the rank trains"))
        .collect();
    for (rank, run) in runs.iter().enumerate() {
        assert_eq!(
            bits(&run.params),
            bits(&threads.params),
            "rank {rank} as a process ends elsewhere than the in-process ranks"
        );
        assert_eq!(run.drawn.of_rank(rank), threads.drawn.of_rank(rank));
    }
    // Rank 0 renders and logs its own items; rank 1 logs nothing.
    assert_eq!(runs[0].logged.values("train", 1).len(), 3);
    assert!(runs[1].logged.values("train", 1).is_empty());
    let own = loss_values(&runs[0], "train", 1);
    let all = loss_values(&threads, "train", 1);
    assert_eq!(own, all.iter().step_by(WORLD).copied().collect::<Vec<_>>());
}

/// With `with_items_from_every_rank`, rank 0's metrics as a process are those of the ranks as
/// threads, bit for bit: every rank's items, in rank order, training and validation.
#[test]
fn ranks_as_processes_count_every_ranks_items_when_asked() {
    let corpus = Corpus::new(TEXT);
    let threads = as_threads(&corpus);
    let runs: Vec<Run> = as_processes(&corpus, "items", |strategy| {
        strategy
            .with_items_from_every_rank::<ClassificationOutput<Train>, ClassificationOutput<Valid>>(
            )
    })
    .into_iter()
    .map(|run| run.expect("the rank trains"))
    .collect();
    for epoch in 1..=2 {
        for split in ["train", "valid"] {
            let all = loss_values(&threads, split, epoch);
            assert!(!all.is_empty(), "{split} {epoch}: nothing logged");
            assert_eq!(
                loss_values(&runs[0], split, epoch),
                all,
                "{split} epoch {epoch}: rank 0's metrics differ from the ranks as threads"
            );
            assert!(runs[1].logged.values(split, epoch).is_empty());
        }
    }
    for run in &runs {
        assert_eq!(bits(&run.params), bits(&threads.params));
    }
}

/// Output types that are not the learner's are refused by name, on every rank, before any
/// step.
#[test]
fn items_from_every_rank_for_other_output_types_are_refused() {
    let corpus = Corpus::new(TEXT);
    let runs = as_processes(&corpus, "wrong-items", |strategy| {
        strategy.with_items_from_every_rank::<RegressionOutput<Train>, RegressionOutput<Valid>>()
    });
    for (rank, run) in runs.into_iter().enumerate() {
        let payload = run.err().expect("the rank must refuse");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(
            message.contains(&format!("rank {rank} cannot train"))
                && message.contains("RegressionOutput")
                && message.contains("ClassificationOutput"),
            "{message}"
        );
    }
}

/// Accumulation is the optimizer's: two micro-batches per step under the Learner equal the
/// hand-written loop's, bit for bit (windows run across epoch ends).
#[test]
fn accumulation_in_the_optimizer_matches_the_hand_written_loop() {
    let corpus = Corpus::new(TEXT);
    let dir = temp_dir("accumulation");
    let run = learner_run(
        &corpus,
        dir.path(),
        Setup {
            epochs: 3,
            accumulation: 2,
            ..Default::default()
        },
    );
    let batches: Vec<_> = (0..WORLD).map(|r| run.drawn.of_rank(r)).collect();
    let (_, params) = hand_written(&corpus, &batches, 2);
    assert_eq!(bits(&run.params), bits(&params));
    let (_, unaccumulated) = hand_written(&corpus, &batches, 1);
    assert_ne!(
        bits(&params),
        bits(&unaccumulated),
        "accumulation changed nothing"
    );
}

/// The message of a run that must fail.
fn failure(run: impl FnOnce() -> Run) -> String {
    let payload = catch_unwind(AssertUnwindSafe(run))
        .err()
        .expect("the run must fail");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn burn_trains_own_accumulation_is_refused_with_what_to_use() {
    let corpus = Corpus::new(TEXT);
    let dir = temp_dir("refused");
    let message = failure(|| {
        learner_run(
            &corpus,
            dir.path(),
            Setup {
                epochs: 1,
                burn_accumulation: Some(2),
                ..Default::default()
            },
        )
    });
    assert!(
        message.contains("ZeroOptimizer::with_accumulation(2)"),
        "{message}"
    );
}

/// The interrupter triggered on rank 0 while it draws its fourth batch: both ranks stop
/// before that step, after exactly the three steps of epoch 1.
#[test]
fn an_interrupt_on_one_rank_stops_every_rank_at_the_same_step() {
    let corpus = Corpus::new(TEXT);
    let dir = temp_dir("interrupt");
    let run = learner_run(
        &corpus,
        dir.path(),
        Setup {
            epochs: 3,
            interrupt_at: Some(("rank-0".into(), 3)),
            ..Default::default()
        },
    );
    assert_eq!(run.logged.values("train", 1).len(), 3 * WORLD);
    assert!(run.logged.values("train", 2).is_empty());
    let batches: Vec<Vec<Vec<usize>>> = (0..WORLD)
        .map(|r| run.drawn.of_rank(r)[..3].to_vec())
        .collect();
    let (_, params) = hand_written(&corpus, &batches, 1);
    assert_eq!(bits(&run.params), bits(&params));
}

/// Stages 0 to 2 (replicated parameters; all-reduced, or reduce-scattered gradients) under the
/// Learner equal the hand-written loop too.
#[test]
fn every_lower_stage_matches_the_hand_written_loop() {
    let corpus = Corpus::new(TEXT);
    for stage in 0..=2 {
        let dir = temp_dir(&format!("stage-{stage}"));
        let run = learner_run(
            &corpus,
            dir.path(),
            Setup {
                epochs: 2,
                stage: Some(stage),
                ..Default::default()
            },
        );
        let batches: Vec<_> = (0..WORLD).map(|r| run.drawn.of_rank(r)).collect();
        let (_, params) = hand_written_at(&corpus, &batches, 1, stage);
        assert_eq!(bits(&run.params), bits(&params), "stage {stage}");
    }
}

/// burn-train's early stopping, decided on rank 0 and followed by every rank: a run of 3 epochs
/// told to stop after the first trains exactly one, and ends with the model of one epoch.
#[test]
fn early_stopping_stops_every_rank_after_the_same_epoch() {
    let corpus = Corpus::new(TEXT);
    let dir = temp_dir("early");
    let run = learner_run(
        &corpus,
        dir.path(),
        Setup {
            epochs: 3,
            stop_after: Some(1),
            ..Default::default()
        },
    );
    assert!(run.logged.values("train", 2).is_empty());
    let batches: Vec<_> = (0..WORLD).map(|r| run.drawn.of_rank(r)).collect();
    assert!(batches.iter().all(|b| b.len() == 3), "{batches:?}");
    let (_, params) = hand_written(&corpus, &batches, 1);
    assert_eq!(bits(&run.params), bits(&params));
}

#[test]
fn fewer_training_items_than_ranks_is_refused_by_name() {
    let corpus = Corpus::new(TEXT);
    let dir = temp_dir("few");
    let message = failure(|| {
        learner_run(
            &corpus,
            dir.path(),
            Setup {
                epochs: 1,
                train_windows: Some(1),
                ..Default::default()
            },
        )
    });
    assert!(
        message.contains("the training data loader has 1 items for 2 ranks"),
        "{message}"
    );
}

/// The Learner trains every placement: half the chunks' parameter shards and optimizer state in
/// host memory (the optimizer's part stepped there on Flex) ends bitwise where everything on the
/// device does, and the checkpoint it saves resumes with everything on the device.
#[test]
fn every_placement_trains_under_the_learner_the_same_bits() {
    let corpus = Corpus::new(TEXT);
    let on_device = learner_run(
        &corpus,
        temp_dir("placement-device").path(),
        Setup {
            epochs: 1,
            ..Setup::default()
        },
    );
    let checkpoints = temp_dir("placement-host-checkpoints");
    let placed = |placement: Placement| {
        ZeroStrategy::<Flex>::new(
            WORLD,
            Default::default(),
            zero_config().with_placement(placement),
        )
        .with_seed(3)
        .with_timeout(Duration::from_secs(60))
    };
    let on_host = learner_run(
        &corpus,
        temp_dir("placement-host").path(),
        Setup {
            strategy: Some(placed(Placement::fractions(0.5, 0.5))),
            checkpoints: Some(checkpoints.path().to_path_buf()),
            epochs: 1,
            ..Setup::default()
        },
    );
    assert_eq!(bits(&on_host.params), bits(&on_device.params));
    // Its checkpoint of epoch 1 resumes with the optimizer whole on the device.
    let resumed = learner_run(
        &corpus,
        temp_dir("placement-resumed").path(),
        Setup {
            strategy: Some(placed(Placement::device())),
            checkpoints: Some(checkpoints.path().to_path_buf()),
            resume_after: Some(1),
            epochs: 2,
            ..Setup::default()
        },
    );
    let straight = learner_run(
        &corpus,
        temp_dir("placement-straight").path(),
        Setup {
            epochs: 2,
            ..Setup::default()
        },
    );
    assert_eq!(bits(&resumed.params), bits(&straight.params));
}
