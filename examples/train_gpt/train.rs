//! The training run of `train_gpt`, generic over the backend every rank computes on; shared
//! with the integration test (`tests/train_gpt.rs`).
//!
//! An ordinary Burn training loop. The burn-zero lines are the backend type (`Train<B>`),
//! `launch`, `shard` and `ZeroOptimizer::new`; the `ZeroState` that `shard` returns and the
//! communicator are only used to build the optimizer, report memory and the mean loss.

use std::path::PathBuf;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_zero::checkpoint::{SaveOptions, load, save};
use burn_zero::comm::{RankContext, ReduceOp, launch};
use burn_zero::core::GatherStats;
use burn_zero::launcher::sync::lock;
use burn_zero::optim::LossScalerConfig;
use burn_zero::{MemoryReport, Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard};

use burn_zero_gpt::{CastParams, Corpus, Gpt, Materialise, Preset, TEXT, mix, param_values};

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
    /// Parameters with fewer elements stay replicated at stage 3.
    pub persist_below: usize,
    /// Hybrid sharding: shard within groups of this many ranks, replicate across the groups
    /// (0: shard over all ranks).
    pub shard_group_size: usize,
    /// Stage 3: parameter gathers issued ahead of use (0: on demand).
    pub prefetch: usize,
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
            persist_below: 1024,
            shard_group_size: 0,
            prefetch: 0,
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
        Ok(())
    }
}

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
    /// Generated text (the prompt included).
    pub sample: String,
    /// Final parameters, when asked for.
    pub params: Option<Vec<Vec<f32>>>,
    /// The step the run resumed from (`resume`), if it did.
    pub resumed_from: Option<usize>,
    /// Parameter gathers of the whole run (stage 3), prefetched ones among them.
    pub gathers: GatherStats,
}

/// Why a rank stopped.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    /// Sharding or a collective failed.
    #[error(transparent)]
    Zero(#[from] ZeroError),
    /// Saving or loading a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] burn_zero::checkpoint::CheckpointError),
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

impl From<burn_zero::comm::CommError> for RankError {
    fn from(error: burn_zero::comm::CommError) -> Self {
        RankError::Zero(error.into())
    }
}

/// Prompt of the generated sample.
pub const PROMPT: &str = "Phileas Fogg";

/// What one rank runs: training from its [`RankContext`] to its outcome.
pub type RankFn<'a, B> = dyn Fn(RankContext<B>) -> Result<RankOutcome, RankError> + Sync + 'a;

/// Trains on `config.world_size` ranks computing on `B`'s `device`, one thread each, connected
/// by a `LocalGroup`; calls `on_step` on rank 0 after each step. Returns each rank's outcome in
/// rank order.
// The tests' entry point; the binary picks how its ranks start (`train_with`).
#[allow(dead_code)]
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
    let gpt = config.preset.config(corpus.vocab(), config.seq_len);

    // One model, built and materialised once from the seed, that every rank starts from.
    // Burn's seeded generator is global to the process: hold the lock while drawing from it,
    // so that two runs in one process (tests run in parallel) cannot interleave their draws.
    let base_device = device.clone();
    let base: Gpt<Train<B>> = {
        let _init = lock(&SEEDED_INIT);
        <Train<B> as Backend>::seed(&device, config.seed);
        let base = gpt.init(&device);
        let base = match config.adapter_rank {
            0 => base,
            rank => base.with_adapters(rank, &device).freeze_base(),
        };
        base.visit(&mut Materialise);
        base
    };
    let base = match config.precision {
        DType::F32 => base,
        dtype => base.map(&mut CastParams(dtype)),
    };
    let parameters = base.parameters();
    let trainable = base.trainable_parameters();

    let zero = ZeroConfig::new()
        .with_stage(config.stage)
        .with_bucket_size_mb(config.bucket_mb)
        .with_persist_below_numel(config.persist_below)
        .with_shard_group_size(config.shard_group_size)
        .with_prefetch(config.prefetch)
        .with_overlap_comm(config.overlap_comm);
    let micro = config.micro_batch();
    let step_tokens = config.batch_size * config.seq_len;

    let rank_fn = |ctx: RankContext<B>| -> Result<RankOutcome, RankError> {
        let (rank, device) = (ctx.rank(), ctx.device());
        let start = if *device == base_device {
            base.clone()
        } else {
            base.clone().fork(device)
        };
        let (mut model, state) = shard(start, &ctx, &zero)?;
        let mut optimizer = ZeroOptimizer::new(&state, AdamConfig::new().build())
            .with_accumulation(config.accumulation);
        if config.precision == DType::F16 {
            optimizer = optimizer.with_loss_scaler(LossScalerConfig::new());
        }
        // Resuming: every rank reads its part of the latest checkpoint, whatever world size
        // and stage saved it; the step count says where the data continues.
        let mut first_step = 0;
        let mut resumed_from = None;
        if let (true, Some(dir)) = (config.resume, &config.checkpoint_dir) {
            let (loaded_model, loaded_optimizer, loaded) = load(dir, model, optimizer)?;
            (model, optimizer) = (loaded_model, loaded_optimizer);
            first_step = loaded.step as usize;
            resumed_from = Some(first_step);
        }

        let mut losses = Vec::with_capacity(config.steps);
        let mut local_losses = Vec::with_capacity(config.steps);
        let started = Instant::now();
        for step in first_step..config.steps {
            let step_started = Instant::now();
            let mut loss_sum = 0.0;
            for m in 0..config.accumulation {
                // Micro-batch `m · world_size + rank` of the global batch.
                let index = m * config.world_size + rank;
                let rows = index * micro..(index + 1) * micro;
                let (inputs, targets) =
                    corpus.batch::<Train<B>>(config.seed, step, rows, config.seq_len, device);
                let loss = model.loss(inputs, targets);
                loss_sum += scalar(loss.clone());
                let scaled = loss.mul_scalar(optimizer.loss_scale());
                let grads = GradientsParams::from_grads(scaled.backward(), &model);
                model = optimizer.step(config.lr, model, grads);
            }
            let local = loss_sum / config.accumulation as f32;
            let mine = Tensor::<B, 1>::from_floats([local], device);
            let mean = scalar(ctx.comm().all_reduce(mine, ReduceOp::Mean)?);
            // With a loss scaler a non-finite gradient skips the step, but a non-finite loss
            // means the parameters themselves went bad: nothing later can recover.
            if !mean.is_finite() {
                return Err(RankError::NonFiniteLoss {
                    step,
                    loss: mean,
                    hint: match config.precision {
                        DType::F16 => " or use --precision bf16 / f32",
                        _ => "",
                    },
                });
            }
            local_losses.push(local);
            losses.push(mean);
            if rank == 0 {
                on_step(&StepInfo {
                    step,
                    loss: mean,
                    tokens_per_s: step_tokens as f64 / step_started.elapsed().as_secs_f64(),
                    memory: Some(state.memory_report()),
                });
            }
            if let Some(dir) = &config.checkpoint_dir {
                let done = step + 1;
                let due = config.save_every > 0 && done.is_multiple_of(config.save_every);
                if due || done == config.steps {
                    save(
                        dir,
                        done as u64,
                        &model,
                        &optimizer,
                        &SaveOptions::default(),
                    )?;
                }
            }
        }
        let trained_steps = losses.len().max(1);
        let seconds = started.elapsed().as_secs_f64();
        let memory = Some(state.memory_report());
        let reduced_bytes = state.last_reduction().bytes;
        let gathers = state.gather_stats();

        // Every rank generates the same text in lockstep: at stage 3 each forward gathers.
        let sample = generate(&model.valid(), &corpus, config, device);
        let params = config.keep_params.then(|| param_values(&model));
        Ok(RankOutcome {
            rank,
            parameters,
            trainable,
            reduced_bytes,
            losses,
            local_losses,
            tokens_per_s: (step_tokens / config.world_size * trained_steps) as f64 / seconds,
            seconds,
            memory,
            skipped_steps: optimizer.skipped_steps(),
            sample,
            params,
            resumed_from,
            gathers,
        })
    };
    ranks(&rank_fn)
}

/// The first value of a tensor, as f32.
fn scalar<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> f32 {
    let values = tensor.into_data().convert::<f32>();
    values.as_slice::<f32>().expect("f32 values")[0]
}

/// `config.sample_len` characters after [`PROMPT`], each drawn from the model's distribution at
/// `config.temperature` (greedy at 0) with randomness from the seed alone, so every rank draws
/// the same ones.
fn generate<B: Backend>(
    model: &Gpt<B>,
    corpus: &Corpus,
    config: &RunConfig,
    device: &B::Device,
) -> String {
    let mut ids = corpus.encode(PROMPT);
    for i in 0..config.sample_len {
        let window = &ids[ids.len().saturating_sub(config.seq_len)..];
        let len = window.len();
        let tokens: Vec<i64> = window.iter().map(|&id| id as i64).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [1, len]), device);
        let logits = model.forward(tokens);
        let vocab = logits.dims()[2];
        let last = logits
            .slice([0..1, len - 1..len, 0..vocab])
            .cast(DType::F32);
        let logits = last.into_data().to_vec::<f32>().expect("f32 logits");
        let next = if config.temperature <= 0.0 {
            argmax(&logits)
        } else {
            let u = (mix(config.seed ^ 0x5A4D_504C, i as u64) >> 11) as f64 / (1u64 << 53) as f64;
            draw(&logits, config.temperature, u)
        };
        ids.push(next);
    }
    corpus.decode(&ids)
}

fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// The index where the cumulative softmax(logits / temperature) first exceeds `u` ∈ [0, 1).
fn draw(logits: &[f32], temperature: f32, u: f64) -> usize {
    let max = logits[argmax(logits)];
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| (((l - max) / temperature) as f64).exp())
        .collect();
    let mut left = u * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if left < *w {
            return i;
        }
        left -= w;
    }
    weights.len() - 1
}
