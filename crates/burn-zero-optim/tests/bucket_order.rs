//! Gradient buckets rebuilt for the order backward produces gradients in, on Flex ranks.
//!
//! The model's LayerNorm parameters get their gradients only when backward ends (see
//! `common/normed.rs`). In the layout's order, with every parameter replicated (stage 0, or a
//! chunk layout of replicated chunks), nearly every bucket holds one of them next to a weight,
//! so every weight's gradient waits for the end of backward before its bucket can be reduced.
//! After the first pass the buckets are rebuilt from the order the gradients came in: from the
//! second step on, at most about one bucket's gradients wait for the rest of their bucket.
//! `ReductionStats::peak_incomplete_bytes` counts that from the hooks' order, so the test is
//! exact on any machine; and the training ends bitwise where the same training without overlap
//! (which keeps the layout's buckets and reduces when backward ends) does, on every rank.
//!
//! With sharded weights and replicated LayerNorms interleaved in the order, each kind fills its
//! own buckets: a step issues one collective per `bucket_size_mb` of each kind, not one per
//! change of kind.

use burn::backend::Flex;
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, ReductionStats, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{Materialise, Train, param_values};

#[path = "common/normed.rs"]
mod normed;
use normed::{LAYERS, NormedStack, WEIGHT_BYTES, WIDTH, input};

const WORLD: usize = 2;
const STEPS: usize = 3;

/// One rank's training: each step's reduction statistics, the bucket layout at the end, and
/// the final parameters.
struct RankRun {
    stats: Vec<ReductionStats>,
    layout: Vec<Vec<usize>>,
    params: Vec<Vec<f32>>,
}

fn train(base: &NormedStack<Train>, config: &ZeroConfig) -> Vec<RankRun> {
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut stats = Vec::new();
        for step in 0..STEPS {
            let grads = model.loss(input(step, ctx.rank(), ctx.device())).backward();
            stats.push(zero.last_reduction());
            let grads = GradientsParams::from_grads(grads, &model);
            model = optimizer.step(1e-3, model, grads);
        }
        Ok(RankRun {
            stats,
            layout: zero.bucket_layout(),
            params: param_values(&model),
        })
    })
    .unwrap_or_else(|error| panic!("{config:?}: {error}"))
}

fn base() -> NormedStack<Train> {
    let base = NormedStack::<Train>::new(&Default::default());
    base.visit(&mut Materialise);
    base
}

/// Every parameter (4 per layer) in exactly one bucket.
fn assert_every_parameter_once(layout: &[Vec<usize>]) {
    let mut keys: Vec<usize> = layout.iter().flatten().copied().collect();
    keys.sort_unstable();
    assert_eq!(keys, (0..4 * LAYERS).collect::<Vec<_>>(), "{layout:?}");
}

/// Trains `config` with and without overlap; checks that from the second step on, at most
/// `bound` bytes of gradients wait for the rest of their bucket at once, and that both runs
/// end bitwise the same on every rank. Returns the overlapped run.
fn check(config: &ZeroConfig, bound: usize) -> Vec<RankRun> {
    let base = base();
    let overlapped = train(&base, config);
    let reference = train(&base, &config.clone().with_overlap_comm(false));
    for (rank, run) in overlapped.iter().enumerate() {
        let waiting: Vec<usize> = run.stats.iter().map(|s| s.peak_incomplete_bytes).collect();
        println!(
            "rank {rank}: {} buckets; bytes waiting for their bucket at most, per step: \
             {waiting:?}; layout {:?}",
            run.layout.len(),
            run.layout
        );
        assert_every_parameter_once(&run.layout);
        for (step, &waiting) in waiting.iter().enumerate().skip(1) {
            assert!(
                waiting <= bound,
                "rank {rank}, step {step}: {waiting} bytes of gradients waited for their \
                 bucket at once (bound {bound}): {:?}",
                run.layout
            );
        }
        assert_eq!(
            run.params, reference[rank].params,
            "rank {rank}: overlapped training ends where training without it does"
        );
        assert_eq!(
            run.params, overlapped[0].params,
            "rank {rank} against rank 0"
        );
    }
    overlapped
}

/// A bucket size in MiB of `bytes`.
fn mib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

#[test]
fn replicated_buckets_are_rebuilt_for_the_order_of_gradients() {
    // Stage 0: every parameter replicated and all-reduced, buckets of two weights. The layout
    // puts a LayerNorm parameter in every bucket; rebuilt, the LayerNorms (and whatever else
    // arrives at the end) share the last bucket.
    let config = ZeroConfig::new()
        .with_stage(0)
        .with_bucket_size_mb(mib(2 * WEIGHT_BYTES));
    let runs = check(&config, 2 * WEIGHT_BYTES);
    // The first step runs the layout's buckets: the model is one that needs the rebuild.
    let first = runs[0].stats[0].peak_incomplete_bytes;
    assert!(
        first >= LAYERS / 2 * WEIGHT_BYTES,
        "in the layout's buckets only {first} bytes waited: the model does not show the order"
    );
}

#[test]
fn replicated_chunks_buckets_are_rebuilt_within_the_chunk_capacity() {
    // Stage 0 with chunks of two weights: a replicated chunk's gradients are delivered member
    // by member, so its bucket may be regrouped; each rebuilt bucket stays within the chunk.
    let capacity = 2 * WIDTH * WIDTH;
    let config = ZeroConfig::new()
        .with_stage(0)
        .with_chunk_size(ChunkSize::Elements(capacity));
    let runs = check(&config, 2 * WEIGHT_BYTES);
    let sizes = |keys: &Vec<usize>| -> usize {
        // Keys 4·l .. 4·l + 3 are layer l's weight, bias, LayerNorm scale and shift.
        keys.iter()
            .map(|key| if key % 4 == 0 { WIDTH * WIDTH } else { WIDTH })
            .sum()
    };
    for bucket in &runs[0].layout {
        assert!(sizes(bucket) <= capacity, "{bucket:?}");
    }
}

#[test]
fn sharded_and_replicated_gradients_fill_buckets_of_their_own() {
    // Stage 3, weights sharded, biases and LayerNorms replicated, buckets of two weights'
    // gradients: 8 reduce-scatters of two weights and one all-reduce of everything else a
    // step, from the first step on (the layout's order alternates weight and bias: a bucket
    // per kind keeps them from cutting each other's short).
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(WIDTH * WIDTH)
        .with_bucket_size_mb(mib(2 * WEIGHT_BYTES));
    // One bucket of weights and the small parameters' one at most.
    let small = 3 * LAYERS * WIDTH * 4;
    let runs = check(&config, 2 * WEIGHT_BYTES + small);
    for run in &runs {
        assert_eq!(run.layout.len(), LAYERS / 2 + 1);
        for stats in &run.stats {
            assert_eq!(stats.collectives, LAYERS / 2 + 1);
        }
    }
}
