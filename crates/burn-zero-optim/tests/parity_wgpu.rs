//! End-to-end training parity on wgpu ranks (Mesa's lavapipe where there is no GPU): 2 and 4
//! ranks as threads of this process sharing one device (`LocalGroup`), stages 0–3, against
//! single-rank training with Burn's Adam, bitwise where the single-rank reference is bitwise
//! reproducible (measured here). On Burn's fusion layer over wgpu (`Fusion<CubeBackend<..>>`,
//! what `burn::backend::Wgpu` is with Burn's default features; this workspace builds Burn
//! without them, so the type is named here) and on the plain `CubeBackend<WgpuRuntime>`. With
//! the default chunk size: the searched one on the plain backend, so those ranks train with
//! chunks, one parameter per chunk under fusion.
//!
//! Without a wgpu adapter each test says it was skipped, unless `BURN_ZERO_REQUIRE_WGPU=1`
//! makes that a failure.

mod common;

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_fusion::Fusion;
use burn_zero_testing::{base_model_on, skip};

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
/// Burn's fusion layer over wgpu.
type Wgpu = Fusion<Plain>;

const STEPS: usize = 3;

#[test]
fn fused_wgpu_ranks_train_like_one_rank() {
    if !skip::wgpu_adapter("fused_wgpu_ranks_train_like_one_rank") {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Wgpu>(&device);
    let used = common::check_parity::<Wgpu>(&base, STEPS, &device, "fused wgpu");
    println!("fused wgpu tolerances by world size: {used:?}");
}

#[test]
fn plain_wgpu_ranks_train_like_one_rank() {
    if !skip::wgpu_adapter("plain_wgpu_ranks_train_like_one_rank") {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Plain>(&device);
    let used = common::check_parity::<Plain>(&base, STEPS, &device, "plain wgpu");
    println!("plain wgpu tolerances by world size: {used:?}");
}

/// The default chunk size on wgpu is the searched one: several parameters to a chunk, so the
/// parity tests above train with chunks there.
#[test]
fn the_default_on_wgpu_packs_parameters_into_chunks() {
    if !skip::wgpu_adapter("the_default_on_wgpu_packs_parameters_into_chunks") {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Plain>(&device);
    let (layout, params) = common::default_layout::<Plain>(&base, &device);
    assert!(layout.chunks().len() < params, "{layout:?}");
    assert!(layout.chunks().iter().any(|c| c.members.len() > 1));
}

/// On Burn's fused `Wgpu` the default keeps one parameter per chunk, and chunks with
/// overlapped reduction are refused by name (they were measured to give wrong gradients when
/// ranks share a device); with overlap off they are taken.
#[test]
fn fused_wgpu_keeps_one_parameter_per_chunk_and_refuses_overlapped_chunks() {
    use burn_zero_comm::launch;
    use burn_zero_core::{ChunkSize, ZeroConfig, ZeroError, shard};
    if !skip::wgpu_adapter("fused_wgpu_keeps_one_parameter_per_chunk_and_refuses_overlapped_chunks")
    {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Wgpu>(&device);
    let (layout, params) = common::default_layout::<Wgpu>(&base, &device);
    assert_eq!(layout.chunks().len(), params, "{layout:?}");
    let shard_with = |config: ZeroConfig| {
        launch::<Wgpu, _, _, ZeroError>(2, std::slice::from_ref(&device), |ctx| {
            shard(base.clone(), &ctx, &config).map(|(_, zero)| zero.store().chunks().clone())
        })
    };
    let chunked = ZeroConfig::new()
        .with_stage(2)
        .with_chunk_size(ChunkSize::default_search());
    let refused = shard_with(chunked.clone()).err().map(|e| e.to_string());
    assert!(
        refused
            .as_deref()
            .is_some_and(|m| m.contains("with_overlap_comm(false)")),
        "{refused:?}"
    );
    let taken = shard_with(chunked.with_overlap_comm(false)).unwrap();
    assert!(taken[0].chunks().iter().any(|c| c.members.len() > 1));
}
