//! Trains a small GPT (decoder-only transformer, tied output head) character by character on
//! chapters of *Around the World in Eighty Days*, ZeRO-sharded over ranks on one machine.
//!
//! ```text
//! cargo run --example train_gpt                       # 2 ranks, stage 3, Flex, tiny model
//! cargo run --example train_gpt -- --world-size 4 --stage 2 --model small --precision bf16
//! cargo run --example train_gpt -- --memory-report memory.json
//! cargo run --example train_gpt -- --checkpoint-dir ckpt --save-every 50 --steps 100
//! cargo run --example train_gpt -- --checkpoint-dir ckpt --resume --world-size 3 --steps 200
//! cargo run --example train_gpt -- --adapter-rank 4          # frozen base, trainable adapters
//! ```
//!
//! Rank 0 shows a progress bar with the loss (the mean over ranks, all-reduced), tokens per
//! second and its memory accounting; at the end every rank generates the same sample in
//! lockstep, and a table gives each rank's memory, throughput and losses.

use std::time::{Duration, Instant};

use burn::backend::{Flex, NdArray, Wgpu};
use burn::tensor::DType;
use burn::tensor::backend::Backend;
use clap::{ArgAction, Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use burn_zero::{Capacity, ChunkSize, Placement};
#[cfg(feature = "cuda")]
use burn_zero_gpt::train::cuda;
use burn_zero_gpt::train::process::{ProcessRank, Timeouts};
use burn_zero_gpt::train::{
    Fault, OptimizerKind, PROMPT, RankFn, RankOutcome, RunConfig, StepInfo, local_ranks, train_with,
};
use burn_zero_gpt::{Corpus, Preset, TEXT, params_digest};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// Burn's NdArray CPU backend (f32 only).
    Ndarray,
    /// Burn's Flex CPU backend (f32, f16, bf16; bitwise deterministic).
    Flex,
    /// Burn's wgpu backend (Vulkan, Metal, DX12; Mesa's lavapipe without a GPU).
    Wgpu,
    /// `CubeBackend<CudaRuntime>` with NCCL (needs the `cuda` feature): one GPU per rank, ranks
    /// on threads, or one process per GPU under `zero-run`.
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OptimizerArg {
    /// burn-zero's fused Adam.
    FusedAdam,
    /// Burn's own Adam, tensor by tensor.
    BurnAdam,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PrecisionArg {
    F32,
    F16,
    Bf16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModelArg {
    /// d_model 64, 4 heads, 2 blocks (~0.1M parameters).
    Tiny,
    /// d_model 192, 6 heads, 4 blocks (~1.8M parameters).
    Small,
    /// d_model 384, 6 heads, 6 blocks (~10.7M parameters).
    Base,
    /// GPT-2 small's shape: d_model 768, 12 heads, 12 blocks (~85M parameters here); a GPU's.
    Gpt2,
}

/// The run's defaults (one source for the command line and the test).
fn defaults() -> RunConfig {
    RunConfig::new()
}

#[derive(Parser, Debug)]
#[command(about = "Character-level GPT trained with ZeRO-sharded data parallelism (burn-zero)")]
struct Args {
    /// Ranks (one thread each, in-process communicator; with `--backend cuda` one GPU each).
    /// Under a launcher (mpirun, srun, zero-run) this process is one rank, and the job's size
    /// is used.
    #[arg(long, default_value_t = defaults().world_size)]
    world_size: usize,
    /// ZeRO stage: 0 plain data parallel, 1 optimizer state, 2 + gradients, 3 + parameters.
    #[arg(long, default_value_t = defaults().stage, value_parser = clap::value_parser!(u8).range(0..=3))]
    stage: u8,
    /// Backend every rank computes on.
    #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
    backend: BackendArg,
    /// Parameter and compute dtype (fp32 master weights and optimizer state either way).
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32)]
    precision: PrecisionArg,
    /// Model size.
    #[arg(long, value_enum, default_value_t = ModelArg::Tiny)]
    model: ModelArg,
    /// Fine-tune LoRA-style: add a low-rank adapter of this rank after each block and freeze
    /// every other parameter (sharded, never reduced, no optimizer state). 0: train everything.
    #[arg(long, default_value_t = defaults().adapter_rank)]
    adapter_rank: usize,
    /// Gradient bucket size in MiB (0: one collective per parameter).
    #[arg(long, default_value_t = defaults().bucket_mb)]
    bucket_mb: f64,
    /// Reduce gradient buckets on a communication thread during backward.
    #[arg(long, default_value_t = defaults().overlap_comm, action = ArgAction::Set)]
    overlap_comm: bool,
    /// Reduce every gradient as an all-to-all summed in rank order on each rank: the sums have
    /// the bits of one rank accumulating the same micro-batches on any engine with an
    /// all-to-all (NCCL, MPI, the in-process group), where NCCL's own reductions add in an
    /// order of their choosing. The same bytes cross the links; each rank receives into a
    /// buffer of the whole bucket.
    #[arg(long)]
    reduce_in_rank_order: bool,
    /// Parameters with fewer elements stay replicated (stage 3).
    #[arg(long, default_value_t = defaults().persist_below)]
    persist_below: usize,
    /// Hybrid sharding: shard within groups of this many ranks and replicate across the
    /// groups (must divide --world-size; 0: shard over all ranks).
    #[arg(long, default_value_t = defaults().shard_group_size)]
    shard_group_size: usize,
    /// Stage 3: parameter gathers issued ahead of use, in the order the first step recorded
    /// (0: gather on demand).
    #[arg(long, default_value_t = defaults().prefetch)]
    prefetch: usize,
    /// How parameters are grouped into chunks, each gathered (stage 3) and reduced with one
    /// collective: `auto` (`search` on wgpu and CUDA, `param` on Flex and NdArray), `param`
    /// (one parameter per chunk, gradients in --bucket-mb buckets), `search` (the size
    /// searched for the model), or a size in elements (`262144`) or MiB (`4MiB`).
    #[arg(long, default_value = "auto", value_parser = parse_chunk_size)]
    chunk_size: ChunkSize,
    /// Stage 3: the fraction (0 to 1) of the sharded chunks' bytes whose parameter shards live
    /// in host memory, uploaded for each gather (parameter offload; 0: all on the device).
    #[arg(long, default_value_t = 0.0)]
    offload_param_frac: f64,
    /// The fraction (0 to 1) of the trainable chunks' optimizer state (fp32 masters, Adam's
    /// moments) kept in host memory and stepped there on the CPU (Flex), whole chunks in layout
    /// order; the rest stays on the device. 0 by default; 1 under the auto placement.
    #[arg(long)]
    offload_optim_frac: Option<f64>,
    /// Stage 3: place parameter shards by measurement under this device capacity in MiB (a
    /// two-step warm-up with every shard on the host, then the shards that fit move to the
    /// device); needs a device backend (wgpu, CUDA).
    #[arg(long)]
    auto_placement_mib: Option<f64>,
    /// Stage 3: the same placement under the capacity the CUDA driver reports (free memory
    /// when the model is sharded, plus what cubecl holds reserved); CUDA only.
    #[arg(long, conflicts_with = "auto_placement_mib")]
    auto_placement_device: bool,
    /// Under the auto placement: the fraction (0 to 1) of the device memory it leaves over
    /// that host chunks' optimizer state may take, moving there once to step on the device.
    #[arg(long, default_value_t = 0.0)]
    gpu_margin_mem_ratio: f64,
    /// The optimizer: `fused-adam` (one pass, one kernel launch per chunk) or `burn-adam`
    /// (Burn's Adam tensor by tensor, for comparison); the same bits on Flex, NdArray and wgpu.
    #[arg(long, value_enum, default_value_t = OptimizerArg::FusedAdam)]
    optimizer: OptimizerArg,
    /// Optimizer steps.
    #[arg(long, default_value_t = defaults().steps)]
    steps: usize,
    /// Global batch (sequences per step), split evenly across ranks and micro-steps.
    #[arg(long, default_value_t = defaults().batch_size)]
    batch_size: usize,
    /// Micro-steps per optimizer step (gradient accumulation).
    #[arg(long, default_value_t = defaults().accumulation)]
    accumulation: usize,
    /// Adam's learning rate.
    #[arg(long, default_value_t = defaults().lr)]
    lr: f64,
    /// Context length in characters.
    #[arg(long, default_value_t = defaults().seq_len)]
    seq_len: usize,
    /// Seed of the initial model, the batches and the sample.
    #[arg(long, default_value_t = defaults().seed)]
    seed: u64,
    /// Characters to generate after training (0: none).
    #[arg(long, default_value_t = defaults().sample_len)]
    sample_len: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = defaults().temperature)]
    temperature: f32,
    /// Write every rank's memory report (JSON array) to this file.
    #[arg(long)]
    memory_report: Option<std::path::PathBuf>,
    /// Directory of sharded checkpoints (one `step-*` directory per save, the last two kept).
    #[arg(long)]
    checkpoint_dir: Option<std::path::PathBuf>,
    /// Save a checkpoint every this many steps (0: only after the last step).
    #[arg(long, default_value_t = 0)]
    save_every: usize,
    /// Resume from the latest checkpoint in --checkpoint-dir (saved at any world size/stage).
    #[arg(long)]
    resume: bool,
    /// Ranks in separate processes (started by mpirun, srun or zero-run): seconds a
    /// collective waits for the other ranks before the job fails naming it.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Ranks in separate processes: seconds the ranks may take to meet at the start.
    #[arg(long, default_value_t = 300.0)]
    rendezvous_timeout: f64,
    /// Fail on purpose: rank RANK panics or is killed (`RANK:STEP:panic`, `RANK:STEP:kill`)
    /// in the middle of step STEP; for testing how a job of several processes stops.
    #[arg(long, hide = true)]
    fail_at: Option<Fault>,
}

impl Args {
    /// The placement the flags ask for: the auto policy with a capacity, else the static
    /// fractions (everything on the device when both are 0). Bad values are refused by name
    /// when the run's configuration is checked.
    fn placement(&self) -> Placement {
        let capacity = match (self.auto_placement_mib, self.auto_placement_device) {
            (Some(mib), _) => Some(Capacity::MiB(mib)),
            (None, true) => Some(Capacity::Device),
            (None, false) => None,
        };
        let placement = match capacity {
            Some(capacity) => Placement::auto(capacity),
            None => Placement::device(),
        };
        let placement = match self.offload_optim_frac {
            Some(fraction) => placement.with_offload_optim_frac(fraction),
            None => placement,
        };
        placement
            .with_offload_param_frac(self.offload_param_frac)
            .with_gpu_margin_mem_ratio(self.gpu_margin_mem_ratio)
    }

    fn run_config(&self) -> RunConfig {
        RunConfig {
            world_size: self.world_size,
            stage: self.stage,
            preset: match self.model {
                ModelArg::Tiny => Preset::Tiny,
                ModelArg::Small => Preset::Small,
                ModelArg::Base => Preset::Base,
                ModelArg::Gpt2 => Preset::Gpt2,
            },
            adapter_rank: self.adapter_rank,
            precision: match self.precision {
                PrecisionArg::F32 => DType::F32,
                PrecisionArg::F16 => DType::F16,
                PrecisionArg::Bf16 => DType::BF16,
            },
            bucket_mb: self.bucket_mb,
            overlap_comm: self.overlap_comm,
            reduce_in_rank_order: self.reduce_in_rank_order,
            persist_below: self.persist_below,
            shard_group_size: self.shard_group_size,
            prefetch: self.prefetch,
            chunk_size: self.chunk_size,
            placement: self.placement(),
            optimizer: match self.optimizer {
                OptimizerArg::FusedAdam => OptimizerKind::FusedAdam,
                OptimizerArg::BurnAdam => OptimizerKind::BurnAdam,
            },
            steps: self.steps,
            batch_size: self.batch_size,
            accumulation: self.accumulation,
            lr: self.lr,
            seq_len: self.seq_len,
            seed: self.seed,
            sample_len: self.sample_len,
            temperature: self.temperature,
            keep_params: true,
            checkpoint_dir: self.checkpoint_dir.clone(),
            save_every: self.save_every,
            resume: self.resume,
            fault: self.fail_at,
        }
    }
}

fn main() {
    let args = Args::parse();
    let result = match args.backend {
        BackendArg::Flex => run_ranks::<Flex>(&args, "flex"),
        BackendArg::Ndarray => run_ranks::<NdArray>(&args, "ndarray"),
        BackendArg::Wgpu => run_ranks::<Wgpu>(&args, "wgpu"),
        // NCCL between GPUs: this process's ranks, or its one rank of a zero-run job.
        #[cfg(feature = "cuda")]
        BackendArg::Cuda => cuda::CudaRanks::new(args.world_size).and_then(|ranks| {
            let (world, device) = (ranks.world_size(), ranks.device());
            run::<cuda::Backend>(&args, world, device, |rank_fn| ranks.run(rank_fn))
        }),
        #[cfg(not(feature = "cuda"))]
        BackendArg::Cuda => Err(
            "--backend cuda: this build has no CUDA backend; rebuild with --features cuda".into(),
        ),
    };
    if let Err(error) = result {
        eprintln!("train_gpt: {error}");
        std::process::exit(1);
    }
}

/// Trains on `B`: this process's rank of a job a launcher started (one rank per process,
/// through MPI), or `--world-size` ranks on threads of this process.
fn run_ranks<B: Backend>(args: &Args, name: &str) -> Result<(), String> {
    let seconds = |flag: &str, value: f64| {
        (value.is_finite() && value > 0.0)
            .then(|| Duration::from_secs_f64(value))
            .ok_or_else(|| format!("{flag} {value} must be a positive number of seconds"))
    };
    let timeouts = Timeouts {
        collective: seconds("--timeout", args.timeout)?,
        rendezvous: seconds("--rendezvous-timeout", args.rendezvous_timeout)?,
    };
    match ProcessRank::<B>::from_launcher(name, timeouts)? {
        Some(process) => {
            let (world, device) = (process.world_size(), process.device());
            run::<B>(args, world, device, |rank_fn| process.run(rank_fn))
        }
        None => {
            let world = args.world_size;
            let device = B::Device::default();
            run::<B>(args, world, device.clone(), local_ranks::<B>(world, device))
        }
    }
}

/// `--chunk-size`: `auto`, `param`, `search`, elements, or MiB with the suffix `MiB`.
fn parse_chunk_size(text: &str) -> Result<ChunkSize, String> {
    match text {
        "auto" => Ok(ChunkSize::Auto),
        "param" => Ok(ChunkSize::PerParameter),
        "search" => Ok(ChunkSize::default_search()),
        _ => {
            let size = if let Some(mib) = text.strip_suffix("MiB") {
                mib.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|mib| mib.is_finite() && *mib > 0.0)
                    .map(ChunkSize::MiB)
            } else {
                text.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .map(ChunkSize::Elements)
            };
            size.ok_or_else(|| {
                format!(
                    "{text:?} is not a chunk size: give `auto`, `param`, `search`, a positive number of \
                     elements or of MiB (`4MiB`)"
                )
            })
        }
    }
}

/// The command-line names of the backend and the dtype.
fn names(args: &Args) -> (String, String) {
    let name = |value: Option<clap::builder::PossibleValue>| {
        value.map(|v| v.get_name().to_string()).unwrap_or_default()
    };
    (
        name(args.backend.to_possible_value()),
        name(args.precision.to_possible_value()),
    )
}

/// Trains on `world_size` ranks (the whole job's), started by `ranks` (see `train_with`), the
/// model initialised on `device`; prints progress, the sample and the summary.
fn run<B: Backend>(
    args: &Args,
    world_size: usize,
    device: B::Device,
    ranks: impl FnOnce(&RankFn<'_, B>) -> Result<Vec<RankOutcome>, String>,
) -> Result<(), String> {
    let config = checked_config::<B>(args, world_size, &device)?;
    print_setup(args, &config);
    let bar = progress_bar(config.steps);
    let on_step = step_printer(&bar, &config);
    let started = Instant::now();
    let ranks = train_with::<B>(&config, device, on_step, ranks)?;
    bar.finish_and_clear();
    let wall = started.elapsed().as_secs_f64();
    finish(args, &config, &ranks, wall)
}

/// The run's configuration for `world_size` ranks, refused before any training starts when
/// it is invalid, when `--memory-report` cannot be written, or when the backend does not
/// support the parameters' dtype on `device`.
fn checked_config<B: Backend>(
    args: &Args,
    world_size: usize,
    device: &B::Device,
) -> Result<RunConfig, String> {
    let config = RunConfig {
        world_size,
        ..args.run_config()
    };
    config.validate()?;
    // A report that cannot be written fails now, not after the whole run.
    if let Some(path) = &args.memory_report {
        check_writable(path).map_err(|e| format!("--memory-report {}: {e}", path.display()))?;
    }
    let (backend, precision) = names(args);
    if !B::supports_dtype(device, config.precision) {
        return Err(format!(
            "the {backend} backend does not support {precision} parameters (try --precision f32, \
             or --backend flex for f16/bf16)"
        ));
    }
    Ok(config)
}

/// The opening line: the model, the corpus, the ranks, stage, backend and dtype, the batch and
/// the optimizer.
fn print_setup(args: &Args, config: &RunConfig) {
    let (backend, precision) = names(args);
    let corpus = Corpus::new(TEXT);
    println!(
        "GPT '{}' on {} characters ({} symbols) | {} ranks, ZeRO stage {}, {backend} {precision} | \
         global batch {} × {} characters, {} micro-step(s), {} steps, Adam lr {}",
        config.preset.name(),
        corpus.len(),
        corpus.vocab(),
        config.world_size,
        config.stage,
        config.batch_size,
        config.seq_len,
        config.accumulation,
        config.steps,
        config.lr
    );
}

/// Rank 0's progress bar over `steps` steps.
fn progress_bar(steps: usize) -> ProgressBar {
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}")
            .expect("a valid template"),
    );
    bar
}

/// What each step reports: its loss, throughput and rank 0's memory as the bar's message,
/// also printed above the bar for every tenth of the run and for the last step.
fn step_printer<'a>(bar: &'a ProgressBar, config: &'a RunConfig) -> impl Fn(&StepInfo) + Sync + 'a {
    let every = (config.steps / 10).max(1);
    move |info: &StepInfo| {
        let memory = info
            .memory
            .as_ref()
            .map(|m| {
                format!(
                    " | rank 0: model state {}, gathered peak {}",
                    bytes(m.model_state_bytes()),
                    bytes(m.gathered.peak)
                )
            })
            .unwrap_or_default();
        let line = format!(
            "step {:>4}  loss {:.4}  {:>7.0} tok/s{memory}",
            info.step, info.loss, info.tokens_per_s
        );
        bar.set_message(line.clone());
        bar.inc(1);
        if info.step.is_multiple_of(every) || info.step + 1 == config.steps {
            bar.suspend(|| println!("{line}"));
        }
    }
}

/// After training: where it resumed from, the sample, the summary, the check that every rank
/// ended with the same parameters and generated the same sample, and the memory report.
/// Fails when there was nothing to train (a fresh run of 0 steps) or the ranks disagree.
fn finish(args: &Args, config: &RunConfig, ranks: &[RankOutcome], wall: f64) -> Result<(), String> {
    let first = &ranks[0];
    if let Some(step) = first.resumed_from {
        println!("resumed from the checkpoint of step {step}");
    }
    if first.losses.is_empty() {
        return match first.resumed_from {
            Some(step) => {
                println!(
                    "nothing left to train: the checkpoint is at step {step} and --steps is {}",
                    config.steps
                );
                Ok(())
            }
            None => Err("nothing to train: --steps is 0 (give at least 1)".into()),
        };
    }
    if config.sample_len > 0 {
        println!(
            "\nsample (prompt {PROMPT:?}, temperature {}):\n{}\n",
            config.temperature, first.sample
        );
        if ranks.iter().any(|r| r.sample != first.sample) {
            return Err("ranks generated different samples".into());
        }
    }
    summary(config, ranks, wall);
    // Every rank must end with the same model (read back gathered at stage 3), bit for bit.
    if ranks.iter().any(|r| !same_bits(&r.params, &first.params)) {
        return Err("ranks ended with different parameters".into());
    }
    println!("every rank holds the same final parameters");
    if let Some(params) = &first.params {
        println!("final parameters: {}", params_digest(params));
    }
    if let Some(path) = &args.memory_report {
        write_report(path, args, config, ranks)?;
        println!(
            "memory report: {}",
            own_report_path(path, config, ranks).display()
        );
    }
    Ok(())
}

/// Bytes in KB / MB (powers of ten).
fn bytes(n: u64) -> String {
    match n {
        n if n >= 1_000_000 => format!("{:.2} MB", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} KB", n as f64 / 1e3),
        n => format!("{n} B"),
    }
}

/// The end-of-run summary: the totals, rank 0's counts of its last step, where its state
/// lived and how it gathered, then the per-rank memory table.
fn summary(config: &RunConfig, ranks: &[RankOutcome], wall: f64) {
    let first = &ranks[0];
    print_totals(config, ranks, wall);
    print_step_counts(first);
    print_placement(first);
    print_rank_table(ranks);
}

/// Parameters, the loss from the first to the last step, throughput over all ranks, wall
/// and training time, the gradient bytes reduced per step, and the loss scaler's skips.
fn print_totals(config: &RunConfig, ranks: &[RankOutcome], wall: f64) {
    let first = &ranks[0];
    let (start, end) = (first.losses[0], *first.losses.last().expect("one step"));
    let frozen = match first.parameters - first.trainable {
        0 => String::new(),
        frozen => format!(" ({} trainable, {frozen} frozen)", first.trainable),
    };
    println!(
        "{} parameters{frozen}; loss (mean over ranks) {start:.4} -> {end:.4} in {} steps; \
         {:.0} tokens/s over all ranks; {:.1} s wall (training {:.1} s); gradients reduced per \
         step and rank: {}",
        first.parameters,
        config.steps,
        ranks.iter().map(|r| r.tokens_per_s).sum::<f64>(),
        wall,
        first.seconds,
        bytes(first.reduced_bytes as u64)
    );
    if first.skipped_steps > 0 {
        println!("loss scaler skipped {} step(s)", first.skipped_steps);
    }
}

/// The collectives, synchronisations and host transfers of `first`'s last step, and its
/// chunks.
fn print_step_counts(first: &RankOutcome) {
    let counts = first.step_counts;
    let chunks = first.chunks;
    println!(
        "rank {}'s last step: {} all-gathers, {} reduce-scatters, {} all-reduces, {} other \
         collectives ({} of them answered in place); {} device synchronisations, {} host waits in \
         the engine; {} host reads \
         ({}), {} host writes ({}); chunks: {} sharded, {} replicated, {} padding elements per \
         rank",
        first.rank,
        counts.all_gathers,
        counts.reduce_scatters,
        counts.all_reduces,
        counts.other_collectives,
        counts.in_place,
        counts.syncs,
        counts.engine_waits,
        counts.host_reads,
        bytes(counts.host_read_bytes),
        counts.host_writes,
        bytes(counts.host_write_bytes),
        chunks.sharded,
        chunks.replicated,
        chunks.padding
    );
}

/// Where `first`'s state lived and how it gathered, each line only where it applies: the
/// automatic placement of parameter shards, optimizer state stepped on the host, host shards
/// kept on the device, and the gathers (prefetched, and the time waited for them).
fn print_placement(first: &RankOutcome) {
    if let Some(placed) = first.memory.as_ref().and_then(|m| m.auto_placement) {
        println!(
            "rank {} placed parameter shards automatically: {} chunks on the device, {} on the \
             host (capacity {}, warm-up peak {}, room {})",
            first.rank,
            placed.device_chunks,
            placed.host_chunks,
            bytes(placed.capacity_bytes),
            bytes(placed.warmup_peak_bytes),
            bytes(placed.room_bytes)
        );
    }
    if first.optimizer_host_chunks > 0
        && let Some(m) = &first.memory
    {
        println!(
            "rank {} stepped the optimizer state of {} chunks on the host: masters {}, state {} \
             there (device: masters {}, state {})",
            first.rank,
            first.optimizer_host_chunks,
            bytes(m.host_master_weights.current),
            bytes(m.host_optimizer_state.current),
            bytes(m.master_weights.current),
            bytes(m.optimizer_state.current)
        );
    }
    if let Some(kept) = first.memory.as_ref().and_then(|m| m.kept_shards) {
        println!(
            "rank {} kept host shards on the device between gathers: {} uploads saved, {} shards kept, {} evicted, {} gathers off the recorded order",
            first.rank, kept.kept_uses, kept.kept, kept.evicted, kept.off_schedule
        );
    }
    let gathers = first.gathers;
    if gathers.gathers > 0 {
        println!(
            "rank {} gathered parameters {} times ({} prefetched); waited {:.1} ms for gathers",
            first.rank,
            gathers.gathers,
            gathers.prefetched,
            gathers.exposed.as_secs_f64() * 1e3
        );
    }
}

/// The per-rank table: memory by kind after the last step (gradients, buckets and gathered at
/// their peak), the sum of every kind's peak, throughput and the rank's own first and last
/// loss.
fn print_rank_table(ranks: &[RankOutcome]) {
    println!(
        "\nper rank (after the last step; grads, buckets and gathered at their peak; \"sum of peaks\" \
         adds every kind's peak):"
    );
    println!(
        "{:>4} | {:>10} | {:>11} | {:>10} | {:>10} | {:>10} | {:>10} | {:>10} | {:>12} | {:>8} | {:>17}",
        "rank",
        "params",
        "host params",
        "grads",
        "master",
        "state",
        "buckets",
        "gathered",
        "sum of peaks",
        "tok/s",
        "own loss first/last"
    );
    for r in ranks {
        let Some(m) = &r.memory else { continue };
        let params = m.parameter_shards.current + m.persistent_parameters.current;
        let peaks = m.parameter_shards.peak
            + m.host_parameter_shards.peak
            + m.persistent_parameters.peak
            + m.gradient_shards.peak
            + m.gathered.peak
            + m.buckets.peak
            + m.master_weights.peak
            + m.optimizer_state.peak
            + m.gradient_accumulators.peak;
        println!(
            "{:>4} | {:>10} | {:>11} | {:>10} | {:>10} | {:>10} | {:>10} | {:>10} | {:>12} | {:>8.0} | {:>8.4}/{:.4}",
            r.rank,
            bytes(params),
            bytes(m.host_parameter_shards.current),
            bytes(m.gradient_shards.peak),
            bytes(m.master_weights.current),
            bytes(m.optimizer_state.current),
            bytes(m.buckets.peak),
            bytes(m.gathered.peak),
            bytes(peaks),
            r.tokens_per_s,
            r.local_losses[0],
            r.local_losses.last().expect("one step"),
        );
    }
}

/// Whether two parameter lists hold the same bits (NaN equals itself here).
fn same_bits(a: &Option<Vec<Vec<f32>>>, b: &Option<Vec<Vec<f32>>>) -> bool {
    let bits = |p: &Option<Vec<Vec<f32>>>| {
        p.as_ref().map(|p| {
            p.iter()
                .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        })
    };
    bits(a) == bits(b)
}

fn write_report(
    path: &std::path::Path,
    args: &Args,
    config: &RunConfig,
    ranks: &[RankOutcome],
) -> Result<(), String> {
    let (backend, precision) = names(args);
    let entries: Vec<serde_json::Value> = ranks
        .iter()
        .map(|r| {
            serde_json::json!({
                "rank": r.rank,
                "world_size": config.world_size,
                "stage": config.stage,
                "model": config.preset.name(),
                "parameters": r.parameters,
                "trainable_parameters": r.trainable,
                "reduced_bytes_per_step": r.reduced_bytes,
                "gathers": r.gathers,
                "chunk_size": format!("{:?}", config.chunk_size),
                "placement": config.placement,
                "optimizer": format!("{:?}", config.optimizer),
                "chunks": r.chunks,
                "last_step_counts": r.step_counts,
                "backend": backend,
                "precision": precision,
                "steps": config.steps,
                "tokens_per_s": r.tokens_per_s,
                "first_loss": r.losses.first(),
                "last_loss": r.losses.last(),
                "losses": r.losses,
                "params_digest": r.params.as_deref().map(params_digest),
                "memory": r.memory,
            })
        })
        .collect();
    let text = serde_json::to_string_pretty(&entries).map_err(|e| e.to_string())?;
    let path = own_report_path(path, config, ranks);
    std::fs::write(&path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))
}

/// Whether a file can be created beside `path` (the report's own name may carry a rank suffix):
/// creates and removes a probe file in its folder.
fn check_writable(path: &std::path::Path) -> std::io::Result<()> {
    let folder = match path.parent() {
        Some(folder) if !folder.as_os_str().is_empty() => folder,
        _ => std::path::Path::new("."),
    };
    let probe = folder.join(format!(".train_gpt-probe-{}", std::process::id()));
    std::fs::File::create(&probe)?;
    std::fs::remove_file(&probe)
}

/// Where this process writes its memory report: `path`, or, when the process holds only some
/// ranks of the job (one process per GPU), `path` with `-rank<R>` before the extension, so that
/// the processes of a job do not overwrite each other's reports.
fn own_report_path(
    path: &std::path::Path,
    config: &RunConfig,
    ranks: &[RankOutcome],
) -> std::path::PathBuf {
    match ranks.first() {
        Some(first) if ranks.len() < config.world_size => {
            let stem = path.file_stem().unwrap_or_default().to_string_lossy();
            let name = match path.extension() {
                Some(ext) => format!("{stem}-rank{}.{}", first.rank, ext.to_string_lossy()),
                None => format!("{stem}-rank{}", first.rank),
            };
            path.with_file_name(name)
        }
        _ => path.to_path_buf(),
    }
}
