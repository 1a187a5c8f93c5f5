//! `gpu_margin_mem_ratio` measured on the device: one rank on `CubeBackend<WgpuRuntime>` (Mesa's
//! lavapipe where there is no GPU) trains four 1024 × 1024 linear layers at stage 3 under the
//! auto placement, with the fused Adam split between the device and Flex (every chunk's state
//! starting on the host, `Placement::auto`). What the device holds is cubecl's
//! own count (`burn_zero_kernels::device_memory`, every stream summed):
//!
//! - a first run with a large capacity and no margin gives the warm-up's peak and the shards'
//!   bytes; the capacity of the second is set so that after every shard moves to the device,
//!   what is left over holds between one and three layers' optimizer state (12 bytes per
//!   parameter: master and two moments);
//! - with `gpu_margin_mem_ratio` 1 the policy moves at least one chunk's state to the device,
//!   never more bytes than the left-over room, and the device's measured peak over the run
//!   stays within the capacity;
//! - the parameters are bitwise those of the run with every chunk stepping on the host (the
//!   fused kernel on the device and the host pass compute alike).
//!
//! A binary of its own: the count is the whole device's, so no other test may allocate on it
//! meanwhile. Without a wgpu adapter the test says it was skipped, unless
//! `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

use std::time::Duration;

use burn::backend::wgpu::WgpuDevice;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::backend::Backend;
use burn_zero_comm::launch;
use burn_zero_core::{
    AutoPlacementReport, Capacity, ChunkSize, Placement, ZeroConfig, ZeroError, shard,
};
use burn_zero_kernels::{DeviceMemory, peak_device_memory};
use burn_zero_optim::{MarginReport, ZeroOptimizer};
use burn_zero_testing::{param_values, params_bits_equal};

#[path = "common/stack.rs"]
mod stack;

use stack::{LAYERS, Plain, Stack, Train, WIDTH, can_measure, input};

/// Two warm-up passes, the placement and the margin at the third, two more steps after.
const STEPS: usize = 5;
const EVERY: Duration = Duration::from_millis(2);

struct Run {
    peak: DeviceMemory,
    params: Vec<Vec<f32>>,
    placed: AutoPlacementReport,
    margin: Option<MarginReport>,
}

/// A run under the auto placement with capacity `mib`, the optimizer's state on the host
/// but for what a margin of `ratio` moves.
fn train(base: &Stack<Train>, mib: f64, ratio: f64) -> Run {
    let device = WgpuDevice::default();
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_chunk_size(ChunkSize::PerParameter)
        .with_max_live_gathered_bytes(0)
        .with_overlap_comm(false)
        .with_placement(Placement::auto(Capacity::MiB(mib)).with_gpu_margin_mem_ratio(ratio));
    let mut ranks = launch::<Plain, _, _, ZeroError>(1, std::slice::from_ref(&device), |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer = ZeroOptimizer::new(&zero, AdamConfig::new())?;
        let (model, peak) = peak_device_memory::<Plain, _>(ctx.device(), EVERY, || {
            for step in 0..STEPS {
                let input = input::<Train>(step, ctx.device());
                let grads = GradientsParams::from_grads(model.loss(input).backward(), &model);
                model = optimizer.step(1e-3, model, grads);
                Plain::sync(ctx.device()).unwrap();
            }
            model
        });
        Ok(Run {
            peak: peak.expect("a cubecl backend"),
            params: param_values(&model),
            placed: zero
                .memory_report()
                .auto_placement
                .expect("the warm-up ended"),
            margin: optimizer.margin_report(),
        })
    })
    .unwrap();
    ranks.swap_remove(0)
}

#[test]
fn optimizer_chunks_fill_the_room_the_placement_leaves_and_stay_under_the_capacity() {
    let test = "optimizer_chunks_fill_the_room_the_placement_leaves_and_stay_under_the_capacity";
    if !can_measure(test) {
        return;
    }
    let device = WgpuDevice::default();
    let base = Stack::<Train>::drawn(&device);
    let params = (WIDTH * WIDTH) as u64;
    let layer_state = 12 * params;

    let roomy = train(&base, 4096.0, 0.0);
    assert_eq!(roomy.placed.device_chunks, LAYERS, "{:?}", roomy.placed);
    // A ratio of 0 shares nothing: no margin policy runs.
    assert_eq!(roomy.margin, None);

    // After every shard (4 bytes per parameter) moves, two and a half layers' state is left
    // over.
    let capacity = (roomy.placed.warmup_peak_bytes
        + LAYERS as u64 * 4 * params
        + 2 * layer_state
        + layer_state / 2) as f64
        / 0.9;
    let run = train(&base, capacity / 1048576.0, 1.0);
    let margin = run.margin.expect("the policy acted");
    println!(
        "capacity {capacity:.0} B: {:?}; {margin:?}; peak in use {:?}",
        run.placed, run.peak
    );
    assert!(
        (1..LAYERS).contains(&margin.moved_chunks),
        "{margin:?} {:?}",
        run.placed
    );
    assert!(
        margin.moved_bytes <= margin.budget_bytes
            && margin.budget_bytes <= run.placed.left_over_bytes(),
        "{margin:?} {:?}",
        run.placed
    );
    assert_eq!(margin.moved_bytes, margin.moved_chunks as u64 * layer_state);
    assert!(
        run.peak.in_use as f64 <= capacity,
        "the run went over its capacity {capacity:.0} B: {:?}",
        run.peak
    );
    assert!(params_bits_equal(&run.params, &roomy.params));
}
