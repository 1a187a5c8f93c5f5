//! Parameter offload measured on the device: one rank on `CubeBackend<WgpuRuntime>` (Mesa's
//! lavapipe where there is no GPU) trains a model of four 1024 × 1024 linear layers at stage 3,
//! its optimizer on Flex (`Offload<Flex>`) in both runs, without a gather cache and with the
//! reduction after backward (the same memory over time in every run), with every
//! parameter shard on the device and then with every shard in host memory
//! (`Placement::fractions(1, 1)`). What the device holds is read from cubecl's own count
//! (`burn_zero_kernels::device_memory`, every stream summed), not from burn-zero's accounting.
//! The count is the whole device's, so it includes the unsharded model the runs start from
//! (four layers, 16 MiB, drawn on the device and kept by the test): the same in every run, so
//! the comparisons below are of what burn-zero holds.
//!
//! - between steps the offloaded run holds at least 90% of the shards' bytes (computed here
//!   from the layer shapes) less than the other;
//! - at its peak, sampled through the steps, it holds at least half the shards' bytes less (one
//!   layer's weight is on the device while an op uses it, on top of the gradients);
//! - both runs end with bitwise the same parameters.
//!
//! Then the auto placement (`Placement::auto`) with a capacity between the two
//! runs' peaks, leaving room for one or two of the four layers' shards: its peak stays within
//! the capacity that the all-on-device run exceeds, it moves as many layers' shards to the
//! device as its measured room holds (at least one), it keeps host layers' shards on the
//! device between uses in the periods with room to spare (the rank's upload count over the
//! placed steps is below the two uploads per host layer and pass that a placement without it
//! makes, by as many as it reports kept uses), it sends fewer bytes to the device over those
//! steps than the run with every shard on the host, with no more read-backs' bytes and no more
//! synchronisations (the rank's counts: on a GPU, what crosses the bus), and it trains the
//! same bits. With gathers prefetched two ahead, where the upload of a shard to keep is made by
//! the gather that prefetches it, it still keeps shards, each kept use still saves an upload,
//! and the bits are the same. A capacity
//! below what the run needs with every shard on the host stops it with a named error, and so
//! does asking to read the capacity from a wgpu device (only CUDA's driver reports one).
//!
//! First, sharding a model whose parameters Burn has not initialised yet: with every shard
//! offloaded the device holds at most two layers at the peak (each parameter is materialised,
//! cut and sent to the host in turn), while kept on the device the shards are all four.
//!
//! A binary of its own: the count is the whole device's, so no other test may allocate on it
//! meanwhile. Without a wgpu adapter the test says it was skipped, unless
//! `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

use std::time::Duration;

use burn::backend::wgpu::WgpuDevice;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::backend::Backend;
use burn_zero_comm::{Counts, launch};
use burn_zero_core::{
    AutoPlacementReport, Capacity, ChunkSize, KeptShardStats, Placement, ZeroConfig, ZeroError,
    shard,
};
use burn_zero_kernels::{DeviceMemory, device_memory, peak_device_memory};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{param_values, params_bits_equal};

#[path = "common/stack.rs"]
mod stack;

use stack::{LAYERS, Plain, Stack, Train, WIDTH, can_measure, input};

/// Two warm-up passes of the auto placement, and two steps placed.
const STEPS: usize = 4;
/// The steps after the auto placement's warm-up.
const PLACED: usize = 2;
/// How often the device's memory is read during the steps.
const EVERY: Duration = Duration::from_millis(2);

/// What one run measured: device memory between steps (after the last, synchronised) and at
/// its peak over the steps, the final parameters, and the auto placement's decision.
struct Run {
    between: DeviceMemory,
    peak: DeviceMemory,
    params: Vec<Vec<f32>>,
    placed: Option<AutoPlacementReport>,
    kept: Option<KeptShardStats>,
    /// The rank's counts over the last `PLACED` steps (uploads of host memory to the device
    /// and their bytes among them).
    placed_counts: Counts,
}

/// Trains `base` at stage 3 with `config`'s placement; `Err` with the rank's failure.
/// A configuration with `placement`.
fn placed(placement: Placement) -> ZeroConfig {
    ZeroConfig::new().with_placement(placement)
}

fn train(base: &Stack<Train>, config: ZeroConfig) -> Result<Run, String> {
    let device = WgpuDevice::default();
    // Gradients reduced when backward ends, on the training thread: without a communication
    // thread racing backward, each run's memory over time is the same from run to run.
    // The optimizer's state on the host in every run.
    // No gather cache, unless the run prefetches (which gathers into it).
    let placement = config.placement.with_offload_optim_frac(1.0);
    let gathered = if config.prefetch > 0 {
        config.max_live_gathered_bytes
    } else {
        0
    };
    let config = config
        .with_stage(3)
        .with_chunk_size(ChunkSize::PerParameter)
        .with_max_live_gathered_bytes(gathered)
        .with_overlap_comm(false)
        .with_placement(placement);
    let mut ranks = launch::<Plain, _, _, ZeroError>(1, std::slice::from_ref(&device), |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))?;
        let mut placed_from = Counts::default();
        let mut placed_counts = Counts::default();
        let mut kept = None;
        let (model, peak) = peak_device_memory::<Plain, _>(ctx.device(), EVERY, || {
            for step in 0..STEPS {
                if step == STEPS - PLACED {
                    placed_from = zero.counts();
                }
                let input = input::<Train>(step, ctx.device());
                let grads = GradientsParams::from_grads(model.loss(input).backward(), &model);
                model = optimizer.step(1e-3, model, grads);
                Plain::sync(ctx.device()).unwrap();
            }
            placed_counts = zero.counts() - placed_from;
            // Before the parameters are read back, which gathers them once more.
            kept = zero.memory_report().kept_shards;
            model
        });
        Ok(Run {
            between: device_memory::<Plain>(ctx.device()).expect("a cubecl backend"),
            peak: peak.expect("a cubecl backend"),
            params: param_values(&model),
            placed: zero.memory_report().auto_placement,
            kept,
            placed_counts,
        })
    })
    .map_err(|error| error.to_string())?;
    Ok(ranks.swap_remove(0))
}

#[test]
fn parameters_on_the_host_leave_the_device_and_the_auto_placement_keeps_under_its_capacity() {
    let test =
        "parameters_on_the_host_leave_the_device_and_the_auto_placement_keeps_under_its_capacity";
    if !can_measure(test) {
        return;
    }
    let device = WgpuDevice::default();
    let layer = (WIDTH * WIDTH * 4) as u64;
    let shards = LAYERS as u64 * layer;

    check_lazy_sharding(&device, layer, shards);

    let base = Stack::<Train>::drawn(&device);

    // Every shard on the device, then every shard on the host.
    let on_device = train(&base, ZeroConfig::new()).unwrap();
    let on_host = train(&base, placed(Placement::fractions(1.0, 1.0))).unwrap();
    println!(
        "shards {shards} B; between steps in use {} → {} B; peak in use {} → {} B",
        on_device.between.in_use,
        on_host.between.in_use,
        on_device.peak.in_use,
        on_host.peak.in_use
    );
    assert!(
        on_device.between.in_use >= on_host.between.in_use + shards * 9 / 10,
        "between steps: {:?} on the device, {:?} offloaded, {shards} B of shards",
        on_device.between,
        on_host.between
    );
    assert!(
        on_device.peak.in_use >= on_host.peak.in_use + shards / 2,
        "at the peak: {:?} on the device, {:?} offloaded, {shards} B of shards",
        on_device.peak,
        on_host.peak
    );
    assert!(params_bits_equal(&on_host.params, &on_device.params));

    let auto = check_auto_placement(&base, &on_device, &on_host, layer);
    check_uploads(&auto, &on_host, layer);
    check_prefetched(&base, &on_device, layer);
    check_refused_capacities(&base, &on_host);
}

/// Sharding a lazy model holds at most two layers on the device with its parameters
/// offloaded, and the whole model with them kept there.
fn check_lazy_sharding(device: &WgpuDevice, layer: u64, shards: u64) {
    // Sharding a model whose parameters are still lazy: with the parameters offloaded, each is
    // materialised on the device, cut and sent to the host before the next, so the device
    // never holds the model; kept on the device, the shards are the whole model.
    let sharding_peak = |config: ZeroConfig| {
        let lazy = Stack::<Train>::new(device);
        let config = config
            .with_stage(3)
            .with_chunk_size(ChunkSize::PerParameter);
        let (after, peak) = peak_device_memory::<Plain, _>(device, EVERY, || {
            let mut after =
                launch::<Plain, _, _, ZeroError>(1, std::slice::from_ref(device), |ctx| {
                    let (model, _zero) = shard(lazy.clone(), &ctx, &config)?;
                    Plain::sync(ctx.device()).unwrap();
                    // Read once more while the shards are alive: sharding may end between two of
                    // the sampler's readings.
                    let after = device_memory::<Plain>(ctx.device()).expect("a cubecl backend");
                    drop(model);
                    Ok(after.in_use)
                })
                .unwrap();
            after.swap_remove(0)
        });
        peak.expect("a cubecl backend").in_use.max(after)
    };
    let kept = sharding_peak(ZeroConfig::new());
    let offloaded = sharding_peak(placed(Placement::fractions(1.0, 1.0)));
    println!(
        "sharding a lazy model of {shards} B: peak in use {kept} B kept, {offloaded} B offloaded"
    );
    assert!(
        kept >= shards,
        "kept on the device the shards are the model: {kept} B"
    );
    assert!(
        offloaded <= 2 * layer,
        "offloaded, sharding held {offloaded} B at its peak, more than two of the {LAYERS} \
         layers ({layer} B each)"
    );
}

/// The auto placement under a capacity the all-on-device run goes over: it stays under it,
/// places as many whole layers as its own measurement leaves room for, and trains the same
/// bits. Returns its run.
fn check_auto_placement(base: &Stack<Train>, on_device: &Run, on_host: &Run, layer: u64) -> Run {
    // A capacity that leaves room for one of the four layers' shards next to what the run
    // needs with every shard on the host and one layer more for the step (which holds one
    // chunk's old and new values), and that the run with every shard on the device goes over.
    let capacity = (on_host.peak.in_use + 2 * layer + layer / 5) as f64 / 0.9;
    assert!(
        capacity < on_device.peak.in_use as f64,
        "the capacity {capacity} must be below the all-on-device peak {:?} for the test to mean \
         anything",
        on_device.peak
    );
    let mib = capacity / 1048576.0;
    let auto = train(base, placed(Placement::auto(Capacity::MiB(mib)))).unwrap();
    let placed = auto
        .placed
        .expect("the warm-up ended and the shards were placed");
    println!(
        "capacity {capacity:.0} B: peak in use {:?}, {placed:?}",
        auto.peak
    );
    assert!(
        auto.peak.in_use as f64 <= capacity,
        "the auto placement went over its capacity {capacity:.0} B: {:?} ({placed:?})",
        auto.peak
    );
    // The decision against its own measurement: one layer kept out of the room for the step,
    // and as many whole layers as the rest holds.
    assert_eq!(placed.step_bytes, layer, "{placed:?}");
    assert_eq!(
        placed.room_bytes,
        (0.9 * placed.capacity_bytes as f64) as u64 - placed.warmup_peak_bytes - layer,
        "{placed:?}"
    );
    let fitting = ((placed.room_bytes / layer) as usize).min(LAYERS);
    assert_eq!(
        (placed.device_chunks, placed.host_chunks),
        (fitting, LAYERS - fitting),
        "{placed:?}"
    );
    assert!(fitting >= 1, "the room holds no layer's shard: {placed:?}");
    assert!(params_bits_equal(&auto.params, &on_device.params));

    auto
}

/// The uploads of an auto placement's placed steps against its own report of kept shards: it
/// kept host shards, and each kept use saved one upload.
fn check_kept_uses(auto: &Run) {
    let placed = auto
        .placed
        .expect("the warm-up ended and the shards were placed");
    // Uploads over the placed steps: without keeping, each host layer's shard is uploaded for
    // its forward and its backward gather, and each device layer's new shard once after the
    // optimizer's step on the host; each device layer's shard moved there once, when the
    // placement decided at the first of these steps.
    let kept = auto.kept.expect("the placement decided");
    let (host, device) = (placed.host_chunks, placed.device_chunks);
    let unkept = (PLACED * (2 * host + device) + device) as u64;
    println!(
        "uploads over {PLACED} placed steps: {} (without keeping {unkept}); {kept:?}",
        auto.placed_counts.host_writes
    );
    assert!(
        kept.kept_uses >= 1,
        "no host shard was kept: {kept:?} {placed:?}"
    );
    assert_eq!(kept.off_schedule, 0, "{kept:?}");
    assert_eq!(
        auto.placed_counts.host_writes,
        unkept - kept.kept_uses,
        "each kept use saves one upload: {kept:?}"
    );
}

/// The uploads of the auto placement's placed steps against its own report of kept shards,
/// and what a GPU pays for against the run with every shard on the host.
fn check_uploads(auto: &Run, on_host: &Run, layer: u64) {
    check_kept_uses(auto);
    // What a GPU pays for, over the same steps: each upload carries one layer's shard, so the
    // placement sends fewer bytes to the device than the run with every shard on the host,
    // and it reads back no more and synchronises the device no more often.
    let (auto_counts, host_counts) = (auto.placed_counts, on_host.placed_counts);
    println!(
        "over the placed steps, every shard on the host: {host_counts:?}; auto placement: \
         {auto_counts:?}"
    );
    for counts in [auto_counts, host_counts] {
        assert_eq!(
            counts.host_write_bytes,
            counts.host_writes * layer,
            "{counts:?}"
        );
    }
    assert!(
        auto_counts.host_write_bytes < host_counts.host_write_bytes,
        "the placement uploaded {} B, every shard on the host {} B",
        auto_counts.host_write_bytes,
        host_counts.host_write_bytes
    );
    assert!(auto_counts.host_read_bytes <= host_counts.host_read_bytes);
    assert!(auto_counts.syncs <= host_counts.syncs);
}

/// The auto placement with gathers issued ahead of use: a kept shard is then uploaded by the
/// gather that prefetches it (on a GPU, by the rank's issuing thread, on its stream; here one
/// rank makes it in place) and kept from there. The run keeps shards, each kept use saves an
/// upload, and it trains the same bits.
fn check_prefetched(base: &Stack<Train>, on_device: &Run, layer: u64) {
    // Two gathers ahead, with room in the cache for both.
    let prefetching = |placement| {
        placed(placement)
            .with_prefetch(2)
            .with_max_live_gathered_bytes(2 * layer as usize)
    };
    let on_host = train(base, prefetching(Placement::fractions(1.0, 1.0))).unwrap();
    // As in `check_auto_placement`: room for one layer's shard beside the step's, over what
    // the run needs with every shard on the host (prefetched layers included).
    let capacity = (on_host.peak.in_use + 2 * layer + layer / 5) as f64 / 0.9;
    let auto = train(
        base,
        prefetching(Placement::auto(Capacity::MiB(capacity / 1048576.0))),
    )
    .unwrap();
    let placed = auto
        .placed
        .expect("the warm-up ended and the shards were placed");
    println!("prefetching, capacity {capacity:.0} B: {placed:?}");
    assert!(params_bits_equal(&auto.params, &on_device.params));
    assert!(
        placed.host_chunks >= 1,
        "every layer went to the device, nothing to keep: {placed:?}"
    );
    check_kept_uses(&auto);
}

/// A capacity below what the run needs with every shard on the host, and a device capacity
/// asked of wgpu, are named errors.
fn check_refused_capacities(base: &Stack<Train>, on_host: &Run) {
    // Less than the run needs with every shard on the host: a named error, not an allocation
    // failure.
    let too_small = on_host.peak.in_use as f64 / 2.0 / 1048576.0;
    let error = match train(base, placed(Placement::auto(Capacity::MiB(too_small)))) {
        Ok(_) => panic!("a capacity of {too_small} MiB was enough"),
        Err(error) => error,
    };
    assert!(
        error.contains("does not fit") && error.contains("the auto placement's capacity"),
        "{error}"
    );

    // wgpu reports no device size: asking for it is refused, naming the option to use.
    let error = match train(base, placed(Placement::auto(Capacity::Device))) {
        Ok(_) => panic!("a capacity was read from a wgpu device"),
        Err(error) => error,
    };
    assert!(
        error.contains("not a CUDA backend") && error.contains("Capacity::MiB"),
        "{error}"
    );
}
