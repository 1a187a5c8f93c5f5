//! End-to-end training parity on wgpu ranks (Mesa's lavapipe where there is no GPU): 2 and 4
//! ranks as threads of this process sharing one device (`LocalGroup`), stages 0–3, against
//! single-rank training with Burn's Adam, bitwise where the single-rank reference is bitwise
//! reproducible (measured here). On Burn's `Wgpu` as users write it (the fusion layer on, with
//! Burn's default features) and on the plain `CubeBackend<WgpuRuntime>`. With the default chunk
//! size, which on wgpu is the searched one, so these ranks train with chunks.
//!
//! Without a wgpu adapter each test says it was skipped, unless `BURN_ZERO_REQUIRE_WGPU=1`
//! makes that a failure.

mod common;

use burn::backend::Wgpu;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_zero_testing::{base_model_on, skip};

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;

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
