//! End-to-end training parity on wgpu ranks (Mesa's lavapipe where there is no GPU), ranks as
//! threads of this process sharing one device (`LocalGroup`), against single-rank training
//! with Burn's optimizer, bit for bit: the single-rank reference must repeat itself exactly
//! (measured here, three runs), or the test fails. Ten steps with Adam at every stage and with
//! SGD with momentum at stages 0 and 3, on 2 ranks of the plain backend; three steps with Adam
//! at 2 and 4 ranks, every stage, on the fused one. On Burn's fusion layer over wgpu (`Fusion<CubeBackend<..>>`,
//! what `burn::backend::Wgpu` is with Burn's default features; this workspace builds Burn
//! without them, so the type is named here) and on the plain `CubeBackend<WgpuRuntime>`. With
//! the default chunk size, the searched one on both, so the ranks train with chunks, and with
//! overlapped reduction (the default): each chunk's gradients are written on the training
//! thread and packed on the rank's issuing thread, another cubecl stream.
//!
//! Without a wgpu adapter each test says it was skipped, unless `BURN_ZERO_REQUIRE_WGPU=1`
//! makes that a failure.

mod common;

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_fusion::Fusion;
use burn_zero_testing::{base_model_on, skip};
use common::{Claim, Rule};

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
/// Burn's fusion layer over wgpu.
type Wgpu = Fusion<Plain>;

/// Steps of the fused backend's matrix and of the chunk test (each step on lavapipe takes
/// about a second per run).
const STEPS: usize = 3;
/// Steps of the plain backend's ten-step checks.
const LONG: usize = 10;

#[test]
fn fused_wgpu_ranks_train_like_one_rank() {
    if !skip::wgpu_adapter("fused_wgpu_ranks_train_like_one_rank") {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Wgpu>(&device);
    common::check_parity::<Wgpu>(&base, STEPS, &device, "fused wgpu", Claim::Bitwise);
}

#[test]
fn plain_wgpu_ranks_train_like_one_rank() {
    if !skip::wgpu_adapter("plain_wgpu_ranks_train_like_one_rank") {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Plain>(&device);
    common::check_parity_with::<Plain>(
        &base,
        LONG,
        &device,
        "plain wgpu",
        Rule::Adam,
        &[2],
        &[0, 1, 2, 3],
        Claim::Bitwise,
    );
}

#[test]
fn plain_wgpu_ranks_train_like_one_rank_with_sgd_and_momentum() {
    if !skip::wgpu_adapter("plain_wgpu_ranks_train_like_one_rank_with_sgd_and_momentum") {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Plain>(&device);
    common::check_parity_with::<Plain>(
        &base,
        LONG,
        &device,
        "plain wgpu",
        Rule::SgdMomentum,
        &[2],
        &[0, 3],
        Claim::Bitwise,
    );
}

/// The default chunk size on wgpu, plain and fused, is the searched one: several parameters to
/// a chunk, so the parity tests above train with chunks there.
#[test]
fn the_default_on_wgpu_packs_parameters_into_chunks() {
    if !skip::wgpu_adapter("the_default_on_wgpu_packs_parameters_into_chunks") {
        return;
    }
    let device = WgpuDevice::default();
    let plain = base_model_on::<Plain>(&device);
    let (layout, params) = common::default_layout::<Plain>(&plain, &device);
    assert!(layout.chunks().len() < params, "{layout:?}");
    assert!(layout.chunks().iter().any(|c| c.members.len() > 1));
    let fused = base_model_on::<Wgpu>(&device);
    let (layout, params) = common::default_layout::<Wgpu>(&fused, &device);
    assert!(layout.chunks().len() < params, "{layout:?}");
    assert!(layout.chunks().iter().any(|c| c.members.len() > 1));
}

/// Four ranks sharing the device, stage 3 with chunks and overlapped reduction, several times
/// over: a gradient must stay held until the issuing thread's pack kernels have read it. Were
/// it dropped as soon as its pack was queued, its memory would go back to the training
/// thread's pool while the pack still waits, and the next tensor of backward could be written
/// there first; that gave wrong gradients in 4 of 6 such runs under fusion and about 1 in 6 on
/// the plain backend (measured), so each run here is compared bitwise with one rank's.
#[test]
fn chunks_reduced_during_backward_read_every_gradient_before_it_is_freed() {
    use burn_zero_core::{ChunkSize, ZeroConfig};
    const RUNS: usize = 3;
    if !skip::wgpu_adapter("chunks_reduced_during_backward_read_every_gradient_before_it_is_freed")
    {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Wgpu>(&device);
    let (want, tolerance) =
        common::measure_reference::<Wgpu>(&base, 4, STEPS, &device, 2, Claim::Bitwise);
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(12)
        .with_chunk_size(ChunkSize::default_search());
    assert!(config.overlap_comm);
    for run in 0..RUNS {
        let got = common::sharded::<Wgpu>(&base, 4, STEPS, &config, &device);
        common::assert_close(&got, &want, tolerance, &format!("fused wgpu, run {run}"));
    }
}

/// Ranks whose engine orders its inputs after their writers on the device, as NCCL's does:
/// no device synchronisation hands a collective's input or a bucket's gradients to the issuing
/// thread, a queue mark or the reader's lent queue does (which on wgpu's single queue orders
/// nothing more; the test checks the hand-over's path: the marks made and resolved, and the
/// queues lent, on the threads that train, reduce and issue). Under Burn's fusion layer the
/// path is the one fusion's pending operations must take: into the reader's fusion stream, or
/// let through before a mark. Stages 2 and 3, overlap, gathers prefetched, chunks; bitwise one
/// rank's, on the plain backend and under fusion, with no device synchronisation counted (a
/// rank counted 43 at stage 2 here with an engine that does not order on the device).
#[test]
fn ranks_whose_engine_orders_on_the_device_train_like_one_rank() {
    if !skip::wgpu_adapter("ranks_whose_engine_orders_on_the_device_train_like_one_rank") {
        return;
    }
    ordering_on_the_device_trains_like_one_rank::<Plain>("plain");
    ordering_on_the_device_trains_like_one_rank::<Wgpu>("fused");
}

fn ordering_on_the_device_trains_like_one_rank<B>(backend: &str)
where
    B: burn::tensor::backend::Backend<Device = WgpuDevice>,
{
    use std::sync::Arc;

    use burn_zero_comm::RankContext;
    use burn_zero_core::{ChunkSize, ZeroConfig};
    use burn_zero_testing::recording::{CallLog, RecordingComm};
    let device = WgpuDevice::default();
    let base = base_model_on::<B>(&device);
    let (want, tolerance) =
        common::measure_reference::<B>(&base, 2, STEPS, &device, 2, Claim::Bitwise);
    for stage in [2, 3] {
        let config = ZeroConfig::new()
            .with_stage(stage)
            .with_prefetch(2)
            .with_chunk_size(ChunkSize::default_search());
        assert!(config.overlap_comm);
        let counters = std::sync::Mutex::new(Vec::new());
        let got = common::sharded_on::<B>(
            &base,
            2,
            STEPS,
            &config,
            &device,
            Rule::Adam,
            |ctx: RankContext<B>| {
                let engine = RecordingComm::new(ctx.engine().clone(), CallLog::default());
                let ctx =
                    RankContext::new(ctx.device().clone(), Arc::new(engine.ordering_on_device()));
                counters
                    .lock()
                    .unwrap()
                    .push(ctx.ordered().counters().clone());
                ctx
            },
        );
        let context = format!("{backend}, stage {stage}");
        common::assert_close(&got, &want, tolerance, &context);
        // Sharding, every step and reading the parameters back: no synchronisation at all.
        for counters in counters.into_inner().unwrap() {
            let counts = counters.snapshot();
            assert!(counts.collectives() > 0, "{context}: {counts:?}");
            assert_eq!(counts.syncs, 0, "{context}: device synchronisations");
        }
    }
}
