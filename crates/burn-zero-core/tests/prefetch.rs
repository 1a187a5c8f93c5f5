//! Gather prefetch (`ZeroConfig::prefetch`) at stage 3, without an optimizer: the first pass
//! (forward and backward) records the order in which parameters are gathered; later passes
//! issue the next gathers ahead of use. Every gather after a pass's first is served by a
//! prefetch, a pass that changes the order falls back to gathering on demand, and ranks whose
//! orders differ fail with a schedule mismatch rather than hang. With the parameters packed
//! into chunks, prefetch runs ahead by chunks: every chunk gather after a pass's first is
//! served by a prefetch. Whatever is prefetched, each pass's loss and reduced gradients are
//! bitwise those of the single-rank reference (the micro-batches' gradients computed unsharded
//! and averaged in rank order on the host).
//!
//! Training through `ZeroOptimizer` with prefetch is checked in burn-zero-optim's
//! `tests/prefetch.rs`.

mod common;

use std::time::Duration;

use burn::backend::Flex;
use burn_zero_comm::{LaunchOptions, launch, launch_with};
use burn_zero_core::chunk::{ChunkKind, ChunkLayout};
use burn_zero_core::{ChunkSize, GatherStats, ZeroConfig, ZeroError, shard};
use burn_zero_testing::{Block, Train, base_model};
use common::{Values, assert_passes_equal, passes, reference_pass};

const WORLD: usize = 2;
const PASSES: usize = 5;

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

/// No pass runs forward twice.
fn once(_pass: usize, _rank: usize) -> bool {
    false
}

/// What one rank saw: each pass's loss and reduced gradients, its gather stats and its chunk
/// layout.
struct RankRun {
    passes: Vec<(f32, Values)>,
    stats: GatherStats,
    layout: ChunkLayout,
}

/// `PASSES` passes on `WORLD` ranks from `base`; at the passes in `twice` a rank computes its
/// loss from two forward passes (another gather order).
fn run(
    base: &Block<Train>,
    config: &ZeroConfig,
    twice: impl Fn(usize, usize) -> bool + Sync,
) -> Vec<RankRun> {
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, config)?;
        // Reading the gradients gathers them, but not as parameters: the gather stats and the
        // recorded order are the passes' own.
        let (_, passes) = passes(model, &zero, PASSES, (ctx.rank(), WORLD), &twice);
        Ok(RankRun {
            passes,
            stats: zero.gather_stats(),
            layout: zero.store().chunks().clone(),
        })
    })
    .unwrap_or_else(|e| panic!("{config:?}: {e}"))
}

/// The single-rank references of the `PASSES` passes.
fn references(
    base: &Block<Train>,
    twice: impl Fn(usize, usize) -> bool,
) -> Vec<(Vec<f32>, Values)> {
    (0..PASSES)
        .map(|index| reference_pass(base, index, WORLD, WORLD, &twice))
        .collect()
}

/// Asserts every rank's passes against the references.
fn assert_bitwise(runs: &[RankRun], want: &[(Vec<f32>, Values)], what: &str) {
    let passes: Vec<_> = runs.iter().map(|r| r.passes.clone()).collect();
    assert_passes_equal(&passes, want, what);
}

/// With the default gather budget every parameter is gathered once a pass: the first pass
/// records, and in each later one the first gather is on demand and issues the next ones, so
/// all but one gather a pass are prefetched, none is dropped, and no pass diverges.
#[test]
fn prefetch_serves_every_gather_but_a_passs_first() {
    let base = base_model(&Default::default());
    let want = references(&base, once);
    let on_demand = run(&base, &config(0), once);
    assert_bitwise(&on_demand, &want, "on demand");
    for depth in [1, 3] {
        let ahead = run(&base, &config(depth), once);
        assert_bitwise(&ahead, &want, &format!("depth {depth}"));
        for (rank, (plain, got)) in on_demand.iter().zip(&ahead).enumerate() {
            let (plain, stats) = (plain.stats, got.stats);
            assert_eq!(plain.prefetched, 0);
            assert_eq!(stats.gathers, plain.gathers, "depth {depth}: gathers");
            let per_pass = plain.gathers / PASSES as u64;
            assert!(per_pass > 1);
            assert_eq!(
                stats.prefetched,
                (PASSES as u64 - 1) * (per_pass - 1),
                "depth {depth}, rank {rank}: {stats:?}"
            );
            assert_eq!(stats.discarded, 0, "{stats:?}");
            assert_eq!(stats.diverged_passes, 0, "{stats:?}");
        }
    }
}

/// Under a budget that holds two parameters, backward gathers again, and prefetches evict what
/// the budget cannot hold: still prefetched, never diverged, and the same values.
#[test]
fn prefetch_within_a_small_gather_budget_keeps_the_values() {
    let base = base_model(&Default::default());
    let want = references(&base, once);
    let small = |prefetch| config(prefetch).with_max_live_gathered_bytes(SMALL_CACHE);
    let on_demand = run(&base, &small(0), once);
    assert_bitwise(&on_demand, &want, "small budget, on demand");
    for depth in [1, 2] {
        let ahead = run(&base, &small(depth), once);
        assert_bitwise(&ahead, &want, &format!("small budget, depth {depth}"));
        for (rank, (plain, got)) in on_demand.iter().zip(&ahead).enumerate() {
            let (plain, stats) = (plain.stats, got.stats);
            // Forward and backward both gather when the budget holds two parameters.
            assert!(plain.gathers > 8 * PASSES as u64, "{plain:?}");
            assert!(
                stats.prefetched > 0,
                "depth {depth}, rank {rank}: {stats:?}"
            );
            assert_eq!(stats.diverged_passes, 0, "{stats:?}");
        }
    }
}

/// Pass 2 runs the forward twice on every rank: that pass leaves the recorded order, is
/// recorded in its place, and pass 3 leaves it again. Both gather on demand from where they
/// leave it, and every pass keeps the reference's values.
#[test]
fn a_pass_in_another_order_gathers_on_demand_and_keeps_the_values() {
    let twice = |index: usize, _rank: usize| index == 2;
    let base = base_model(&Default::default());
    let want = references(&base, twice);
    let small = |prefetch| config(prefetch).with_max_live_gathered_bytes(SMALL_CACHE);
    assert_bitwise(&run(&base, &small(0), twice), &want, "on demand");
    let ahead = run(&base, &small(2), twice);
    assert_bitwise(&ahead, &want, "depth 2");
    for (rank, got) in ahead.iter().enumerate() {
        let stats = got.stats;
        assert_eq!(stats.diverged_passes, 2, "rank {rank}: {stats:?}");
        assert!(stats.prefetched > 0, "rank {rank}: {stats:?}");
    }
}

/// Chunked prefetch: every chunk gather after a pass's first is served by a prefetch; with
/// the default budget a pass gathers each sharded chunk once (the other members are cut out
/// and cached), so the gathers per pass are the sharded chunks, fewer than one parameter per
/// chunk needs; and the values are the reference's.
#[test]
fn chunked_prefetch_runs_ahead_by_chunks() {
    let base = base_model(&Default::default());
    let want = references(&base, once);
    let per_parameter = run(&base, &config(0), once);
    let chunked = |prefetch| config(prefetch).with_chunk_size(ChunkSize::Elements(256));
    let on_demand = run(&base, &chunked(0), once);
    assert_bitwise(&on_demand, &want, "chunks of 256, on demand");
    for depth in [1, 3] {
        let ahead = run(&base, &chunked(depth), once);
        assert_bitwise(&ahead, &want, &format!("chunks of 256, depth {depth}"));
        for (rank, (plain, got)) in on_demand.iter().zip(&ahead).enumerate() {
            let layout = &plain.layout;
            assert!(
                layout.chunks().iter().any(|c| c.members.len() > 1),
                "{layout:?}"
            );
            let chunks = layout.count(ChunkKind::Sharded) as u64;
            let (plain, stats) = (plain.stats, got.stats);
            assert_eq!(plain.prefetched, 0);
            assert_eq!(plain.gathers, PASSES as u64 * chunks, "{plain:?}");
            assert_eq!(stats.gathers, plain.gathers, "depth {depth}: gathers");
            assert!(
                plain.gathers < per_parameter[rank].stats.gathers,
                "{plain:?}"
            );
            assert_eq!(
                stats.prefetched,
                (PASSES as u64 - 1) * (chunks - 1),
                "depth {depth}, rank {rank}: {stats:?}"
            );
            assert_eq!(stats.discarded, 0, "{stats:?}");
            assert_eq!(stats.diverged_passes, 0, "{stats:?}");
        }
    }
}

/// Chunked prefetch under a gather budget that holds one chunk of 256 f32 elements (1 KiB) and
/// little more, and with a pass in another order: the pass that runs forward twice leaves the
/// recorded order, and so does the next one (as without chunks); something is prefetched
/// exactly when prefetch is on; the values are the reference's.
#[test]
fn chunked_prefetch_within_a_small_budget_and_out_of_order() {
    let base = base_model(&Default::default());
    for out_of_order in [false, true] {
        let twice = move |index: usize, _rank: usize| out_of_order && index == 2;
        let want = references(&base, twice);
        for chunk_size in CHUNK_SIZES {
            for depth in [0, 1, 2] {
                let config = config(depth)
                    .with_max_live_gathered_bytes(SMALL_CACHE)
                    .with_chunk_size(chunk_size);
                let what = format!("{chunk_size:?}, depth {depth}, twice {out_of_order}");
                let ahead = run(&base, &config, twice);
                assert_bitwise(&ahead, &want, &what);
                for (rank, got) in ahead.iter().enumerate() {
                    let stats = got.stats;
                    let diverged = if depth > 0 && out_of_order { 2 } else { 0 };
                    assert_eq!(stats.diverged_passes, diverged, "{what}: {stats:?}");
                    assert_eq!(stats.prefetched > 0, depth > 0, "{what}: {stats:?}");
                    println!("{what}, rank {rank}: {stats:?}");
                }
            }
        }
    }
}

/// Rank 1 runs its second pass's forward twice and rank 0 does not: with a budget small enough
/// that the second forward gathers again, their collectives differ, and both fail naming the
/// mismatch instead of waiting on each other forever.
#[test]
fn ranks_in_different_orders_fail_with_a_mismatch_instead_of_hanging() {
    let base = base_model(&Default::default());
    let config = config(2).with_max_live_gathered_bytes(SMALL_CACHE);
    let options = LaunchOptions::with_timeout(Duration::from_secs(20));
    let result = launch_with::<Flex, _, _, ZeroError>(2, &[Default::default()], &options, |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &config)?;
        let twice = |index: usize, rank: usize| index == 1 && rank == 1;
        passes(model, &zero, 3, (ctx.rank(), 2), twice);
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
