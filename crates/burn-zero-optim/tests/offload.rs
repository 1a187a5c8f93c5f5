//! Offload (`Placement::fractions(0, 1)`): master shards, optimizer state and gradient
//! accumulators on the optimizer's host backend while the model computes on `Zero<Flex>`. With
//! the same backend on both sides the only change is the round trip through host memory, so
//! training is bitwise unchanged; with NdArray as the host, Adam's arithmetic runs in another
//! backend and agrees to float rounding.

use burn::backend::{Flex, NdArray};
use burn::optim::{Adam, AdamConfig, GradientsParams};
use burn::tensor::backend::Backend;
use burn_zero_comm::{Counts, launch};
use burn_zero_core::{Placement, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{Block, Train, base_model, micro_batch, param_values, params_bits_equal};

const WORLD: usize = 2;
const STEPS: usize = 6;
const LR: f64 = 1e-2;

/// The optimizer state of `offload_optim_frac` of the chunks on the host.
fn placed(offload_optim_frac: f64) -> Placement {
    Placement::fractions(0.0, offload_optim_frac)
}

/// Final parameters of every rank, and rank 0's master and state bytes, the optimizer state
/// placed by `placement` with `H` as the host backend.
fn train<H: Backend>(
    base: &Block<Train>,
    placement: Placement,
) -> (Vec<Vec<Vec<f32>>>, (usize, usize)) {
    let config = ZeroConfig::new()
        .with_persist_below_numel(12)
        .with_placement(placement);
    let per_rank = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer =
            ZeroOptimizer::<Flex, Adam, H>::with_host(&zero, PerTensor(AdamConfig::new().build()))?
                .with_accumulation(2);
        for step in 0..STEPS {
            let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        Ok((
            param_values(&model),
            (optimizer.master_bytes(), optimizer.state_bytes()),
        ))
    })
    .unwrap();
    let bytes = per_rank[0].1;
    (per_rank.into_iter().map(|(p, _)| p).collect(), bytes)
}

fn max_relative_difference(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .flat_map(|(x, y)| x.iter().zip(y))
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
        .fold(0.0, f32::max)
}

#[test]
fn offloading_to_the_same_backend_is_bitwise_unchanged() {
    let base = base_model(&Default::default());
    let (on_device, device_bytes) = train::<Flex>(&base, placed(0.0));
    let (offloaded, host_bytes) = train::<Flex>(&base, placed(1.0));
    assert!(device_bytes.0 > 0 && device_bytes.1 == 2 * device_bytes.0);
    assert_eq!(device_bytes, host_bytes, "the same state, somewhere else");
    for rank in 0..WORLD {
        assert!(
            params_bits_equal(&on_device[rank], &offloaded[rank]),
            "rank {rank}"
        );
    }
}

#[test]
fn offloading_to_ndarray_agrees_to_rounding() {
    let base = base_model(&Default::default());
    let (on_device, _) = train::<NdArray>(&base, placed(0.0));
    let (offloaded, _) = train::<NdArray>(&base, placed(1.0));
    // The masters' type is `Tensor<NdArray, 1>`: the steps ran in NdArray's Adam.
    let difference = max_relative_difference(&on_device, &offloaded);
    println!("max relative difference, Flex masters vs NdArray masters: {difference:e}");
    assert!(difference < 1e-5, "max relative difference {difference:e}");
}

/// Rank by rank, the memory report right after the second backward (before its step) and the
/// counts of that backward, the optimizer state placed by `placement` on a stage-3 module.
fn reports_after_backward(
    base: &Block<Train>,
    overlap: bool,
    placement: Placement,
) -> Vec<(burn_zero_core::MemoryReport, Counts)> {
    let config = ZeroConfig::new()
        .with_persist_below_numel(12)
        .with_overlap_comm(overlap)
        .with_placement(placement);
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))?;
        let mut report = None;
        for step in 0..2 {
            let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
            let loss = model.loss(tokens, targets);
            let before = zero.counts();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            report = Some((zero.memory_report(), zero.counts() - before));
            model = optimizer.step(LR, model, grads);
        }
        Ok(report.expect("two steps"))
    })
    .unwrap()
}

/// With the optimizer on the host, each reduced gradient shard leaves the device as it arrives:
/// after backward (before the step) the device holds no gradient shard and the host holds
/// exactly the shards the on-device run keeps on the device; with overlap on (the reduction
/// during backward) and off. Each bucket of several gradients is read back in one transfer:
/// backward's host reads equal its reduce-scatters, where the on-device run reads nothing.
#[test]
fn an_offloaded_optimizer_takes_gradient_shards_to_the_host_during_backward() {
    let base = base_model(&Default::default());
    for overlap in [true, false] {
        let on_device = reports_after_backward(&base, overlap, placed(0.0));
        let on_host = reports_after_backward(&base, overlap, placed(1.0));
        for (rank, ((device, on_device), (host, on_host))) in
            on_device.iter().zip(&on_host).enumerate()
        {
            assert_eq!(on_device.host_reads, 0, "overlap {overlap}, rank {rank}");
            assert!(
                on_host.reduce_scatters > 0,
                "overlap {overlap}, rank {rank}"
            );
            assert_eq!(
                on_host.host_reads, on_host.reduce_scatters,
                "overlap {overlap}, rank {rank}"
            );
            assert!(device.gradient_shards.current > 0, "rank {rank}");
            assert_eq!(device.host_gradient_shards.current, 0, "rank {rank}");
            assert_eq!(
                host.gradient_shards.current, 0,
                "overlap {overlap}, rank {rank}"
            );
            assert_eq!(
                host.host_gradient_shards.current, device.gradient_shards.current,
                "overlap {overlap}, rank {rank}"
            );
        }
    }
}
