//! Gather prefetch (`ZeroConfig::prefetch`) at stage 3, trained end to end through
//! `ZeroOptimizer`: with prefetch or without, within the default gather budget or a small one,
//! one parameter per chunk or several, and with a step whose loss comes from two forward
//! passes (another gather order), every rank ends bitwise where single-rank training with
//! Burn's Adam ends on the same micro-batches (their gradients averaged in rank order). Each
//! run with prefetch on did prefetch, so the runs compared are the prefetching ones.
//!
//! What prefetch does on its own — the gathers it serves, the passes that leave the recorded
//! order, ranks in different orders failing instead of hanging — is checked without an
//! optimizer in burn-zero-core's `tests/prefetch.rs`.

use burn::backend::Flex;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, GatherStats, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{
    Block, Train, average_grads, base_model, micro_batch, param_values, params_bits_equal,
};

const WORLD: usize = 2;
const STEPS: usize = 5;
const LR: f64 = 1e-2;

/// Room for the two largest gathered parameters (140 f32 each) and a little more: backward
/// gathers again, and prefetches must evict cached parameters to fit.
const SMALL_CACHE: usize = 1200;

/// One parameter per chunk, and chunks of 256 elements (several parameters each).
const CHUNK_SIZES: [ChunkSize; 2] = [ChunkSize::PerParameter, ChunkSize::Elements(256)];

fn config(prefetch: usize) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(12)
        .with_bucket_size_mb(0.001)
        .with_prefetch(prefetch)
}

/// Step `step`'s loss on micro-batch `index`: from two forward passes when `twice`.
fn loss(model: &Block<Train>, index: usize, twice: bool) -> burn::tensor::Tensor<Train, 1> {
    let (tokens, targets) = micro_batch::<Train>(index, &Default::default());
    let loss = model.loss(tokens.clone(), targets.clone());
    if twice {
        loss + model.loss(tokens, targets)
    } else {
        loss
    }
}

/// Single rank, Burn's Adam: each step averages the `WORLD` micro-batches' gradients in rank
/// order (each loss from two forward passes at the steps where `twice` says so).
fn reference(base: &Block<Train>, twice: bool) -> Vec<Vec<f32>> {
    let mut model = base.clone();
    let mut optim = AdamConfig::new().init();
    for step in 0..STEPS {
        let grads: Vec<GradientsParams> = (0..WORLD)
            .map(|rank| {
                let loss = loss(&model, step * WORLD + rank, twice && step == 2);
                GradientsParams::from_grads(loss.backward(), &model)
            })
            .collect();
        let mean = average_grads(&model, &grads);
        model = optim.step(LR, model, mean);
    }
    param_values(&model)
}

/// Trains `STEPS` steps on `WORLD` ranks from `base` (step 2's loss from two forward passes
/// when `twice`). Returns each rank's parameters and gather stats.
fn train(
    base: &Block<Train>,
    config: &ZeroConfig,
    twice: bool,
) -> Vec<(Vec<Vec<f32>>, GatherStats)> {
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))?;
        for step in 0..STEPS {
            let loss = loss(&model, step * WORLD + ctx.rank(), twice && step == 2);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        let stats = zero.gather_stats();
        Ok((param_values(&model), stats))
    })
    .unwrap_or_else(|e| panic!("{config:?}: {e}"))
}

/// Trains every configuration of `cases` and asserts each rank bitwise at the reference, and
/// that each run with prefetch on prefetched.
fn check(base: &Block<Train>, cases: &[ZeroConfig], twice: bool) {
    let want = reference(base, twice);
    for config in cases {
        for (rank, (got, stats)) in train(base, config, twice).iter().enumerate() {
            let what = format!(
                "prefetch {}, budget {} B, {:?}, twice {twice}, rank {rank}",
                config.prefetch, config.max_live_gathered_bytes, config.chunk_size
            );
            assert!(
                params_bits_equal(got, &want),
                "{what}: parameters differ from single-rank training with Burn's Adam"
            );
            assert_eq!(
                stats.prefetched > 0,
                config.prefetch > 0,
                "{what}: {stats:?}"
            );
        }
    }
}

/// Gathering on demand and prefetching 1, 2 or 3 ahead, with the default budget and a small
/// one, one parameter per chunk and chunks of 256 elements.
fn in_order_cases() -> Vec<ZeroConfig> {
    let small = |prefetch| config(prefetch).with_max_live_gathered_bytes(SMALL_CACHE);
    let chunked = |prefetch| config(prefetch).with_chunk_size(ChunkSize::Elements(256));
    let mut cases: Vec<ZeroConfig> = [0, 1, 3].into_iter().map(config).collect();
    cases.extend([1, 2].map(small));
    cases.extend([0, 1, 3].map(chunked));
    cases.extend(small_budget_cases());
    cases
}

/// On demand and prefetching 1 or 2 ahead under the small budget, for each chunk size.
fn small_budget_cases() -> Vec<ZeroConfig> {
    CHUNK_SIZES
        .into_iter()
        .flat_map(|chunk_size| {
            [0, 1, 2].map(|prefetch| {
                config(prefetch)
                    .with_max_live_gathered_bytes(SMALL_CACHE)
                    .with_chunk_size(chunk_size)
            })
        })
        .collect()
}

#[test]
fn training_with_prefetch_is_bitwise_single_rank_adam() {
    let base = base_model(&Default::default());
    check(&base, &in_order_cases(), false);
}

/// Step 2 runs the forward twice on every rank: its pass and the next leave the recorded
/// order and gather on demand from there, and training still ends at the reference's bits.
#[test]
fn training_with_a_step_in_another_order_is_bitwise_single_rank_adam() {
    let base = base_model(&Default::default());
    check(&base, &small_budget_cases(), true);
}
