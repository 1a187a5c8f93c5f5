//! One rank's training: shard the shared initial model, resume, step, save, report.

use std::time::Instant;

use burn::backend::Flex;
use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsParams, Optimizer, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_zero_checkpoint::{SaveOptions, load, save};
use burn_zero_comm::{Counts, RankContext, ReduceOp};
use burn_zero_core::chunk::ChunkKind;
use burn_zero_core::{ZeroConfig, ZeroState, shard};
use burn_zero_optim::{LossScalerConfig, OptimizerConfig, StateBytes, ZeroOptimizer};

use super::sample::generate;
use super::{ChunkSummary, RankError, RankOutcome, RunConfig, StepInfo, Train};
use crate::{Corpus, Gpt, param_values};

/// What every rank of a run shares; `C` is the optimizer's configuration (the fused Adam, or
/// Burn's own through `PerTensor`).
pub(super) struct Run<'a, B: Backend, C> {
    pub config: &'a RunConfig,
    pub corpus: &'a Corpus,
    /// The initial model, on `base_device`.
    pub base: Gpt<Train<B>>,
    pub base_device: B::Device,
    pub parameters: usize,
    pub trainable: usize,
    pub zero: ZeroConfig,
    /// Called on rank 0 after each step.
    pub on_step: &'a (dyn Fn(&StepInfo) + Sync),
    /// Adam's configuration, as the optimizer is built from it.
    pub adam: C,
}

impl<'a, B: Backend, C> Run<'a, B, C> {
    /// The same run with the optimizer built from `adam`.
    pub fn with_adam<D>(self, adam: D) -> Run<'a, B, D> {
        Run {
            config: self.config,
            corpus: self.corpus,
            base: self.base,
            base_device: self.base_device,
            parameters: self.parameters,
            trainable: self.trainable,
            zero: self.zero,
            on_step: self.on_step,
            adam,
        }
    }
}

/// A rank's context, optimizer and sharded state as training goes (the model is passed along
/// by value, as Burn's optimizers take it).
struct Rank<B: Backend, O>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<Flex>,
{
    ctx: RankContext<B>,
    optimizer: ZeroOptimizer<B, O>,
    state: ZeroState<B>,
}

impl<B: Backend, C> Run<'_, B, C>
where
    C: OptimizerConfig + Clone,
    C::Optimizer: SimpleOptimizer<B> + SimpleOptimizer<Flex>,
    <C::Optimizer as SimpleOptimizer<B>>::State<1>: StateBytes,
    <C::Optimizer as SimpleOptimizer<Flex>>::State<1>: StateBytes,
{
    /// Trains rank `ctx.rank()` from the shared initial model (or the latest checkpoint) to its
    /// outcome.
    pub fn rank(&self, ctx: RankContext<B>) -> Result<RankOutcome, RankError> {
        let config = self.config;
        let (mut rank, mut model, resumed_from) = self.start(ctx)?;
        let first_step = resumed_from.unwrap_or(0);
        let mut losses = Vec::with_capacity(config.steps);
        let mut local_losses = Vec::with_capacity(config.steps);
        let started = Instant::now();
        let mut step_counts = Counts::default();
        for step in first_step..config.steps {
            let step_started = Instant::now();
            let before = rank.state.counts();
            let local;
            (model, local) = self.step(&mut rank, model, step)?;
            let mean = self.mean_loss(&rank, step, local)?;
            step_counts = rank.state.counts() - before;
            local_losses.push(local);
            losses.push(mean);
            if rank.ctx.rank() == 0 {
                (self.on_step)(&StepInfo {
                    step,
                    loss: mean,
                    tokens_per_s: self.step_tokens() as f64 / step_started.elapsed().as_secs_f64(),
                    memory: Some(rank.state.memory_report()),
                });
            }
            self.save_if_due(&rank, &model, step + 1)?;
        }
        let seconds = started.elapsed().as_secs_f64();
        let outcome = self.outcome(rank, &model, losses, local_losses, seconds, resumed_from);
        Ok(RankOutcome {
            step_counts,
            ..outcome
        })
    }

    /// Shards the initial model on this rank, builds the optimizer and, when asked, resumes
    /// from the latest checkpoint (saved at any world size and stage). Returns the step the run
    /// resumed from.
    #[allow(clippy::type_complexity)]
    fn start(
        &self,
        ctx: RankContext<B>,
    ) -> Result<(Rank<B, C::Optimizer>, Gpt<Train<B>>, Option<usize>), RankError> {
        let config = self.config;
        let start = if *ctx.device() == self.base_device {
            self.base.clone()
        } else {
            self.base.clone().fork(ctx.device())
        };
        let (mut model, state) = shard(start, &ctx, &self.zero)?;
        let mut optimizer = ZeroOptimizer::new(&state, self.adam.clone())
            .map_err(|error| RankError::Optimizer(error.to_string()))?
            .with_accumulation(config.accumulation);
        if config.precision == DType::F16 {
            optimizer = optimizer.with_loss_scaler(LossScalerConfig::new());
        }
        let mut resumed_from = None;
        if let (true, Some(dir)) = (config.resume, &config.checkpoint_dir) {
            let loaded;
            (model, optimizer, loaded) = load(dir, model, optimizer)?;
            resumed_from = Some(loaded.step as usize);
        }
        let rank = Rank {
            ctx,
            optimizer,
            state,
        };
        Ok((rank, model, resumed_from))
    }

    /// One optimizer step: the rank's micro-batches `m · world_size + rank` of the global
    /// batch, one backward and optimizer call each. Returns the rank's mean loss.
    fn step(
        &self,
        rank: &mut Rank<B, C::Optimizer>,
        mut model: Gpt<Train<B>>,
        step: usize,
    ) -> Result<(Gpt<Train<B>>, f32), RankError> {
        let config = self.config;
        let micro = config.micro_batch();
        let device = rank.ctx.device().clone();
        let mut loss_sum = 0.0;
        for m in 0..config.accumulation {
            let index = m * config.world_size + rank.ctx.rank();
            let rows = index * micro..(index + 1) * micro;
            let (inputs, targets) =
                self.corpus
                    .batch::<Train<B>>(config.seed, step, rows, config.seq_len, &device);
            let loss = model.loss(inputs, targets);
            loss_sum += scalar(loss.clone());
            let scaled = loss.mul_scalar(rank.optimizer.loss_scale());
            let grads = GradientsParams::from_grads(scaled.backward(), &model);
            if let Some(fault) = config.fault {
                fault.strike(rank.ctx.rank(), step);
            }
            model = Optimizer::step(&mut rank.optimizer, config.lr, model, grads);
        }
        Ok((model, loss_sum / config.accumulation as f32))
    }

    /// The mean of every rank's loss (all-reduced). With a loss scaler a non-finite gradient
    /// skips the step, but a non-finite loss means the parameters themselves went bad:
    /// nothing later can recover, so every rank stops at the same step.
    fn mean_loss(
        &self,
        rank: &Rank<B, C::Optimizer>,
        step: usize,
        local: f32,
    ) -> Result<f32, RankError> {
        let mine = Tensor::<B, 1>::from_floats([local], rank.ctx.device());
        let mean = scalar(rank.ctx.comm().all_reduce(mine, ReduceOp::Mean)?);
        if mean.is_finite() {
            return Ok(mean);
        }
        Err(RankError::NonFiniteLoss {
            step,
            loss: mean,
            hint: match self.config.precision {
                DType::F16 => " or use --precision bf16 / f32",
                _ => "",
            },
        })
    }

    /// Saves a checkpoint after `done` steps when one is due (every `save_every` steps, and
    /// after the last).
    fn save_if_due(
        &self,
        rank: &Rank<B, C::Optimizer>,
        model: &Gpt<Train<B>>,
        done: usize,
    ) -> Result<(), RankError> {
        let config = self.config;
        let Some(dir) = &config.checkpoint_dir else {
            return Ok(());
        };
        let due = config.save_every > 0 && done.is_multiple_of(config.save_every);
        if due || done == config.steps {
            save(
                dir,
                done as u64,
                model,
                &rank.optimizer,
                &SaveOptions::default(),
            )?;
        }
        Ok(())
    }

    /// Tokens of one global batch.
    fn step_tokens(&self) -> usize {
        self.config.batch_size * self.config.seq_len
    }

    /// The rank's report once training is over: statistics, the sample every rank generates
    /// in lockstep (at stage 3 each forward gathers), the parameters when asked for.
    fn outcome(
        &self,
        rank: Rank<B, C::Optimizer>,
        model: &Gpt<Train<B>>,
        losses: Vec<f32>,
        local_losses: Vec<f32>,
        seconds: f64,
        resumed_from: Option<usize>,
    ) -> RankOutcome {
        let config = self.config;
        let trained_steps = losses.len().max(1);
        let device = rank.ctx.device().clone();
        let sample = generate(&model.valid(), self.corpus, config, &device);
        let params = config.keep_params.then(|| param_values(model));
        RankOutcome {
            rank: rank.ctx.rank(),
            parameters: self.parameters,
            trainable: self.trainable,
            reduced_bytes: rank.state.last_reduction().bytes,
            losses,
            local_losses,
            tokens_per_s: (self.step_tokens() / config.world_size * trained_steps) as f64 / seconds,
            seconds,
            memory: Some(rank.state.memory_report()),
            skipped_steps: rank.optimizer.skipped_steps(),
            optimizer_host_chunks: rank.optimizer.host_chunks().len(),
            sample,
            params,
            resumed_from,
            gathers: rank.state.gather_stats(),
            step_counts: Counts::default(),
            chunks: chunk_summary(&rank.state),
        }
    }
}

/// The numbers of a rank's chunk layout.
fn chunk_summary<B: Backend>(state: &ZeroState<B>) -> ChunkSummary {
    let chunks = state.store().chunks();
    ChunkSummary {
        sharded: chunks.count(ChunkKind::Sharded),
        replicated: chunks.count(ChunkKind::Replicated),
        padding: chunks.padding(state.world_size()),
    }
}

/// The first value of a tensor, as f32.
pub(super) fn scalar<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> f32 {
    let values = tensor.into_data().convert::<f32>();
    values.as_slice::<f32>().expect("f32 values")[0]
}
