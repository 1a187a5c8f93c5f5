//! Tied parameters per chunk. The test block's output head is its embedding: the embedding is
//! read at the start of forward (the lookup) and again at its end (the head), and its gradient
//! sums both uses. With chunks of 256 elements it shares a sharded chunk with attention's query
//! weight (130 + 100 elements), so a gather of that chunk must serve both uses, and its
//! reduction must wait for both gradients.
//!
//! - Training is bitwise single-rank training with Burn's Adam at 2 and 4 ranks, whether the
//!   gather cache keeps the chunk for the second use (the default budget), holds about one
//!   chunk (1200 bytes, so the chunk may be dropped between the uses), or nothing (every use
//!   gathers), with and without prefetch.
//! - While the cache holds the chunks, a step gathers each sharded chunk once: the second use
//!   of the tied embedding is served by the first use's gather. With nothing kept, every use
//!   gathers its chunk: as many all-gathers as one parameter per chunk issues.
//!
//! The other features per chunk are tested beside their own tests: hybrid sharding
//! (`hybrid.rs`), frozen parameters (`frozen.rs`), activation checkpointing
//! (`checkpointing.rs`), `reuse_fp16_shard` (`reuse.rs`) and prefetch (`prefetch.rs`).

mod common;

use burn::backend::Flex;
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero_comm::launch;
use burn_zero_core::chunk::{ChunkKind, ChunkLayout};
use burn_zero_core::{ChunkSize, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{Train, base_model_on, micro_batch};

const STEPS: usize = 6;
/// About one chunk of 256 f32 elements (1 KiB).
const SMALL_CACHE: usize = 1200;
/// The embedding's key (first in visit order) and attention's query weight's.
const EMBED: usize = 0;
const QUERY: usize = 1;

fn tied(chunk_size: ChunkSize, budget: usize, prefetch: usize) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(12)
        .with_bucket_size_mb(0.001)
        .with_chunk_size(chunk_size)
        .with_max_live_gathered_bytes(budget)
        .with_prefetch(prefetch)
}

#[test]
fn a_tied_embedding_sharing_a_chunk_trains_bitwise_under_any_gather_budget() {
    let device = Default::default();
    let base = base_model_on::<Flex>(&device);
    let default_budget = ZeroConfig::new().max_live_gathered_bytes;
    for world in [2, 4] {
        let (want, tolerance) = common::measure_reference::<Flex>(
            &base,
            world,
            STEPS,
            &device,
            2,
            common::Claim::Bitwise,
        );
        assert_eq!(tolerance, common::Tolerance::Bitwise);
        for budget in [default_budget, SMALL_CACHE, 0] {
            for prefetch in [0, 2] {
                let config = tied(ChunkSize::Elements(256), budget, prefetch);
                let got = common::sharded::<Flex>(&base, world, STEPS, &config, &device);
                let what = format!("world {world}, budget {budget} B, prefetch {prefetch}");
                common::assert_close(&got, &want, tolerance, &what);
            }
        }
    }
}

/// One rank's all-gathers in each step after the first, and its chunk layout.
fn gathers_per_step(config: &ZeroConfig) -> Vec<(Vec<u64>, ChunkLayout)> {
    let base = base_model_on::<Flex>(&Default::default());
    launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut per_step = Vec::new();
        for step in 0..3 {
            let before = zero.counts();
            let (tokens, targets) = micro_batch::<Train>(step * 2 + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(common::LR, model, grads);
            per_step.push((zero.counts() - before).all_gathers);
        }
        Ok((per_step[1..].to_vec(), zero.store().chunks().clone()))
    })
    .unwrap()
}

#[test]
fn a_tied_embeddings_chunk_serves_both_uses_with_one_gather_while_cached() {
    let chunked = gathers_per_step(&tied(ChunkSize::Elements(256), 512 << 20, 0));
    for (rank, (gathers, layout)) in chunked.iter().enumerate() {
        let (chunk, index) = layout.place(EMBED).unwrap();
        assert_eq!(index, 0, "rank {rank}");
        assert_eq!(chunk.kind, ChunkKind::Sharded, "rank {rank}");
        assert_eq!(
            chunk.members.iter().map(|m| m.key).collect::<Vec<_>>(),
            [EMBED, QUERY],
            "rank {rank}: the embedding shares its chunk"
        );
        let sharded = layout.count(ChunkKind::Sharded) as u64;
        for (step, &count) in gathers.iter().enumerate() {
            assert_eq!(
                count, sharded,
                "rank {rank}, step {step}: one all-gather per sharded chunk, the tied head's \
                 use included"
            );
        }
    }
    // Nothing kept gathered: every use of a parameter gathers its chunk, the embedding's two
    // uses in forward and its use in backward included; as many all-gathers as one parameter
    // per chunk issues.
    let uncached = gathers_per_step(&tied(ChunkSize::Elements(256), 0, 0));
    let per_parameter = gathers_per_step(&tied(ChunkSize::PerParameter, 0, 0));
    for (rank, ((chunked, layout), (alone, _))) in uncached.iter().zip(&per_parameter).enumerate() {
        assert_eq!(chunked, alone, "rank {rank}");
        let sharded = layout.count(ChunkKind::Sharded) as u64;
        assert!(
            chunked.iter().all(|&count| count > sharded),
            "rank {rank}: {chunked:?} all-gathers, {sharded} sharded chunks"
        );
    }
}
