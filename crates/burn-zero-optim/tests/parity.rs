//! The central parity test: a transformer block trained 10 steps with the global batch split
//! across 1, 2 or 4 ranks, at every ZeRO stage, with Adam, AdamW and SGD with momentum, ends
//! with bit for bit the parameters of single-rank unsharded training with Burn's own optimizer
//! on the same micro-batches, their gradients averaged in rank order.

mod common;

use burn::backend::Flex;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, GradientsParams, Optimizer, SgdConfig, SimpleOptimizer,
};
use burn_zero_comm::launch;
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, StateBytes, ZeroOptimizer};
use burn_zero_testing::{
    Block, Train, base_model, bits_equal, micro_batch, param_values, step_mean_grads,
};

const STEPS: usize = 10;
const LR: f64 = 1e-2;

/// Single rank, no sharding, Burn's optimizer adaptor: each step averages the gradients of
/// `world_size` micro-batches in rank order.
fn reference<O: Optimizer<Block<Train>, Train>>(
    base: &Block<Train>,
    world_size: usize,
    mut optim: O,
) -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut model = base.clone();
    for step in 0..STEPS {
        let (mean, _) = step_mean_grads(&model, step, world_size, &device);
        model = optim.step(LR, model, mean);
    }
    param_values(&model)
}

/// Each rank trains its micro-batches with `ZeroOptimizer`; returns its final parameters.
fn sharded<O>(
    base: &Block<Train>,
    world_size: usize,
    config: &ZeroConfig,
    optim: impl Fn() -> O + Sync,
) -> Vec<Vec<Vec<f32>>>
where
    O: SimpleOptimizer<Flex> + 'static,
    O::State<1>: StateBytes,
{
    launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(optim())).unwrap();
        for step in 0..STEPS {
            let (tokens, targets) =
                micro_batch::<Train>(step * world_size + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        Ok(param_values(&model))
    })
    .unwrap_or_else(|e| panic!("world {world_size}, {config:?}: {e}"))
}

fn assert_same(got: &[Vec<Vec<f32>>], want: &[Vec<f32>], what: &str) {
    for (rank, params) in got.iter().enumerate() {
        assert_eq!(params.len(), want.len());
        for (i, (g, w)) in params.iter().zip(want).enumerate() {
            let same = bits_equal(g, w);
            assert!(same, "{what}, rank {rank}, parameter #{i}:\n{g:?}\n{w:?}");
        }
    }
}

/// Checks `ZeroOptimizer` with `build()` against Burn's adaptor `init()` of one optimizer, at
/// world sizes 1, 2 and 4 and stages 0–3.
fn check<OA, OS>(name: &str, init: impl Fn() -> OA, build: impl Fn() -> OS + Sync)
where
    OA: Optimizer<Block<Train>, Train>,
    OS: SimpleOptimizer<Flex> + 'static,
    OS::State<1>: StateBytes,
{
    let base = base_model(&Default::default());
    // One parameter per chunk (gradient buckets), and chunks of 256 elements (flat masters).
    let configs = common::configs().into_iter().flat_map(|config| {
        [
            config.clone(),
            config.with_chunk_size(burn_zero_core::ChunkSize::Elements(256)),
        ]
    });
    let configs: Vec<_> = configs.collect();
    for world_size in [1, 2, 4] {
        let want = reference(&base, world_size, init());
        for config in configs.clone() {
            let got = sharded(&base, world_size, &config, &build);
            assert_same(
                &got,
                &want,
                &format!(
                    "{name}, world {world_size}, stage {}, {:?}",
                    config.stage, config.chunk_size
                ),
            );
        }
    }
}

#[test]
fn adam_matches_single_rank_training_bitwise() {
    check(
        "Adam",
        || AdamConfig::new().init(),
        || AdamConfig::new().build(),
    );
}

#[test]
fn adamw_matches_single_rank_training_bitwise() {
    check(
        "AdamW",
        || AdamWConfig::new().init(),
        || AdamWConfig::new().build(),
    );
}

#[test]
fn sgd_with_momentum_matches_single_rank_training_bitwise() {
    let sgd = || SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9)));
    check("SGD", || sgd().init(), || sgd().build::<Flex>());
}

/// The fused optimizers (one pass over a flat shard on Flex) end bitwise where Burn's own
/// per-tensor optimizers end, with and without weight decay.
#[test]
fn fused_adam_and_adamw_match_single_rank_training_bitwise() {
    use burn::optim::decay::WeightDecayConfig;
    use burn_zero_optim::{FusedAdam, FusedAdamW};

    let adam = || AdamConfig::new().with_weight_decay(Some(WeightDecayConfig::new(1e-2)));
    check(
        "fused Adam, L2 weight decay",
        || adam().init(),
        || FusedAdam::new(&adam()).expect("fusable"),
    );
    check(
        "fused Adam",
        || AdamConfig::new().init(),
        || FusedAdam::new(&AdamConfig::new()).expect("fusable"),
    );
    let adamw = || AdamWConfig::new().with_weight_decay(5e-2);
    check(
        "fused AdamW",
        || adamw().init(),
        || FusedAdamW::new(&adamw()).expect("fusable"),
    );
}

/// The fused SGD (one pass over a flat shard on Flex) ends bitwise where Burn's SGD ends, with
/// weight decay, dampened momentum and Nesterov.
#[test]
fn fused_sgd_matches_single_rank_training_bitwise() {
    use burn::optim::decay::WeightDecayConfig;
    use burn_zero_optim::FusedSgd;

    let sgd = || {
        SgdConfig::new()
            .with_weight_decay(Some(WeightDecayConfig::new(1e-2)))
            .with_momentum(Some(
                MomentumConfig::new()
                    .with_momentum(0.9)
                    .with_dampening(0.1)
                    .with_nesterov(true),
            ))
    };
    check(
        "fused SGD, decay and Nesterov momentum",
        || sgd().init(),
        || FusedSgd::new(&sgd()).expect("fusable"),
    );
}

/// Reductions in rank order (an all-to-all, then each rank's own sum of the pieces) on
/// `LocalGroup`, which sums in rank order itself: one rank's bits at every stage, at 2 and 3
/// ranks (3 is the first size where an engine's own order could differ), with one parameter
/// per chunk and with chunks.
#[test]
fn reductions_in_rank_order_match_single_rank_training_bitwise() {
    let base = base_model(&Default::default());
    for world_size in [2, 3] {
        let want = reference(&base, world_size, AdamConfig::new().init());
        for config in common::configs() {
            let chunked = config
                .clone()
                .with_chunk_size(burn_zero_core::ChunkSize::Elements(256));
            for config in [config, chunked] {
                let config = config.with_reduce_in_rank_order(true);
                let got = sharded(&base, world_size, &config, || AdamConfig::new().build());
                let what = format!(
                    "rank order, world {world_size}, stage {}, {:?}",
                    config.stage, config.chunk_size
                );
                assert_same(&got, &want, &what);
            }
        }
    }
}

/// Under hybrid sharding both levels (the reduce-scatter inside a shard group, the all-reduce
/// across replicas) reduce in rank order, with the bits of `LocalGroup`'s own reductions: six
/// ranks as 2 groups of 3 and as 3 groups of 2, so that each level has three ranks once (two
/// add alike in either order).
#[test]
fn hybrid_reductions_in_rank_order_match_the_engines_bitwise() {
    let base = base_model(&Default::default());
    for (stage, shard_size) in [(2, 3), (3, 3), (3, 2)] {
        let config = ZeroConfig::new()
            .with_stage(stage)
            .with_shard_group_size(shard_size);
        let want = sharded(&base, 6, &config, || AdamConfig::new().build());
        let in_order = config.clone().with_reduce_in_rank_order(true);
        let got = sharded(&base, 6, &in_order, || AdamConfig::new().build());
        for (rank, (got, want)) in got.iter().zip(&want).enumerate() {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    bits_equal(g, w),
                    "hybrid, stage {stage}, shard groups of {shard_size}, rank {rank}, \
                     parameter #{i}:\n{g:?}\n{w:?}"
                );
            }
        }
    }
}
