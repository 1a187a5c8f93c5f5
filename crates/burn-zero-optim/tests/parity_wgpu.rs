//! End-to-end training parity on wgpu ranks (Mesa's lavapipe where there is no GPU): 2 and 4
//! ranks as threads of this process sharing one device (`LocalGroup`), stages 0–3, against
//! single-rank training with Burn's Adam, bitwise where the single-rank reference is bitwise
//! reproducible (measured here). On Burn's `Wgpu` as users write it (the fusion layer on, with
//! Burn's default features) and on the plain `CubeBackend<WgpuRuntime>`.
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
