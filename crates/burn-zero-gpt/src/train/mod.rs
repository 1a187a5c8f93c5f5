//! The training run of the `train_gpt` example, generic over the backend every rank computes
//! on; the example is its command line, and the tests and the CUDA training tests call it here.
//!
//! An ordinary Burn training loop. The burn-zero lines are the backend type (`Train<B>`),
//! `launch`, `shard` and `ZeroOptimizer::new`; the `ZeroState` that `shard` returns and the
//! communicator are only used to build the optimizer, report memory and the mean loss.

#[cfg(feature = "cuda")]
pub mod cuda;
mod fault;
pub mod process;
mod rank;
mod sample;

use std::path::PathBuf;

use burn::backend::Autodiff;
use burn::module::Module;
use burn::optim::AdamConfig;
use burn::tensor::DType;
use burn::tensor::backend::Backend;
use burn_zero_comm::Counts;
use burn_zero_comm::sync::lock;
use burn_zero_comm::{RankContext, launch};
use burn_zero_core::{
    ChunkSize, GatherStats, MemoryReport, Placement, Zero, ZeroConfig, ZeroError,
};
use burn_zero_optim::PerTensor;

use crate::{CastParams, Corpus, Gpt, Materialise, Preset, TEXT};
pub use fault::{Fault, FaultKind};
use rank::Run;
pub use sample::PROMPT;

/// Serialises seeding and initialising a model: Burn's seeded generator is process-wide.
static SEEDED_INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The training backend: autodiff over the ZeRO decorator over `B`.
pub type Train<B> = Autodiff<Zero<B>>;

/// Everything a run needs besides the backend.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Ranks (threads, one communicator group).
    pub world_size: usize,
    /// ZeRO stage, 0 to 3.
    pub stage: u8,
    /// Model size.
    pub preset: Preset,
    /// Rank of a LoRA-style adapter after each block, with everything else frozen (0: no
    /// adapters, the whole model trains).
    pub adapter_rank: usize,
    /// Parameter and compute dtype (f32, f16, bf16); masters stay f32.
    pub precision: DType,
    /// Gradient bucket size in MiB.
    pub bucket_mb: f64,
    /// Reduce gradient buckets during backward.
    pub overlap_comm: bool,
    /// Every reduction an all-to-all summed in rank order on each rank: the bits of one rank
    /// accumulating the same micro-batches, on any engine with an all-to-all.
    pub reduce_in_rank_order: bool,
    /// Parameters with fewer elements stay replicated at stage 3.
    pub persist_below: usize,
    /// Hybrid sharding: shard within groups of this many ranks, replicate across the groups
    /// (0: shard over all ranks).
    pub shard_group_size: usize,
    /// Stage 3: parameter gathers issued ahead of use (0: on demand).
    pub prefetch: usize,
    /// How parameters are grouped into chunks (gathered, reduced and stepped together).
    pub chunk_size: ChunkSize,
    /// Where parameter shards and optimizer state live (device, fractions on the host, or the
    /// auto policy); the host side is Flex.
    pub placement: Placement,
    /// The optimizer: the fused Adam, or Burn's own for comparison.
    pub optimizer: OptimizerKind,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per optimizer step, over all ranks and micro-steps.
    pub batch_size: usize,
    /// Micro-steps per optimizer step (gradient accumulation).
    pub accumulation: usize,
    /// Adam's learning rate.
    pub lr: f64,
    /// Context length.
    pub seq_len: usize,
    /// Seed of the initial model, the batches and the sample.
    pub seed: u64,
    /// Characters generated at the end (0: none).
    pub sample_len: usize,
    /// Sampling temperature; 0 is greedy decoding.
    pub temperature: f32,
    /// Return every rank's final parameters (gathered), for comparisons.
    pub keep_params: bool,
    /// Where sharded checkpoints are written (and resumed from).
    pub checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every this many optimizer steps (0: only after the last step);
    /// needs `checkpoint_dir`.
    pub save_every: usize,
    /// Resume from the latest complete checkpoint in `checkpoint_dir` (saved at any world
    /// size and stage) instead of starting from the seed's model.
    pub resume: bool,
    /// A failure injected on purpose (tests of the process path); `None` normally.
    pub fault: Option<Fault>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl RunConfig {
    /// The defaults of the command line: 2 ranks, stage 3, the tiny model, f32.
    pub fn new() -> Self {
        Self {
            world_size: 2,
            stage: 3,
            preset: Preset::Tiny,
            adapter_rank: 0,
            precision: DType::F32,
            bucket_mb: 25.0,
            overlap_comm: true,
            reduce_in_rank_order: false,
            persist_below: 1024,
            shard_group_size: 0,
            prefetch: 0,
            chunk_size: ChunkSize::Auto,
            placement: Placement::device(),
            optimizer: OptimizerKind::FusedAdam,
            steps: 200,
            batch_size: 32,
            accumulation: 1,
            lr: 3e-3,
            seq_len: 64,
            seed: 42,
            sample_len: 200,
            temperature: 0.8,
            keep_params: false,
            checkpoint_dir: None,
            save_every: 0,
            resume: false,
            fault: None,
        }
    }

    /// Sequences in one micro-batch of one rank.
    pub fn micro_batch(&self) -> usize {
        self.batch_size / (self.world_size * self.accumulation)
    }

    /// Checks the values that cannot work.
    pub fn validate(&self) -> Result<(), String> {
        if self.world_size == 0 || self.accumulation == 0 {
            return Err("--world-size and --accumulation must be at least 1".into());
        }
        let parts = self.world_size * self.accumulation;
        if self.batch_size == 0 || !self.batch_size.is_multiple_of(parts) {
            return Err(format!(
                "--batch-size ({}) must be a positive multiple of --world-size × --accumulation ({parts})",
                self.batch_size
            ));
        }
        if self.stage > 3 {
            return Err(format!("--stage {} does not exist (0 to 3)", self.stage));
        }
        if self.shard_group_size > 0 && !self.world_size.is_multiple_of(self.shard_group_size) {
            return Err(format!(
                "--shard-group-size {} must divide --world-size {}",
                self.shard_group_size, self.world_size
            ));
        }
        if self.checkpoint_dir.is_none() && (self.resume || self.save_every > 0) {
            return Err("--resume and --save-every need --checkpoint-dir".into());
        }
        if self.seq_len == 0 || self.seq_len + 1 >= Corpus::new(TEXT).len() {
            return Err(format!("--seq-len {} does not fit the text", self.seq_len));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!("--lr {} must be a positive finite number", self.lr));
        }
        // The sharding settings are checked by `ZeroConfig` itself; its messages name the
        // configuration's fields, said here as the flags that set them.
        zero_config(self).validate().map_err(|error| {
            FLAGS
                .iter()
                .fold(error, |message, (field, flag)| message.replace(field, flag))
        })
    }
}

/// `ZeroConfig` fields and the flags that set them.
const FLAGS: [(&str, &str); 10] = [
    ("offload_param_frac", "--offload-param-frac"),
    ("offload_optim_frac", "--offload-optim-frac"),
    ("gpu_margin_mem_ratio", "--gpu-margin-mem-ratio"),
    ("the auto placement's capacity", "--auto-placement-mib"),
    (" (`Placement::auto`)", ""),
    (
        "the auto placement",
        "the auto placement (--auto-placement-mib, --auto-placement-device)",
    ),
    ("bucket_size_mb", "--bucket-mb"),
    ("persist_below_numel", "--persist-below"),
    ("shard_group_size", "--shard-group-size"),
    ("chunk_size", "--chunk-size"),
];

/// What rank 0 reports after each optimizer step.
pub struct StepInfo {
    /// 0-based step.
    pub step: usize,
    /// Mean loss over every rank's micro-batches (all-reduced).
    pub loss: f32,
    /// Tokens of the global batch per second of this step.
    pub tokens_per_s: f64,
    /// Rank 0's memory accounting after the step.
    pub memory: Option<MemoryReport>,
}

/// What each rank returns.
pub struct RankOutcome {
    /// The rank.
    pub rank: usize,
    /// Parameters (elements) of the model.
    pub parameters: usize,
    /// Of which trainable (the rest frozen).
    pub trainable: usize,
    /// Bytes this rank put into gradient reductions in the last backward pass.
    pub reduced_bytes: usize,
    /// Loss of each step: mean over every rank's micro-batches (the same on every rank).
    pub losses: Vec<f32>,
    /// Loss of each step on this rank's own micro-batches.
    pub local_losses: Vec<f32>,
    /// This rank's tokens per second of training.
    pub tokens_per_s: f64,
    /// Seconds of training (all steps).
    pub seconds: f64,
    /// Memory accounting after the last step.
    pub memory: Option<MemoryReport>,
    /// Steps the loss scaler skipped (f16 only).
    pub skipped_steps: usize,
    /// Chunks whose optimizer state is on the host (`offload_optim_frac`).
    pub optimizer_host_chunks: usize,
    /// Generated text (the prompt included).
    pub sample: String,
    /// Final parameters, when asked for.
    pub params: Option<Vec<Vec<f32>>>,
    /// The step the run resumed from (`resume`), if it did.
    pub resumed_from: Option<usize>,
    /// Parameter gathers of the whole run (stage 3), prefetched ones among them.
    pub gathers: GatherStats,
    /// What this rank's last step issued: collectives by kind, device synchronisations, host
    /// reads.
    pub step_counts: Counts,
    /// The chunk layout: sharded and replicated chunks, and the padding elements a rank holds.
    pub chunks: ChunkSummary,
}

/// The chunk layout of a run, in numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ChunkSummary {
    /// Chunks split across the ranks (all-gathered at stage 3, reduce-scattered).
    pub sharded: usize,
    /// Chunks whole on every rank (all-reduced).
    pub replicated: usize,
    /// Elements of padding in a rank's shards (each sharded parameter's round-up).
    pub padding: usize,
}

/// Why a rank stopped.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    /// Sharding or a collective failed.
    #[error(transparent)]
    Zero(#[from] ZeroError),
    /// The optimizer cannot be made as configured.
    #[error("{0}")]
    Optimizer(String),
    /// Saving or loading a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] burn_zero_checkpoint::CheckpointError),
    /// The loss (mean over ranks) is NaN or infinite: training diverged. Every rank sees the
    /// same all-reduced value, so every rank stops at the same step.
    #[error(
        "the loss became {loss} at step {step} (mean over ranks): training diverged; lower --lr{hint}"
    )]
    NonFiniteLoss {
        step: usize,
        loss: f32,
        hint: &'static str,
    },
}

impl From<burn_zero_comm::CommError> for RankError {
    fn from(error: burn_zero_comm::CommError) -> Self {
        RankError::Zero(error.into())
    }
}

/// What one rank runs: training from its [`RankContext`] to its outcome.
pub type RankFn<'a, B> = dyn Fn(RankContext<B>) -> Result<RankOutcome, RankError> + Sync + 'a;

/// Trains on `config.world_size` ranks computing on `B`'s `device`, one thread each, connected
/// by a `LocalGroup`; calls `on_step` on rank 0 after each step. Returns each rank's outcome in
/// rank order.
pub fn train<B: Backend>(
    config: &RunConfig,
    device: B::Device,
    on_step: impl Fn(&StepInfo) + Sync,
) -> Result<Vec<RankOutcome>, String> {
    let ranks = local_ranks::<B>(config.world_size, device.clone());
    train_with::<B>(config, device, on_step, ranks)
}

/// Starts `world_size` ranks on threads of this process, all on `device`, connected by a
/// `LocalGroup` (the ranks argument of [`train_with`]).
pub fn local_ranks<B: Backend>(
    world_size: usize,
    device: B::Device,
) -> impl FnOnce(&RankFn<'_, B>) -> Result<Vec<RankOutcome>, String> {
    move |rank_fn| {
        launch::<B, _, _, RankError>(world_size, &[device], rank_fn).map_err(|e| e.to_string())
    }
}

/// [`train`] with the ranks started by `ranks`, which runs the rank function once per rank of
/// this process (every rank of a `LocalGroup` or of `launch_nccl`, or this process's single
/// rank of a multi-process NCCL job) and returns the outcomes in rank order. The model is
/// initialised on `device` and moved to each rank's device.
pub fn train_with<B: Backend>(
    config: &RunConfig,
    device: B::Device,
    on_step: impl Fn(&StepInfo) + Sync,
    ranks: impl FnOnce(&RankFn<'_, B>) -> Result<Vec<RankOutcome>, String>,
) -> Result<Vec<RankOutcome>, String> {
    config.validate()?;
    if !B::supports_dtype(&device, config.precision) {
        return Err(format!(
            "backend {} does not support {:?} tensors",
            B::name(&device),
            config.precision
        ));
    }
    let corpus = Corpus::new(TEXT);
    let base = initial_model::<B>(config, &corpus, &device);
    let run = Run {
        config,
        corpus: &corpus,
        parameters: base.parameters(),
        trainable: base.trainable_parameters(),
        base,
        base_device: device,
        zero: zero_config(config),
        on_step: &on_step,
        adam: AdamConfig::new(),
    };
    match config.optimizer {
        OptimizerKind::FusedAdam => ranks(&|ctx: RankContext<B>| run.rank(ctx)),
        OptimizerKind::BurnAdam => {
            let run = run.with_adam(PerTensor(AdamConfig::new().build()));
            ranks(&|ctx: RankContext<B>| run.rank(ctx))
        }
    }
}

/// The optimizer a run steps with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// burn-zero's fused Adam (one pass, one kernel launch per chunk): bitwise Burn's Adam on
    /// Flex, NdArray and wgpu.
    FusedAdam,
    /// Burn's own Adam, tensor by tensor (`PerTensor`), for comparison.
    BurnAdam,
}

/// One model, built and materialised once from the seed, that every rank starts from: the
/// GPT of the preset (with frozen base and adapters when asked), in the run's precision.
///
/// Burn's seeded generator is global to the process: the lock is held while drawing from it,
/// so that two runs in one process (tests run in parallel) cannot interleave their draws.
fn initial_model<B: Backend>(
    config: &RunConfig,
    corpus: &Corpus,
    device: &B::Device,
) -> Gpt<Train<B>> {
    let gpt = config.preset.config(corpus.vocab(), config.seq_len);
    let base: Gpt<Train<B>> = {
        let _init = lock(&SEEDED_INIT);
        <Train<B> as Backend>::seed(device, config.seed);
        let base = gpt.init(device);
        let base = match config.adapter_rank {
            0 => base,
            rank => base.with_adapters(rank, device).freeze_base(),
        };
        base.visit(&mut Materialise);
        base
    };
    match config.precision {
        DType::F32 => base,
        dtype => base.map(&mut CastParams(dtype)),
    }
}

/// The sharding configuration of a run.
fn zero_config(config: &RunConfig) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(config.stage)
        .with_bucket_size_mb(config.bucket_mb)
        .with_persist_below_numel(config.persist_below)
        .with_shard_group_size(config.shard_group_size)
        .with_prefetch(config.prefetch)
        .with_chunk_size(config.chunk_size)
        .with_placement(config.placement)
        .with_overlap_comm(config.overlap_comm)
        .with_reduce_in_rank_order(config.reduce_in_rank_order)
}
