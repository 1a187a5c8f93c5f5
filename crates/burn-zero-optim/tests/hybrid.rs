//! Hybrid sharding (`ZeroConfig::shard_group_size`) trained end to end through
//! `ZeroOptimizer`: N ranks in N/S shard groups of S contiguous ranks; each group shards the
//! model over its S ranks and the groups hold the same blocks.
//!
//! The order the mean gradient is added up in, which the reference below repeats: inside each
//! shard group the ranks' gradients are added in rank order (the group's reduce-scatter), then
//! the groups' sums are added in group order (the all-reduce across the groups), and the total
//! is divided once by N. For N = 4, S = 2 that is ((g0 + g1) + (g2 + g3)) / 4, which is not the
//! flat order (((g0 + g1) + g2) + g3) / 4 of plain sharding; the test checks that the two
//! references differ, so matching one of them bit for bit says which order was used.
//!
//! Chunks (`ZeroConfig::chunk_size`) are laid out over the shard group's ranks and reduced in
//! the same two collectives per chunk: training stays bitwise. Adam's state is that of the
//! elements a rank steps: its blocks over the shard group.
//!
//! What hybrid sharding does on its own — each pass's reduced gradients in hybrid order, the
//! chunks laid out over the group, the bytes moved inside and across the groups, the parameter
//! bytes, the refusal of a group size that does not divide the ranks — is checked without an
//! optimizer in burn-zero-core's `tests/hybrid.rs`.

use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{
    Block, Inner, Train, base_model, micro_batch, param_values, params_bits_equal,
};

const STEPS: usize = 4;
const LR: f64 = 1e-2;

/// The gradients of one step's N micro-batches (micro-batch `step · N + rank` on rank `rank`),
/// added in the hybrid order — rank order within each group of `shard` ranks, then the groups
/// in order — and divided once by N.
fn hybrid_mean(model: &Block<Train>, step: usize, world: usize, shard: usize) -> GradientsParams {
    let device = Default::default();
    let grads: Vec<GradientsParams> = (0..world)
        .map(|rank| {
            let (tokens, targets) = micro_batch::<Train>(step * world + rank, &device);
            GradientsParams::from_grads(model.loss(tokens, targets).backward(), model)
        })
        .collect();
    struct Mean<'a> {
        grads: &'a [GradientsParams],
        shard: usize,
        out: GradientsParams,
    }
    impl ModuleVisitor<Train> for Mean<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
            let get = |g: &GradientsParams| g.get::<Inner, D>(param.id).expect("a gradient");
            let sum = |parts: &[GradientsParams]| {
                let mut parts = parts.iter().map(get);
                let first = parts.next().expect("a rank");
                parts.fold(first, |acc, g| acc + g)
            };
            let mut groups = self.grads.chunks(self.shard).map(sum);
            let first = groups.next().expect("a group");
            let total = groups.fold(first, |acc, g| acc + g);
            let mean = if self.grads.len() > 1 {
                total.div_scalar(self.grads.len() as f64)
            } else {
                total
            };
            self.out.register::<Inner, D>(param.id, mean);
        }
    }
    let mut mean = Mean {
        grads: &grads,
        shard,
        out: GradientsParams::new(),
    };
    model.visit(&mut mean);
    mean.out
}

/// Single rank, Burn's Adam, the hybrid-order mean gradient of every step.
fn reference(base: &Block<Train>, world: usize, shard: usize) -> Vec<Vec<f32>> {
    let mut model = base.clone();
    let mut optim = AdamConfig::new().init();
    for step in 0..STEPS {
        let mean = hybrid_mean(&model, step, world, shard);
        model = optim.step(LR, model, mean);
    }
    param_values(&model)
}

fn sharded(base: &Block<Train>, world: usize, config: &ZeroConfig) -> Vec<Vec<Vec<f32>>> {
    launch::<Flex, _, _, ZeroError>(world, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        for step in 0..STEPS {
            let (tokens, targets) = micro_batch::<Train>(step * world + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        Ok(param_values(&model))
    })
    .unwrap_or_else(|e| panic!("{world} ranks, {config:?}: {e}"))
}

/// One parameter per chunk (gradient buckets of `bucket_size_mb`), and chunks of 256 elements,
/// which pack several parameters of the test block together over a shard group of 2 or 3
/// (checked in burn-zero-core's `tests/hybrid.rs`).
const CHUNK_SIZES: [ChunkSize; 2] = [ChunkSize::PerParameter, ChunkSize::Elements(256)];

fn config(stage: u8, shard: usize) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(stage)
        .with_shard_group_size(shard)
        .with_persist_below_numel(12)
        .with_bucket_size_mb(0.001)
}

#[test]
fn hybrid_training_matches_single_rank_training_in_hybrid_order_bitwise() {
    let base = base_model(&Default::default());
    // (N, S): 2 groups of 2, 2 groups of 3, 3 groups of 2.
    for (world, shard) in [(4, 2), (6, 3), (6, 2)] {
        let want = reference(&base, world, shard);
        let flat = reference(&base, world, world);
        assert!(
            !params_bits_equal(&want, &flat),
            "N = {world}, S = {shard}: the hybrid and flat orders give the same bits, so this \
             test could not tell them apart"
        );
        for chunk_size in CHUNK_SIZES {
            for stage in 0..=3 {
                for overlap in [true, false] {
                    let config = config(stage, shard)
                        .with_overlap_comm(overlap)
                        .with_chunk_size(chunk_size);
                    let got = sharded(&base, world, &config);
                    for (rank, params) in got.iter().enumerate() {
                        assert!(
                            params_bits_equal(params, &want),
                            "N = {world}, S = {shard}, stage {stage}, overlap {overlap}, \
                             {chunk_size:?}: rank {rank} differs from the hybrid-order reference"
                        );
                    }
                }
            }
        }
    }
}

/// Adam's state on each of 4 ranks in shard groups of 2 after two steps: two f32 moments of
/// every element the rank steps, computed here from the parameters' shapes (a sharded
/// parameter's block over the group, a replicated parameter whole).
#[test]
fn adam_state_follows_the_shard_group_size() {
    let base = base_model(&Default::default());
    let (world, group_size) = (4, 2);
    for chunk_size in CHUNK_SIZES {
        let config = config(3, group_size).with_chunk_size(chunk_size);
        let per_rank = launch::<Flex, _, _, ZeroError>(world, &[Default::default()], |ctx| {
            let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
            let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))?;
            for step in 0..2 {
                let (tokens, targets) =
                    micro_batch::<Train>(step * world + ctx.rank(), ctx.device());
                let loss = model.loss(tokens, targets);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optimizer.step(LR, model, grads);
            }
            drop(model);
            Ok((zero.params(), optimizer.state_bytes()))
        })
        .unwrap();
        for (rank, (infos, state)) in per_rank.iter().enumerate() {
            let elements: usize = infos
                .iter()
                .map(|info| {
                    let n = info.shape.num_elements();
                    if info.persistent {
                        n
                    } else {
                        n.div_ceil(group_size)
                    }
                })
                .sum();
            assert_eq!(
                *state,
                8 * elements,
                "rank {rank}, {chunk_size:?}: optimizer state bytes"
            );
        }
    }
}
