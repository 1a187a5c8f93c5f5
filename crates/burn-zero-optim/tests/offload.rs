//! Offload: master shards, optimizer state and gradient accumulators on a host backend while
//! the model computes on `Zero<Flex>`. With the same backend on both sides the only change is
//! the round trip through host memory, so training is bitwise unchanged; with NdArray as the
//! host, Adam's arithmetic runs in another backend and agrees to float rounding.

use burn::backend::{Flex, NdArray};
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero_comm::{Counts, launch};
use burn_zero_core::{ZeroConfig, ZeroError, ZeroState, shard};
use burn_zero_optim::{Offload, Placement, ZeroOptimizer};
use burn_zero_testing::{Block, Train, base_model, micro_batch, param_values, params_bits_equal};

const WORLD: usize = 2;
const STEPS: usize = 6;
const LR: f64 = 1e-2;

/// Final parameters of every rank, and rank 0's master and state bytes.
fn train<P: Placement<Flex>>(
    base: &Block<Train>,
    optim: impl Fn(&ZeroState<Flex>) -> ZeroOptimizer<burn::optim::Adam, Flex, P> + Sync,
) -> (Vec<Vec<Vec<f32>>>, (usize, usize))
where
    burn::optim::Adam: burn::optim::SimpleOptimizer<P::Host>,
    <burn::optim::Adam as burn::optim::SimpleOptimizer<P::Host>>::State<1>:
        burn_zero_optim::StateBytes,
{
    let config = ZeroConfig::new().with_persist_below_numel(12);
    let per_rank = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer = optim(&zero).with_accumulation(2);
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
    let (on_device, device_bytes) = train(&base, |zero| {
        ZeroOptimizer::new(zero, AdamConfig::new().build())
    });
    let (offloaded, host_bytes) = train(&base, |zero| {
        ZeroOptimizer::<_, Flex, Offload<Flex>>::offloaded(zero, AdamConfig::new().build())
    });
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
    let (on_device, _) = train(&base, |zero| {
        ZeroOptimizer::new(zero, AdamConfig::new().build())
    });
    let (offloaded, _) = train(&base, |zero| {
        ZeroOptimizer::<_, Flex, Offload<NdArray>>::offloaded(zero, AdamConfig::new().build())
    });
    // The masters' type is `Tensor<NdArray, 1>`: the steps ran in NdArray's Adam.
    let difference = max_relative_difference(&on_device, &offloaded);
    println!("max relative difference, Flex masters vs NdArray masters: {difference:e}");
    assert!(difference < 1e-5, "max relative difference {difference:e}");
}

/// Rank by rank, the memory report right after the second backward (before its step) and the
/// counts of that backward, the optimizer built by `optim` on a stage-3 module.
fn reports_after_backward<P: Placement<Flex>>(
    base: &Block<Train>,
    overlap: bool,
    optim: impl Fn(&ZeroState<Flex>) -> ZeroOptimizer<burn::optim::Adam, Flex, P> + Sync,
) -> Vec<(burn_zero_core::MemoryReport, Counts)>
where
    burn::optim::Adam: burn::optim::SimpleOptimizer<P::Host>,
{
    let config = ZeroConfig::new()
        .with_persist_below_numel(12)
        .with_overlap_comm(overlap);
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer = optim(&zero);
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
        let on_device = reports_after_backward(&base, overlap, |zero| {
            ZeroOptimizer::new(zero, AdamConfig::new().build())
        });
        let on_host = reports_after_backward(&base, overlap, |zero| {
            ZeroOptimizer::<_, Flex, Offload<Flex>>::offloaded(zero, AdamConfig::new().build())
        });
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
