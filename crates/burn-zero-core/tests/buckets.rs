//! Bucketed gradient reduction at every stage: reduced gradients equal the rank-order mean of
//! the ranks' gradients, bit for bit, whatever the bucket size; predivide factors keep the
//! mean; an f32 reduce dtype with half-precision parameters rounds once.

use burn::backend::Flex;
use burn::module::Module;
use burn::tensor::DType;
use burn_zero_comm::launch;
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_testing::{Block, CastParams, Materialise, Train, loss_and_grads, reference};
use half::{bf16, f16};

/// One rank's loss, gathered gradients and bucket layout.
type RankRun = (f32, Vec<Vec<f32>>, Vec<Vec<usize>>);

/// Rounds an f32 to a half type and back.
type Round = fn(f32) -> f32;

/// Each rank's loss and gathered gradients, and the bucket layout, for `config`.
fn run(base: &Block<Train>, world_size: usize, config: &ZeroConfig) -> Vec<RankRun> {
    launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, config)?;
        let layout = zero.bucket_layout();
        let (loss, grads) = loss_and_grads(&model, ctx.rank(), ctx.device());
        Ok((loss, grads, layout))
    })
    .unwrap_or_else(|e| panic!("world {world_size}, {config:?}: {e}"))
}

fn base_model() -> Block<Train> {
    let model = Block::<Train>::new(&Default::default());
    model.visit(&mut Materialise);
    model
}

fn bits(values: &[Vec<f32>]) -> Vec<Vec<u32>> {
    values
        .iter()
        .map(|v| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn every_stage_and_bucket_size_gives_the_rank_order_mean() {
    let base = base_model();
    // 0: one collective per parameter; 0.0002 MiB (~210 B): many flushes and the direct path
    // for the larger matrices; 25: the default; 10⁴: everything in one bucket.
    let sizes = [0.0, 0.0002, 25.0, 1e4];
    for world_size in 1..=4 {
        let (ref_losses, ref_grads) = reference(&base, world_size);
        for (stage, bucket_size_mb, overlap_comm) in (0..=3u8)
            .flat_map(|stage| sizes.map(|size| (stage, size)))
            .flat_map(|(stage, size)| [(stage, size, true), (stage, size, false)])
        {
            let config = ZeroConfig::new()
                .with_stage(stage)
                .with_persist_below_numel(12)
                .with_bucket_size_mb(bucket_size_mb)
                .with_overlap_comm(overlap_comm);
            let per_rank = run(&base, world_size, &config);
            let (_, _, layout) = &per_rank[0];
            let params: usize = layout.iter().map(Vec::len).sum();
            assert_eq!(params, ref_grads.len());
            if bucket_size_mb == 0.0 {
                assert_eq!(layout.len(), params, "one bucket per parameter");
            }
            if bucket_size_mb == 0.0002 {
                assert!(
                    layout.iter().any(|b| b.len() > 1),
                    "small gradients share buckets: {layout:?}"
                );
                assert!(layout.len() > 3, "several flushes: {layout:?}");
            }
            if bucket_size_mb == 1e4 && stage != 3 {
                assert_eq!(layout.len(), 1, "one bucket holds everything");
            }
            for (rank, (loss, grads, _)) in per_rank.iter().enumerate() {
                let ctx = format!(
                    "world {world_size}, stage {stage}, bucket {bucket_size_mb} MiB, \
                         overlap {overlap_comm}, rank {rank}"
                );
                assert_eq!(loss.to_bits(), ref_losses[rank].to_bits(), "loss, {ctx}");
                assert_eq!(bits(grads), bits(&ref_grads), "gradients, {ctx}");
            }
        }
    }
}

#[test]
fn predivide_factors_keep_the_mean() {
    let base = base_model();
    for world_size in [2, 3, 4] {
        let (_, ref_grads) = reference(&base, world_size);
        for factor in [1.0, 2.0, world_size as f64] {
            let config = ZeroConfig::new()
                .with_persist_below_numel(0)
                .with_bucket_size_mb(0.001)
                .with_gradient_predivide_factor(factor);
            for (rank, (_, grads, _)) in run(&base, world_size, &config).into_iter().enumerate() {
                // Dividing by a power of two is exact: bitwise equal then.
                let exact = factor.log2().fract() == 0.0
                    && (world_size as f64 / factor).log2().fract() == 0.0;
                for (got, want) in grads.iter().zip(&ref_grads) {
                    // Relative to the parameter's largest gradient: rounding happens on the
                    // ranks' terms, which can be far larger than a cancelling mean.
                    let scale = want.iter().fold(0f32, |m, w| m.max(w.abs()));
                    for (g, w) in got.iter().zip(want) {
                        if exact {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "world {world_size}, factor {factor}, rank {rank}"
                            );
                        } else {
                            assert!(
                                (g - w).abs() <= 1e-6 * scale,
                                "world {world_size}, factor {factor}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Mean of the ranks' half-precision gradients: widened to f32 (exact), added in rank order,
/// divided in f32 and rounded once to the half type.
fn half_reference(base: &Block<Train>, world_size: usize, round: Round) -> Vec<Vec<f32>> {
    let device = Default::default();
    let per_batch: Vec<Vec<Vec<f32>>> = (0..world_size)
        .map(|index| loss_and_grads(base, index, &device).1)
        .collect();
    (0..per_batch[0].len())
        .map(|p| {
            (0..per_batch[0][p].len())
                .map(|i| {
                    let mut sum = per_batch[0][p][i];
                    for batch in &per_batch[1..] {
                        sum += batch[p][i];
                    }
                    round(if world_size > 1 {
                        sum / world_size as f32
                    } else {
                        sum
                    })
                })
                .collect()
        })
        .collect()
}

#[test]
fn f32_reduction_of_half_precision_gradients_rounds_once() {
    let cases: [(DType, Round); 2] = [
        (DType::F16, |x| f16::from_f32(x).to_f32()),
        (DType::BF16, |x| bf16::from_f32(x).to_f32()),
    ];
    for (dtype, round) in cases {
        let base = base_model().map(&mut CastParams(dtype));
        for world_size in [2, 3] {
            let want = half_reference(&base, world_size, round);
            for stage in [0, 2, 3] {
                let config = ZeroConfig::new()
                    .with_stage(stage)
                    .with_persist_below_numel(12)
                    .with_reduce_dtype(Some(DType::F32));
                for (rank, (_, grads, _)) in run(&base, world_size, &config).into_iter().enumerate()
                {
                    assert_eq!(
                        bits(&grads),
                        bits(&want),
                        "{dtype:?}, world {world_size}, stage {stage}, rank {rank}"
                    );
                }
            }
        }
    }
}
