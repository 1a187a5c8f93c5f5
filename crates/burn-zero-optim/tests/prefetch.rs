//! Gather prefetch (`ZeroConfig::prefetch`) at stage 3: the first pass records the order in
//! which parameters are gathered; later passes issue the next gathers ahead of use. Training is
//! bitwise the same with and without it, every gather after a pass's first is served by a
//! prefetch, a pass that changes the order falls back to gathering on demand, and ranks whose
//! orders differ fail with a schedule mismatch rather than hang. With the parameters packed
//! into chunks, prefetch runs ahead by chunks: every chunk gather after a pass's first is
//! served by a prefetch, and training stays bitwise the same as one parameter per chunk.

use std::time::Duration;

use burn::backend::Flex;
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero_comm::{LaunchOptions, launch, launch_with};
use burn_zero_core::chunk::{ChunkKind, ChunkLayout};
use burn_zero_core::{ChunkSize, GatherStats, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{Block, Train, base_model, micro_batch, param_values, params_bits_equal};

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

/// Trains `STEPS` steps on 2 ranks from `base`; at the steps in `twice` a rank computes its
/// loss from two forward passes (another gather order). Returns each rank's parameters and
/// gather stats.
fn run(
    base: &Block<Train>,
    config: &ZeroConfig,
    twice: impl Fn(usize, usize) -> bool + Sync,
) -> Vec<(Vec<Vec<f32>>, GatherStats)> {
    run_chunked(base, config, twice)
        .into_iter()
        .map(|(params, stats, _)| (params, stats))
        .collect()
}

/// [`run`], with each rank's chunk layout.
fn run_chunked(
    base: &Block<Train>,
    config: &ZeroConfig,
    twice: impl Fn(usize, usize) -> bool + Sync,
) -> Vec<(Vec<Vec<f32>>, GatherStats, ChunkLayout)> {
    launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        for step in 0..STEPS {
            let (tokens, targets) = micro_batch::<Train>(step * 2 + ctx.rank(), ctx.device());
            let mut loss = model.loss(tokens.clone(), targets.clone());
            if twice(step, ctx.rank()) {
                loss = loss + model.loss(tokens, targets);
            }
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        let stats = zero.gather_stats();
        Ok((param_values(&model), stats, zero.store().chunks().clone()))
    })
    .unwrap_or_else(|e| panic!("{config:?}: {e}"))
}

#[test]
fn prefetch_serves_every_gather_but_a_passs_first_and_is_bitwise() {
    let base = base_model(&Default::default());
    let on_demand = run(&base, &config(0), |_, _| false);
    for depth in [1, 3] {
        let ahead = run(&base, &config(depth), |_, _| false);
        for (rank, ((want, plain), (got, stats))) in on_demand.iter().zip(&ahead).enumerate() {
            assert!(
                params_bits_equal(got, want),
                "depth {depth}, rank {rank}: parameters differ from gathering on demand"
            );
            assert_eq!(plain.prefetched, 0);
            assert_eq!(stats.gathers, plain.gathers, "depth {depth}: gathers");
            let per_pass = plain.gathers / STEPS as u64;
            assert!(per_pass > 1);
            // The first pass records; in each later one, the first gather is on demand and
            // issues the next ones.
            assert_eq!(
                stats.prefetched,
                (STEPS as u64 - 1) * (per_pass - 1),
                "depth {depth}, rank {rank}: {stats:?}"
            );
            assert_eq!(stats.discarded, 0, "{stats:?}");
            assert_eq!(stats.diverged_passes, 0, "{stats:?}");
        }
    }
}

#[test]
fn prefetch_within_a_small_gather_budget_is_bitwise() {
    // Backward gathers again, and prefetches evict what the budget cannot hold.
    let base = base_model(&Default::default());
    let small = |prefetch| config(prefetch).with_max_live_gathered_bytes(SMALL_CACHE);
    let on_demand = run(&base, &small(0), |_, _| false);
    for depth in [1, 2] {
        let ahead = run(&base, &small(depth), |_, _| false);
        for (rank, ((want, plain), (got, stats))) in on_demand.iter().zip(&ahead).enumerate() {
            assert!(
                params_bits_equal(got, want),
                "depth {depth}, rank {rank}: parameters differ from gathering on demand"
            );
            // Forward and backward both gather when the budget holds two parameters.
            assert!(plain.gathers > 8 * STEPS as u64, "{plain:?}");
            assert!(
                stats.prefetched > 0,
                "depth {depth}, rank {rank}: {stats:?}"
            );
            assert_eq!(stats.diverged_passes, 0, "{stats:?}");
        }
    }
}

#[test]
fn a_pass_in_another_order_gathers_on_demand_and_stays_bitwise() {
    // Step 2 runs the forward twice on every rank: that pass leaves the recorded order, is
    // recorded in its place, and step 3 leaves it again.
    let twice = |step: usize, _rank: usize| step == 2;
    let base = base_model(&Default::default());
    let small = |prefetch| config(prefetch).with_max_live_gathered_bytes(SMALL_CACHE);
    let on_demand = run(&base, &small(0), twice);
    let ahead = run(&base, &small(2), twice);
    for (rank, ((want, _), (got, stats))) in on_demand.iter().zip(&ahead).enumerate() {
        assert!(
            params_bits_equal(got, want),
            "rank {rank}: parameters differ from gathering on demand"
        );
        assert_eq!(stats.diverged_passes, 2, "rank {rank}: {stats:?}");
        assert!(stats.prefetched > 0, "rank {rank}: {stats:?}");
    }
}

/// Chunked prefetch: every chunk gather after a pass's first is served by a prefetch; with
/// the default budget a pass gathers each sharded chunk once (the other members are cut out
/// and cached), so the gathers per pass are the sharded chunks; and training is bitwise one
/// parameter per chunk gathering on demand.
#[test]
fn chunked_prefetch_runs_ahead_by_chunks_and_is_bitwise() {
    let base = base_model(&Default::default());
    let reference = run(&base, &config(0), |_, _| false);
    let chunked = |prefetch| config(prefetch).with_chunk_size(ChunkSize::Elements(256));
    let on_demand = run_chunked(&base, &chunked(0), |_, _| false);
    for depth in [1, 3] {
        let ahead = run_chunked(&base, &chunked(depth), |_, _| false);
        for (rank, ((want, plain, layout), (got, stats, _))) in
            on_demand.iter().zip(&ahead).enumerate()
        {
            assert!(
                layout.chunks().iter().any(|c| c.members.len() > 1),
                "{layout:?}"
            );
            assert!(
                params_bits_equal(got, want) && params_bits_equal(got, &reference[rank].0),
                "depth {depth}, rank {rank}: parameters differ from gathering on demand"
            );
            let chunks = layout.count(ChunkKind::Sharded) as u64;
            assert_eq!(plain.prefetched, 0);
            assert_eq!(plain.gathers, STEPS as u64 * chunks, "{plain:?}");
            assert_eq!(stats.gathers, plain.gathers, "depth {depth}: gathers");
            // Fewer gathers than one parameter per chunk needs.
            assert!(plain.gathers < reference[rank].1.gathers, "{plain:?}");
            assert_eq!(
                stats.prefetched,
                (STEPS as u64 - 1) * (chunks - 1),
                "depth {depth}, rank {rank}: {stats:?}"
            );
            assert_eq!(stats.discarded, 0, "{stats:?}");
            assert_eq!(stats.diverged_passes, 0, "{stats:?}");
        }
    }
}

/// Chunked prefetch under a gather budget that holds one chunk of 256 f32 elements (1 KiB) and
/// little more, and with a pass in another order: bitwise one parameter per chunk gathering on
/// demand.
#[test]
fn chunked_prefetch_within_a_small_budget_and_out_of_order_is_bitwise() {
    let base = base_model(&Default::default());
    for twice in [false, true] {
        let twice = move |step: usize, _rank: usize| twice && step == 2;
        let small = |prefetch, chunk_size| {
            config(prefetch)
                .with_max_live_gathered_bytes(SMALL_CACHE)
                .with_chunk_size(chunk_size)
        };
        let reference = run(&base, &small(0, ChunkSize::PerParameter), twice);
        for chunk_size in CHUNK_SIZES {
            for depth in [0, 1, 2] {
                let ahead = run(&base, &small(depth, chunk_size), twice);
                for (rank, ((want, _), (got, stats))) in reference.iter().zip(&ahead).enumerate() {
                    assert!(
                        params_bits_equal(got, want),
                        "{chunk_size:?}, depth {depth}, twice {}, rank {rank}: parameters \
                         differ from gathering on demand one parameter per chunk",
                        twice(2, rank)
                    );
                    // The pass that runs forward twice leaves the recorded order, and so does
                    // the next one (as without chunks).
                    let diverged = if depth > 0 && twice(2, rank) { 2 } else { 0 };
                    assert_eq!(stats.diverged_passes, diverged, "{chunk_size:?}: {stats:?}");
                    assert_eq!(
                        stats.prefetched > 0,
                        depth > 0,
                        "{chunk_size:?}, depth {depth}: {stats:?}"
                    );
                    println!(
                        "{chunk_size:?}, depth {depth}, twice {}, rank {rank}: {stats:?}",
                        twice(2, rank)
                    );
                }
            }
        }
    }
}

#[test]
fn ranks_in_different_orders_fail_with_a_mismatch_instead_of_hanging() {
    let base = base_model(&Default::default());
    // A budget small enough that the second forward gathers again.
    let config = config(2).with_max_live_gathered_bytes(SMALL_CACHE);
    let options = LaunchOptions::with_timeout(Duration::from_secs(20));
    let result = launch_with::<Flex, _, _, ZeroError>(2, &[Default::default()], &options, |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        for step in 0..3 {
            let (tokens, targets) = micro_batch::<Train>(step * 2 + ctx.rank(), ctx.device());
            let mut loss = model.loss(tokens.clone(), targets.clone());
            if step == 1 && ctx.rank() == 1 {
                loss = loss + model.loss(tokens, targets);
            }
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        Ok(())
    });
    let error = result
        .expect_err("rank-dependent gathers cannot train")
        .to_string();
    assert!(
        error.contains("mismatch") || error.contains("called"),
        "the error does not name a schedule mismatch: {error}"
    );
}
