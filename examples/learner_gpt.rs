//! The character-level GPT trained through burn-train's `Learner` under ZeRO: Burn's metrics,
//! renderer, scheduler and metric logs, with every rank holding 1/N of the model state.
//!
//! ```sh
//! cargo run --example learner_gpt                    # 2 CPU ranks, stage 3, 2 epochs
//! cargo run --example learner_gpt -- --checkpoint-dir /tmp/ckpt --epochs 1
//! cargo run --example learner_gpt -- --checkpoint-dir /tmp/ckpt --epochs 2 --resume-after 1
//! # CUDA: one process per GPU under zero-run (NCCL), or --world-size GPUs of this process
//! cargo build --release --features cuda --example learner_gpt
//! zero-run --nproc-per-node 2 -- target/release/examples/learner_gpt --backend cuda
//! ```
//!
//! Against an ordinary Learner setup, the ZeRO lines are the backend type (`Autodiff<Zero<B>>`),
//! the optimizer (`ZeroOptimizer`) and the training strategy (`ZeroStrategy`). The bundled text
//! is the data: its first 90% trains, the rest validates. Burn's terminal dashboard shows up
//! on a terminal when burn-train's `tui` feature is on; otherwise (pipes, CI, `zero-run`) its
//! plain renderer prints progress, and the metrics go to `<dir>/train` and `<dir>/valid`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::module::Module;
use burn::optim::AdamConfig;
use burn::optim::SimpleOptimizer;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::tensor::backend::Backend;
use burn_train::metric::{AccuracyMetric, LearningRateMetric, LossMetric};
use burn_train::{Learner, SupervisedTraining, TrainingStrategy};
use burn_zero::comm::sync::lock;
use burn_zero::optim::StateBytes;
use burn_zero::{OptimizerConfig, PerTensor, Placement, Zero, ZeroConfig, ZeroOptimizer};
use burn_zero_gpt::learner::{TextBatch, TextGpt, WindowBatcher, windows};
use burn_zero_gpt::train::process::{ProcessRank, Timeouts};
use burn_zero_gpt::{Corpus, Materialise, Preset, TEXT, param_values, params_digest};
use burn_zero_train::ZeroStrategy;
use clap::Parser;

/// Train the GPT with burn-train's Learner under ZeRO.
#[derive(Parser, Debug)]
#[command(name = "learner_gpt")]
struct Args {
    /// Where the ranks compute: flex (CPU threads), or cuda (a build with `--features cuda`:
    /// one process per GPU under zero-run, else --world-size GPUs of this process).
    #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
    backend: BackendArg,
    /// Ranks (threads of this process; under a launcher, mpirun, srun or zero-run, this
    /// process is one rank and the job's size is used).
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// ZeRO stage, 0 to 3.
    #[arg(long, default_value_t = 3)]
    stage: u8,
    /// Model size: tiny, small, base or gpt2.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Epochs to train.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Windows per batch on each rank.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Symbols per window.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Training windows per epoch (at most what 90% of the text holds).
    #[arg(long, default_value_t = 1024)]
    train_windows: usize,
    /// Micro-batches per optimizer step (`ZeroOptimizer::with_accumulation`).
    #[arg(long, default_value_t = 1)]
    accumulation: usize,
    /// Peak learning rate (cosine decay to a tenth of it over the run).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of the model and of each epoch's deal of the data to the ranks.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where burn-train writes its logs and metrics.
    #[arg(long, default_value = "target/learner_gpt")]
    dir: PathBuf,
    /// Save a sharded checkpoint here after every epoch.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Resume from the checkpoint saved after this epoch (needs --checkpoint-dir).
    #[arg(long)]
    resume_after: Option<usize>,
    /// The optimizer: `fused-adam` or `burn-adam` (the same bits on Flex).
    #[arg(long, value_enum, default_value_t = OptimizerArg::FusedAdam)]
    optimizer: OptimizerArg,
    /// Stage 3: the fraction (0 to 1) of the chunks' parameter shards kept in host memory.
    #[arg(long, default_value_t = 0.0)]
    offload_param_frac: f64,
    /// The fraction (0 to 1) of the chunks' optimizer state kept and stepped on the host.
    #[arg(long, default_value_t = 0.0)]
    offload_optim_frac: f64,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum BackendArg {
    Flex,
    Cuda,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum OptimizerArg {
    /// burn-zero's fused Adam (one pass, one kernel launch per chunk).
    FusedAdam,
    /// Burn's own Adam, tensor by tensor, for comparison.
    BurnAdam,
}

fn main() {
    let args = Args::parse();
    let config = ZeroConfig::new()
        .with_stage(args.stage)
        .with_persist_below_numel(1024)
        .with_placement(Placement::fractions(
            args.offload_param_frac,
            args.offload_optim_frac,
        ));
    let result = match args.backend {
        BackendArg::Flex => flex_strategy(&args, config).and_then(|(world, strategy)| {
            run_with::<Flex>(&args, world, Default::default(), strategy)
        }),
        #[cfg(feature = "cuda")]
        BackendArg::Cuda => cuda_strategy(&args, config)
            .and_then(|(world, device, strategy)| run_with(&args, world, device, strategy)),
        #[cfg(not(feature = "cuda"))]
        BackendArg::Cuda => Err(
            "--backend cuda: this build has no CUDA backend; rebuild with --features cuda".into(),
        ),
    };
    if let Err(error) = result {
        eprintln!("learner_gpt: {error}");
        std::process::exit(1);
    }
}

/// The CPU ranks: this process's one rank of a job a launcher started (mpirun, srun or
/// zero-run; through MPI), or `--world-size` threads of this process.
fn flex_strategy(args: &Args, config: ZeroConfig) -> Result<(usize, ZeroStrategy<Flex>), String> {
    let Some(process) = ProcessRank::<Flex>::from_launcher("flex", Timeouts::default())? else {
        let strategy = ZeroStrategy::<Flex>::new(args.world_size, Default::default(), config);
        return Ok((args.world_size, strategy));
    };
    let world = process.world_size();
    let rank = Mutex::new(Some(process.into_context()));
    let strategy = ZeroStrategy::<Flex>::this_process(
        move || {
            lock(&rank)
                .take()
                .ok_or("this process's rank is already connected")
        },
        config,
    )
    // Rank 0's metrics count every rank's items, as with ranks on threads.
    .with_items_from_every_rank::<
        burn_train::ClassificationOutput<Autodiff<Zero<Flex>>>,
        burn_train::ClassificationOutput<Zero<Flex>>,
    >();
    Ok((world, strategy))
}

/// The CUDA ranks: this process's one rank of a zero-run job (NCCL), or one thread per GPU of
/// this process (`LocalGroup`).
#[cfg(feature = "cuda")]
fn cuda_strategy(
    args: &Args,
    config: ZeroConfig,
) -> Result<
    (
        usize,
        burn_zero::comm::nccl::CudaDevice,
        ZeroStrategy<burn_zero::comm::nccl::CudaBackend>,
    ),
    String,
> {
    use burn_zero::comm::nccl::{CudaBackend, CudaDevice, NcclGroup, NcclOptions};
    use burn_zero::comm::{Communicator, RankContext};
    use burn_zero::launcher::DistEnv;

    let visible =
        burn_zero::comm::nccl::cuda_device_count().map_err(|e| format!("--backend cuda: {e}"))?;
    if visible == 0 {
        return Err("--backend cuda: no CUDA device is visible".into());
    }
    if DistEnv::is_launched() {
        let env = DistEnv::from_env().map_err(|e| e.to_string())?;
        let device = CudaDevice::new(env.local_rank);
        let strategy = ZeroStrategy::<CudaBackend>::this_process(
            || {
                let group = NcclGroup::from_env(&NcclOptions::default())?;
                let device = group.device().clone();
                let comm: Arc<dyn Communicator<CudaBackend>> = Arc::new(group);
                Ok::<_, burn_zero::comm::CommError>(RankContext::new(device, comm))
            },
            config,
        )
        // Rank 0's metrics count every rank's items, as with ranks on threads.
        .with_items_from_every_rank::<
            burn_train::ClassificationOutput<Autodiff<Zero<CudaBackend>>>,
            burn_train::ClassificationOutput<Zero<CudaBackend>>,
        >();
        return Ok((env.world_size, device, strategy));
    }
    if args.world_size > visible {
        return Err(format!(
            "--backend cuda --world-size {}: {visible} CUDA device(s) visible",
            args.world_size
        ));
    }
    let devices: Vec<CudaDevice> = (0..args.world_size).map(CudaDevice::new).collect();
    let device = devices[0].clone();
    Ok((
        args.world_size,
        device,
        ZeroStrategy::on_devices(devices, config),
    ))
}

/// [`run`] with the optimizer `--optimizer` names.
fn run_with<B: Backend>(
    args: &Args,
    world_size: usize,
    device: B::Device,
    strategy: ZeroStrategy<B>,
) -> Result<(), String> {
    match args.optimizer {
        OptimizerArg::FusedAdam => run(args, world_size, device, strategy, AdamConfig::new()),
        OptimizerArg::BurnAdam => {
            let adam = PerTensor(AdamConfig::new().build());
            run(args, world_size, device, strategy, adam)
        }
    }
}

/// Trains on `world_size` ranks computing on `B` (the model initialised on `device`), as
/// `strategy` starts them, with the optimizer `adam` configures.
fn run<B: Backend, C>(
    args: &Args,
    world_size: usize,
    device: B::Device,
    strategy: ZeroStrategy<B>,
    adam: C,
) -> Result<(), String>
where
    C: OptimizerConfig,
    C::Optimizer: SimpleOptimizer<B> + SimpleOptimizer<Flex>,
    <C::Optimizer as SimpleOptimizer<B>>::State<1>: StateBytes,
    <C::Optimizer as SimpleOptimizer<Flex>>::State<1>: StateBytes,
{
    let preset = checked_preset(args)?;
    let corpus = Corpus::new(TEXT);
    let split = corpus.len() * 9 / 10;
    if args.seq_len + 1 >= corpus.len() - split {
        return Err(format!("--seq-len {} does not fit the text", args.seq_len));
    }

    // Data: windows of the text, batched by burn-train's ordinary data loaders.
    let Data { train, valid, take } = data_loaders::<B>(args, &corpus, split);

    // The model and the learner: an ordinary Learner, with ZeroOptimizer as its optimizer.
    let model = init_model::<B>(args, preset, &corpus, &device);
    let parameters = model.num_params();
    let steps_per_epoch = (take / world_size).div_ceil(args.batch_size);
    let total = (steps_per_epoch * args.epochs).max(1);
    let scheduler = CosineAnnealingLrSchedulerConfig::new(args.lr, total)
        .with_min_lr(args.lr / 10.0)
        .init()
        .map_err(|e| format!("the learning-rate schedule: {e}"))?;
    let optimizer = ZeroOptimizer::<B, C::Optimizer>::unbound(adam)
        .map_err(|e| format!("the optimizer: {e}"))?
        .with_accumulation(args.accumulation);
    let learner = Learner::new(model, optimizer, scheduler);

    // The strategy: ranks and ZeRO settings (from `main`), data deal, sharded checkpoints.
    let mut strategy = strategy.with_seed(args.seed);
    if let Some(dir) = &args.checkpoint_dir {
        strategy = strategy.with_checkpoints(dir);
    }
    println!(
        "learner_gpt: {} ({parameters} parameters), {} rank(s), ZeRO stage {}, {} epoch(s) of \
         {steps_per_epoch} steps",
        preset.name(),
        world_size,
        args.stage,
        args.epochs
    );

    let mut training = SupervisedTraining::new(&args.dir, train, valid)
        .metric_train_numeric(LossMetric::<Flex>::new())
        .metric_valid_numeric(LossMetric::<Flex>::new())
        .metric_train_numeric(AccuracyMetric::<Flex>::new())
        .metric_valid_numeric(AccuracyMetric::<Flex>::new())
        .metric_train_numeric(LearningRateMetric::new())
        .num_epochs(args.epochs)
        .summary()
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
    if let Some(epoch) = args.resume_after {
        training = training.checkpoint(epoch);
    }
    let result = training.launch(learner);
    print_trained(args, &result.model, &corpus, split, &device);
    Ok(())
}

/// The model preset `--preset` names, after checking the flags that need no text: the stage
/// exists, the sizes are at least 1, and `--resume-after` has a checkpoint folder.
fn checked_preset(args: &Args) -> Result<Preset, String> {
    let preset: Preset = args
        .preset
        .parse()
        .map_err(|error| format!("--preset: {error}"))?;
    if args.stage > 3 {
        return Err(format!("--stage {} does not exist (0 to 3)", args.stage));
    }
    if args.world_size == 0 || args.batch_size == 0 || args.seq_len == 0 {
        return Err("--world-size, --batch-size and --seq-len must be at least 1".into());
    }
    if args.resume_after.is_some() && args.checkpoint_dir.is_none() {
        return Err("--resume-after needs --checkpoint-dir".into());
    }
    Ok(preset)
}

/// A data loader of text windows on backend `B`.
type Loader<B> = Arc<dyn DataLoader<B, TextBatch<B>>>;

/// The learner's data: its two loaders, and how many windows an epoch trains on.
struct Data<B: Backend> {
    train: Loader<Autodiff<Zero<B>>>,
    valid: Loader<Zero<B>>,
    /// Training windows per epoch.
    take: usize,
}

/// The training loader (at most `--train-windows` windows of the text before `split`), the
/// validation loader (the windows after it), and how many training windows there are.
fn data_loaders<B: Backend>(args: &Args, corpus: &Corpus, split: usize) -> Data<B> {
    let mut train_windows = windows(corpus, 0..split, args.seq_len);
    let available = burn::data::dataset::Dataset::len(&train_windows);
    let take = args.train_windows.min(available);
    train_windows = burn::data::dataset::InMemDataset::new(
        (0..take)
            .filter_map(|i| burn::data::dataset::Dataset::get(&train_windows, i))
            .collect(),
    );
    let batcher = WindowBatcher::new(corpus, args.seq_len);
    let train = DataLoaderBuilder::<Autodiff<Zero<B>>, _, _>::new(batcher.clone())
        .batch_size(args.batch_size)
        .build(train_windows);
    let valid = DataLoaderBuilder::<Zero<B>, _, _>::new(batcher)
        .batch_size(args.batch_size)
        .build(windows(corpus, split..corpus.len(), args.seq_len));
    Data { train, valid, take }
}

/// The GPT of `preset` for the corpus' symbols, initialised on `device` from `--seed` and
/// materialised, wrapped for burn-train.
fn init_model<B: Backend>(
    args: &Args,
    preset: Preset,
    corpus: &Corpus,
    device: &B::Device,
) -> TextGpt<Autodiff<Zero<B>>> {
    <Autodiff<Zero<B>> as Backend>::seed(device, args.seed);
    let gpt = preset
        .config(corpus.vocab(), args.seq_len)
        .init::<Autodiff<Zero<B>>>(device);
    gpt.visit(&mut Materialise);
    TextGpt { gpt }
}

/// The trained model's loss on 4 validation windows (those from `split` on), its parameters'
/// digest and where the metrics are. The model the learner returns is gathered: an ordinary
/// model on this thread.
fn print_trained<B: Backend>(
    args: &Args,
    model: &TextGpt<Zero<B>>,
    corpus: &Corpus,
    split: usize,
    device: &B::Device,
) {
    let probe = WindowBatcher::new(corpus, args.seq_len).tensors::<Zero<B>>(
        &(0..4).map(|i| split + i * args.seq_len).collect::<Vec<_>>(),
        device,
    );
    let loss = model.classify(probe).loss.into_scalar();
    println!("learner_gpt: the trained model's loss on 4 validation windows: {loss:.4}");
    println!(
        "learner_gpt: final parameters: {}",
        params_digest(&param_values(model))
    );
    println!(
        "learner_gpt: metrics under {}",
        args.dir.join("train").display()
    );
}
