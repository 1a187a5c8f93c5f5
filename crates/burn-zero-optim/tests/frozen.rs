//! Frozen parameters (a frozen base with trainable layers, as in LoRA-style fine-tuning): the
//! test block's embedding (tied to its output head) and attention are frozen, its layer norms
//! and MLP train.
//!
//! - Training matches single-rank training with Burn's own AdamW on the same frozen block, bit
//!   for bit, at world sizes 1, 2, 4 and every stage; the frozen values never move (AdamW's
//!   weight decay would move them if they were stepped, even with zero gradients).
//! - Frozen parameters have no bucket, no master copy and no optimizer state: the reductions
//!   the communicator sees, and the memory the optimizer holds, are those of the trainable
//!   parameters alone, as computed here from their shapes.
//! - Ranks that disagree on which parameters are frozen fail to shard, naming the parameter; a
//!   parameter frozen or unfrozen after sharding is refused by the optimizer.
//! - All of it holds with the parameters packed into chunks: frozen and trainable parameters
//!   never share a chunk, and frozen chunks are never reduced.

use std::sync::Arc;
use std::thread::ThreadId;

use burn::backend::Flex;
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_zero_comm::{RankContext, launch};
use burn_zero_core::chunk::{ChunkKind, ChunkLayout};
use burn_zero_core::{ChunkSize, MemoryReport, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::recording::{CallLog, RecordingComm};
use burn_zero_testing::{
    Block, Train, base_model, bits_equal, micro_batch, param_values, step_mean_grads,
};

const STEPS: usize = 4;
const LR: f64 = 1e-2;
/// The block's parameters in visit order: the embedding, then attention's query, key, value
/// and output (weight and bias each) are frozen; the rest trains.
const FROZEN: usize = 9;

/// One parameter per chunk, and chunks of 256 elements: several frozen parameters share
/// chunks, and so do several trainable ones (checked in
/// `frozen_and_trainable_parameters_fill_chunks_of_their_own`).
const CHUNK_SIZES: [ChunkSize; 2] = [ChunkSize::PerParameter, ChunkSize::Elements(256)];

/// Sets `require_grad` of each parameter, in visit order, from `trainable`.
struct SetTrainable<F: FnMut(usize) -> bool> {
    trainable: F,
    index: usize,
}

impl<AB: AutodiffBackend, F: FnMut(usize) -> bool> ModuleMapper<AB> for SetTrainable<F> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let trainable = (self.trainable)(self.index);
        self.index += 1;
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, tensor.set_require_grad(trainable), mapper)
    }
}

fn with_trainable(model: Block<Train>, trainable: impl FnMut(usize) -> bool) -> Block<Train> {
    model.map(&mut SetTrainable {
        trainable,
        index: 0,
    })
}

/// The test block with its base frozen.
fn frozen_base() -> Block<Train> {
    with_trainable(base_model(&Default::default()), |i| i >= FROZEN)
}

/// Each parameter's element count, in visit order.
fn numels(model: &Block<Train>) -> Vec<usize> {
    param_values(model).iter().map(Vec::len).collect()
}

#[test]
fn a_frozen_base_trains_bitwise_like_single_rank_burn_and_never_moves() {
    let base = frozen_base();
    let initial = param_values(&base);
    for world_size in [1, 2, 4] {
        // Burn's own AdamW, one rank, the micro-batch gradients averaged in rank order; Burn
        // skips parameters without a gradient.
        let want = {
            let device = Default::default();
            let mut optim = AdamWConfig::new().init();
            let mut model = base.clone();
            for step in 0..STEPS {
                let (mean, _) = step_mean_grads(&model, step, world_size, &device);
                model = Optimizer::<Block<Train>, Train>::step(&mut optim, LR, model, mean);
            }
            param_values(&model)
        };
        for (i, (after, before)) in want.iter().zip(&initial).enumerate() {
            assert_eq!(
                bits_equal(after, before),
                i < FROZEN,
                "reference, parameter #{i}: only the frozen ones keep their values"
            );
        }
        for (stage, chunk_size) in (0..=3).flat_map(|s| CHUNK_SIZES.map(|c| (s, c))) {
            let config = ZeroConfig::new()
                .with_stage(stage)
                .with_persist_below_numel(12)
                .with_bucket_size_mb(0.001)
                .with_chunk_size(chunk_size);
            let got = launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
                let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
                let mut optimizer =
                    ZeroOptimizer::new(&zero, PerTensor(AdamWConfig::new().build())).unwrap();
                for step in 0..STEPS {
                    let (tokens, targets) =
                        micro_batch::<Train>(step * world_size + ctx.rank(), ctx.device());
                    let loss = model.loss(tokens, targets);
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    model = optimizer.step(LR, model, grads);
                }
                Ok(param_values(&model))
            })
            .unwrap();
            for (rank, params) in got.iter().enumerate() {
                for (i, (g, w)) in params.iter().zip(&want).enumerate() {
                    assert!(
                        bits_equal(g, w),
                        "world {world_size}, stage {stage}, {chunk_size:?}, rank {rank}, \
                         parameter #{i}"
                    );
                }
            }
        }
    }
}

#[test]
fn frozen_parameters_are_never_reduced_and_hold_no_optimizer_memory() {
    for chunk_size in CHUNK_SIZES {
        never_reduced(chunk_size);
    }
}

fn never_reduced(chunk_size: ChunkSize) {
    let base = frozen_base();
    let numels = numels(&base);
    let trainable_share: usize = numels[FROZEN..].iter().map(|&n| n.div_ceil(WORLD)).sum();
    let all_share: usize = numels.iter().map(|&n| n.div_ceil(WORLD)).sum();
    for (rank, run) in record(&base, chunk_size).iter().enumerate() {
        assert_eq!(run.trainable, (FROZEN..numels.len()).collect::<Vec<_>>());
        if chunk_size != ChunkSize::PerParameter {
            check_trainable_chunks(run, rank);
        }
        let mut layout: Vec<usize> = run.buckets.iter().flatten().copied().collect();
        layout.sort_unstable();
        assert_eq!(
            layout, run.trainable,
            "rank {rank}: buckets hold the trainable only"
        );
        for (step, reduced) in run.reduced.iter().enumerate() {
            check_step(
                reduced,
                trainable_share,
                &format!("rank {rank}, step {step}"),
            );
        }
        // Parameters: every one sharded. Gradients, masters and Adam's moments: the trainable.
        let (report, master, state) = (&run.report, run.master, run.state);
        assert_eq!(report.parameter_shards.current as usize, 4 * all_share);
        assert_eq!(report.gradient_shards.peak as usize, 4 * trainable_share);
        assert_eq!(master, 4 * trainable_share, "rank {rank}: fp32 masters");
        assert_eq!(
            state,
            8 * trainable_share,
            "rank {rank}: Adam's two moments"
        );
        println!(
            "rank {rank}: {} of {} parameter elements trainable; reduce-scattered {} elements per \
             step; parameters {} B, gradient shards {} B, masters {master} B, state {state} B",
            numels[FROZEN..].iter().sum::<usize>(),
            numels.iter().sum::<usize>(),
            run.reduced[0].scattered,
            report.parameter_shards.current,
            report.gradient_shards.peak,
        );
    }
}

/// Ranks of [`never_reduced`].
const WORLD: usize = 2;

/// What the communicator saw of one step's reductions.
struct Reduced {
    /// Elements reduce-scattered and all-reduced.
    scattered: usize,
    all_reduced: usize,
    /// The reducer's count of the bytes it reduced.
    bytes: usize,
    /// Reduce-scatters issued, and the buckets the step reduced in.
    scatters: usize,
    buckets: usize,
}

/// What one rank of [`never_reduced`] recorded.
struct FrozenRun {
    /// Parameter keys of every bucket, in bucket order.
    buckets: Vec<Vec<usize>>,
    /// The keys of the trainable parameters.
    trainable: Vec<usize>,
    reduced: Vec<Reduced>,
    report: MemoryReport,
    master: usize,
    state: usize,
    chunks: ChunkLayout,
}

/// `STEPS` steps of the frozen base on `WORLD` ranks, every parameter sharded, each rank's
/// collectives recorded.
fn record(base: &Block<Train>, chunk_size: ChunkSize) -> Vec<FrozenRun> {
    // Every parameter sharded, f32 gradients: each step reduce-scatters WORLD rows of each
    // trainable parameter's padded block, and nothing else. With chunks too: a chunk's shard
    // is its members' padded blocks end to end, with nothing past them.
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(0)
        .with_bucket_size_mb(0.0005)
        .with_chunk_size(chunk_size);
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let log = CallLog::default();
        let recorder = Arc::new(RecordingComm::new(ctx.comm().clone(), log.clone()));
        let ctx = RankContext::new(*ctx.device(), recorder);
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut reduced = Vec::new();
        for step in 0..STEPS {
            let before = log.lock().unwrap().len();
            // The buckets this step reduces in (rebuilt after the first backward pass).
            let buckets = zero.bucket_layout().len();
            let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
            let calls = log.lock().unwrap()[before..].to_vec();
            reduced.push(reductions(&calls, zero.last_reduction().bytes, buckets));
        }
        let trainable = (0..zero.params().len())
            .filter(|&key| zero.is_trainable(key))
            .collect();
        Ok(FrozenRun {
            buckets: zero.bucket_layout(),
            trainable,
            reduced,
            report: zero.memory_report(),
            master: optimizer.master_bytes(),
            state: optimizer.state_bytes(),
            chunks: zero.store().chunks().clone(),
        })
    })
    .unwrap()
}

/// One step's reductions from the calls the recorder logged in it (`op elements`).
fn reductions(calls: &[(String, ThreadId)], bytes: usize, buckets: usize) -> Reduced {
    let elements = |op: &str| -> usize {
        calls
            .iter()
            .filter_map(|(call, _)| call.strip_prefix(op))
            .map(|n| n.trim().parse::<usize>().unwrap())
            .sum()
    };
    let scatters = calls
        .iter()
        .filter(|(call, _)| call.starts_with("reduce_scatter"))
        .count();
    Reduced {
        scattered: elements("reduce_scatter"),
        all_reduced: elements("all_reduce"),
        bytes,
        scatters,
        buckets,
    }
}

/// A bucket per trainable chunk, and none for the frozen chunks: the trainable parameters'
/// 10, 10, 140 and 14 elements fill one chunk of 256, the next 140, 10, 10 and 10 another.
fn check_trainable_chunks(run: &FrozenRun, rank: usize) {
    let trainable_chunks: Vec<Vec<usize>> = run
        .chunks
        .chunks()
        .iter()
        .filter(|c| c.trainable)
        .map(|c| c.members.iter().map(|m| m.key).collect())
        .collect();
    assert_eq!(
        trainable_chunks,
        [vec![9, 10, 11, 12], vec![13, 14, 15, 16]],
        "rank {rank}"
    );
    let mut sorted = run.buckets.clone();
    sorted.sort();
    assert_eq!(sorted, trainable_chunks, "rank {rank}");
}

/// One step reduces the trainable parameters' shares and nothing else.
fn check_step(reduced: &Reduced, trainable_share: usize, what: &str) {
    // Gradient norms and the loss are not reduced here (no clipping, no scaler).
    assert_eq!(reduced.all_reduced, 0, "{what}");
    // One reduce-scatter per bucket of the step: with chunks, per trainable chunk (2, against
    // the buckets of `bucket_size_mb` without).
    assert_eq!(reduced.scatters, reduced.buckets, "{what}");
    assert_eq!(
        reduced.scattered,
        WORLD * trainable_share,
        "{what}: elements reduce-scattered"
    );
    assert_eq!(reduced.bytes, 4 * WORLD * trainable_share, "{what}");
}

#[test]
fn frozen_and_trainable_parameters_fill_chunks_of_their_own() {
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(12)
        .with_chunk_size(ChunkSize::Elements(256));
    let layouts = launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let (_model, zero) = shard(frozen_base(), &ctx, &config)?;
        Ok(zero.store().chunks().clone())
    })
    .unwrap();
    for (rank, layout) in layouts.iter().enumerate() {
        for chunk in layout.chunks() {
            for member in &chunk.members {
                assert_eq!(
                    chunk.trainable,
                    member.key >= FROZEN,
                    "rank {rank}: parameter #{} in chunk {chunk:?}",
                    member.key
                );
            }
        }
        // Several parameters per chunk on both sides, sharded and replicated: the frozen
        // embedding (130) and query weight (100), the trainable MLP's weights and bias.
        let packed = |trainable: bool, kind: ChunkKind| {
            layout
                .chunks()
                .iter()
                .any(|c| c.trainable == trainable && c.kind == kind && c.members.len() > 1)
        };
        assert!(packed(false, ChunkKind::Sharded), "rank {rank}: {layout:?}");
        assert!(packed(true, ChunkKind::Sharded), "rank {rank}: {layout:?}");
        assert!(
            packed(false, ChunkKind::Replicated),
            "rank {rank}: {layout:?}"
        );
        assert!(
            packed(true, ChunkKind::Replicated),
            "rank {rank}: {layout:?}"
        );
    }
}

#[test]
fn ranks_that_disagree_on_frozen_parameters_fail_to_shard() {
    let errors = launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        // Rank 1 also freezes the first layer norm's scale.
        let rank = ctx.rank();
        let model = with_trainable(base_model(ctx.device()), |i| {
            i >= FROZEN && !(rank == 1 && i == FROZEN)
        });
        Ok(shard(model, &ctx, &ZeroConfig::new())
            .map(drop)
            .expect_err("the ranks disagree"))
    })
    .unwrap();
    for error in &errors {
        assert!(matches!(error, ZeroError::ModuleMismatch(_)), "{error}");
    }
    assert_eq!(
        errors[0].to_string(),
        "ranks disagree on the model's parameters: rank 0 has parameter #9 `norm1.gamma` of \
         shape [10] f32 (trainable), rank 1 has parameter #9 of shape [10] f32 (frozen)"
    );
}

/// Runs one training step of a module whose parameters' `require_grad` `change` sets after
/// sharding, and returns the optimizer's panic message.
fn refused_step(change: impl FnMut(usize) -> bool + Clone + Sync) -> String {
    let messages = launch::<Flex, _, _, ZeroError>(1, &[Default::default()], |ctx| {
        let (model, zero) = shard(frozen_base(), &ctx, &ZeroConfig::new().with_stage(3))?;
        let model = with_trainable(model, change.clone());
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let (tokens, targets) = micro_batch::<Train>(0, ctx.device());
        let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
        let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            optimizer.step(LR, model, grads);
        }))
        .expect_err("the step is refused");
        Ok(panic.downcast_ref::<String>().cloned().unwrap_or_default())
    })
    .unwrap();
    messages[0].clone()
}

#[test]
fn a_parameter_unfrozen_after_sharding_is_refused() {
    let message = refused_step(|_| true);
    assert!(
        message.contains("parameter #0 `embed.weight` has a gradient, but it was frozen"),
        "{message}"
    );
}

#[test]
fn a_parameter_frozen_after_sharding_is_refused() {
    let message = refused_step(|i| i > FROZEN);
    assert!(
        message.contains("parameter #9 `norm1.gamma` was trainable when the module was sharded"),
        "{message}"
    );
}
