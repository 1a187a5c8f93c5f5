//! Global gradient clipping and dynamic loss scaling across ranks.

use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{LossScalerConfig, NormType, PerTensor, ZeroOptimizer};
use burn_zero_testing::{
    Block, Inner, Train, average_grads, base_model, micro_batch, param_values, params_bits_equal,
    step_mean_grads,
};

const LR: f64 = 1e-2;

/// Multiplies every gradient by `factor` and returns the global L2 norm before that.
struct Norm<'a> {
    grads: &'a GradientsParams,
    sum_sq: f32,
}

impl ModuleVisitor<Train> for Norm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
        if let Some(g) = self.grads.get::<Inner, D>(param.id) {
            self.sum_sq += g.powi_scalar(2).sum().into_scalar();
        }
    }
}

struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl ModuleVisitor<Train> for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
        if let Some(g) = self.grads.remove::<Inner, D>(param.id) {
            self.grads
                .register::<Inner, D>(param.id, g.mul_scalar(self.factor));
        }
    }
}

#[test]
fn clipping_by_the_global_norm_matches_the_full_gradient_reference() {
    let base = base_model(&Default::default());
    let max_norm = 0.05;
    let steps = 3;
    for world_size in [2, 4] {
        // Reference: one rank, the rank-order mean gradient, clipped by its global norm.
        let device = Default::default();
        let mut model = base.clone();
        let mut adam = AdamConfig::new().init::<Train, Block<Train>>();
        let mut norms = Vec::new();
        for step in 0..steps {
            let (mut mean, _) = step_mean_grads(&model, step, world_size, &device);
            let mut norm = Norm {
                grads: &mean,
                sum_sq: 0.0,
            };
            model.visit(&mut norm);
            let norm = norm.sum_sq.sqrt();
            norms.push(norm);
            let factor = (max_norm as f64 / (norm as f64 + 1e-6)).min(1.0);
            model.visit(&mut Scale {
                grads: &mut mean,
                factor,
            });
            model = adam.step(LR, model, mean);
        }
        assert!(
            norms.iter().all(|n| *n > max_norm),
            "clipping is active: {norms:?}"
        );
        let want = param_values(&model);

        // One parameter per chunk, and chunks of 256 elements, whose statistics are one per
        // chunk (added in another order: the norm agrees to rounding, not to the bit).
        let chunkings = [ChunkSize::PerParameter, ChunkSize::Elements(256)];
        for (stage, chunk_size) in [2, 3].into_iter().flat_map(|s| chunkings.map(|c| (s, c))) {
            let config = ZeroConfig::new()
                .with_stage(stage)
                .with_persist_below_numel(12)
                .with_chunk_size(chunk_size);
            let per_rank =
                launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
                    let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
                    let mut optimizer =
                        ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))
                            .unwrap()
                            .with_clipping(max_norm, NormType::L2);
                    let mut seen = Vec::new();
                    for step in 0..steps {
                        let (tokens, targets) =
                            micro_batch::<Train>(step * world_size + ctx.rank(), ctx.device());
                        let grads = GradientsParams::from_grads(
                            model.loss(tokens, targets).backward(),
                            &model,
                        );
                        let before = zero.counts();
                        model = optimizer.step(LR, model, grads);
                        // The norm and the overflow flag: one all-reduce, one read of its
                        // result, whatever the number of parameters.
                        let step_counts = zero.counts() - before;
                        assert_eq!(step_counts.host_reads, 1);
                        seen.push(optimizer.last_grad_norm().unwrap());
                    }
                    Ok((param_values(&model), seen))
                })
                .unwrap();
            for (rank, (params, seen)) in per_rank.iter().enumerate() {
                for (got, want) in seen.iter().zip(&norms) {
                    assert!(
                        (got - want).abs() <= 1e-5 * want,
                        "norm {got} vs {want}, rank {rank}"
                    );
                }
                for (p, (got, want)) in params.iter().zip(&want).enumerate() {
                    for (g, w) in got.iter().zip(want) {
                        assert!(
                            (g - w).abs() <= 1e-6,
                            "stage {stage}, world {world_size}, rank {rank}, param #{p}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}

/// Trains on micro-batch indices `plan` (None: a step whose loss is infinite on rank 1), with
/// a loss scaler; returns each rank's final parameters and the scale after each step.
fn scaled_run(
    base: &Block<Train>,
    plan: &[Option<usize>],
) -> Vec<(Vec<Vec<f32>>, Vec<f64>, usize)> {
    let scaler = LossScalerConfig::new()
        .with_initial_scale(1024.0)
        .with_hysteresis(1)
        .with_growth_interval(2);
    let config = ZeroConfig::new().with_persist_below_numel(12);
    launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))
            .unwrap()
            .with_loss_scaler(scaler.clone());
        let mut scales = Vec::new();
        for entry in plan {
            let index = entry.unwrap_or(0);
            let (tokens, targets) = micro_batch::<Train>(index * 2 + ctx.rank(), ctx.device());
            let mut loss = model.loss(tokens, targets) * optimizer.loss_scale();
            if entry.is_none() && ctx.rank() == 1 {
                loss = loss * f32::INFINITY;
            }
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(LR, model, grads);
            scales.push(optimizer.loss_scale());
        }
        Ok((param_values(&model), scales, optimizer.skipped_steps()))
    })
    .unwrap()
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_everywhere_and_backs_off() {
    let base = base_model(&Default::default());
    let with_overflow = scaled_run(&base, &[Some(0), None, Some(1), Some(2)]);
    let without = scaled_run(&base, &[Some(0), Some(1), Some(2)]);
    for (rank, (params, scales, skipped)) in with_overflow.iter().enumerate() {
        assert_eq!(*skipped, 1, "rank {rank}");
        // 1024 → clean; overflow: back off to 512 (hysteresis 1); two clean steps: grow to 1024.
        assert_eq!(scales, &vec![1024.0, 512.0, 512.0, 1024.0], "rank {rank}");
        // The skipped step left parameters and optimizer state untouched: the run ends where
        // the run without the bad step ends (scales are powers of two: unscaling is exact).
        let (clean, clean_scales, clean_skipped) = &without[rank];
        assert_eq!(*clean_skipped, 0);
        assert_eq!(clean_scales, &vec![1024.0, 2048.0, 2048.0]);
        let same = params_bits_equal(params, clean);
        assert!(same, "rank {rank}: the skipped step changed something");
    }
}

#[test]
fn accumulating_four_micro_steps_equals_one_step_on_the_four_times_batch() {
    let base = base_model(&Default::default());
    let world_size = 2;
    let micro = 4;
    let steps = 2;
    // Reference: per micro-step the rank-order mean over ranks, then the mean over micro-steps.
    let device = Default::default();
    let mut model = base.clone();
    let mut adam = AdamConfig::new().init::<Train, Block<Train>>();
    for step in 0..steps {
        let per_micro: Vec<GradientsParams> = (0..micro)
            .map(|m| {
                let grads: Vec<GradientsParams> = (0..world_size)
                    .map(|rank| {
                        let index = (step * micro + m) * world_size + rank;
                        let (tokens, targets) = micro_batch::<Train>(index, &device);
                        GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model)
                    })
                    .collect();
                average_grads(&model, &grads)
            })
            .collect();
        let mean = average_grads(&model, &per_micro);
        model = adam.step(LR, model, mean);
    }
    let want = param_values(&model);

    for stage in [1, 3] {
        let config = ZeroConfig::new()
            .with_stage(stage)
            .with_persist_below_numel(12);
        let per_rank = launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
            let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
            let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))
                .unwrap()
                .with_accumulation(micro);
            let mut between = Vec::new();
            for step in 0..steps {
                for m in 0..micro {
                    let index = (step * micro + m) * world_size + ctx.rank();
                    let (tokens, targets) = micro_batch::<Train>(index, ctx.device());
                    let grads =
                        GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
                    model = optimizer.step(LR, model, grads);
                    if m + 1 < micro {
                        between.push(optimizer.accumulator_bytes());
                    }
                }
            }
            Ok((param_values(&model), between))
        })
        .unwrap();
        for (rank, (params, between)) in per_rank.iter().enumerate() {
            assert!(
                between.iter().all(|b| *b > 0),
                "accumulators are held between micro-steps"
            );
            let same = params_bits_equal(params, &want);
            assert!(same, "stage {stage}, rank {rank}");
        }
    }
}

#[test]
fn half_precision_training_tracks_the_fp32_reference() {
    use burn::tensor::DType;
    use burn_zero_testing::CastParams;
    let base = base_model(&Default::default());
    let world_size = 2;
    let steps = 10;
    // fp32 reference: one rank, Burn's Adam; the loss of every step (mean over micro-batches).
    let device = Default::default();
    let mut model = base.clone();
    let mut adam = AdamConfig::new().init::<Train, Block<Train>>();
    let mut want = Vec::new();
    for step in 0..steps {
        let (mean, loss) = step_mean_grads(&model, step, world_size, &device);
        want.push(loss);
        model = adam.step(LR, model, mean);
    }
    assert!(
        want[steps - 1] < want[0] * 0.9,
        "the reference learns: {want:?}"
    );

    // Half-precision parameters and compute; fp32 master shards, optimizer state and
    // reduction; dynamic loss scaling. The loss of every step stays within `tolerance`
    // (relative) of the fp32 run's.
    // Measured: 4.1e-4 (f16) and 2.9e-3 (bf16) on Flex; the bounds leave room for other CPUs.
    for (dtype, tolerance) in [(DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        let half = base.clone().map(&mut CastParams(dtype));
        let config = ZeroConfig::new()
            .with_persist_below_numel(12)
            .with_reduce_dtype(Some(DType::F32));
        let per_rank = launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
            let (mut model, zero) = shard(half.clone(), &ctx, &config)?;
            let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))
                .unwrap()
                .with_loss_scaler(LossScalerConfig::new().with_initial_scale(256.0));
            let mut losses = Vec::new();
            for step in 0..steps {
                let (tokens, targets) =
                    micro_batch::<Train>(step * world_size + ctx.rank(), ctx.device());
                let loss = model.loss(tokens, targets);
                let mine = loss
                    .clone()
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .unwrap()[0];
                let mine = Tensor::<Flex, 1>::from_floats([mine], ctx.device());
                losses.push(
                    ctx.comm()
                        .all_reduce(mine, burn_zero_comm::ReduceOp::Mean)?
                        .into_scalar(),
                );
                let grads =
                    GradientsParams::from_grads((loss * optimizer.loss_scale()).backward(), &model);
                model = optimizer.step(LR, model, grads);
            }
            Ok((losses, optimizer.skipped_steps()))
        })
        .unwrap();
        let (losses, skipped) = &per_rank[0];
        let worst = losses
            .iter()
            .zip(&want)
            .map(|(h, f)| ((h - f) / f).abs())
            .fold(0.0f32, f32::max);
        println!(
            "{dtype:?}: worst relative loss difference to fp32 over {steps} steps = {worst:e}; {skipped} steps skipped; losses {losses:?} vs {want:?}"
        );
        assert!(worst <= tolerance, "{dtype:?}: {worst} > {tolerance}");
    }
}

/// Half-precision parameters, loss scaling and clipping: the fused optimizer's one pass
/// (gradient multiplier and the cast to the parameter's dtype in the step's own pass) gives
/// every rank bitwise the parameters of Burn's per-tensor Adam, AdamW and SGD (with momentum
/// and weight decay) with a separate multiply and cast, at stages 1 and 3, per parameter and
/// in chunks.
#[test]
fn one_pass_half_precision_steps_are_the_separate_passes_bitwise() {
    use burn::optim::decay::WeightDecayConfig;
    use burn::optim::momentum::MomentumConfig;
    use burn::optim::{AdamWConfig, SgdConfig};
    use burn::tensor::DType;
    use burn_zero_testing::CastParams;
    let base = base_model(&Default::default());
    let world_size = 2;
    let steps = 4;
    let sgd = SgdConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_nesterov(true),
        ));
    let run = |half: &Block<Train>, config: &ZeroConfig, fused: bool, rule: &str| {
        launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
            let (mut model, zero) = shard(half.clone(), &ctx, config)?;
            let scaler = LossScalerConfig::new().with_initial_scale(64.0);
            macro_rules! train {
                ($optimizer:expr) => {{
                    let mut optimizer = $optimizer
                        .with_loss_scaler(scaler.clone())
                        .with_clipping(0.05, NormType::L2);
                    for step in 0..steps {
                        let (tokens, targets) =
                            micro_batch::<Train>(step * world_size + ctx.rank(), ctx.device());
                        let loss = model.loss(tokens, targets) * optimizer.loss_scale();
                        let grads = GradientsParams::from_grads(loss.backward(), &model);
                        model = optimizer.step(LR, model, grads);
                    }
                    assert_eq!(optimizer.skipped_steps(), 0);
                }};
            }
            match (fused, rule) {
                (true, "adam") => train!(ZeroOptimizer::new(&zero, AdamConfig::new()).unwrap()),
                (false, "adam") => {
                    train!(ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap())
                }
                (true, "adamw") => train!(ZeroOptimizer::new(&zero, AdamWConfig::new()).unwrap()),
                (false, "adamw") => train!(
                    ZeroOptimizer::new(&zero, PerTensor(AdamWConfig::new().build())).unwrap()
                ),
                (true, "sgd") => train!(ZeroOptimizer::new(&zero, sgd.clone()).unwrap()),
                (false, "sgd") => {
                    train!(ZeroOptimizer::new(&zero, PerTensor(sgd.build::<Flex>())).unwrap())
                }
                other => unreachable!("no optimizer {other:?}"),
            }
            Ok(param_values(&model))
        })
        .unwrap()
    };
    for dtype in [DType::F16, DType::BF16] {
        let half = base.clone().map(&mut CastParams(dtype));
        for (stage, chunk_size) in [
            (1, ChunkSize::PerParameter),
            (3, ChunkSize::PerParameter),
            (3, ChunkSize::Elements(256)),
        ] {
            let config = ZeroConfig::new()
                .with_stage(stage)
                .with_persist_below_numel(12)
                .with_chunk_size(chunk_size)
                .with_reduce_dtype(Some(DType::F32));
            for rule in ["adam", "adamw", "sgd"] {
                let fused = run(&half, &config, true, rule);
                let separate = run(&half, &config, false, rule);
                let start = param_values(&half);
                assert!(
                    !params_bits_equal(&fused[0], &start),
                    "{dtype:?}: training moved the parameters"
                );
                for (rank, (f, s)) in fused.iter().zip(&separate).enumerate() {
                    assert!(
                        params_bits_equal(f, s),
                        "{dtype:?}, stage {stage}, {chunk_size:?}, {rule}, rank {rank}: the one \
                         pass differs from the separate passes"
                    );
                }
            }
        }
    }
}
