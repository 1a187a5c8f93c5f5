//! End-to-end training parity on wgpu ranks (Mesa's lavapipe where there is no GPU): 2 and 4
//! ranks as threads of this process, stages 0–3, against single-rank training with Burn's Adam,
//! bitwise where the single-rank reference is bitwise reproducible (measured here).
//!
//! On the plain `CubeBackend<WgpuRuntime>`: several `LocalGroup` ranks sharing one device under
//! Burn's fusion layer (Burn's `Wgpu` alias) do not work yet. Without a wgpu adapter the test
//! says it was skipped, unless `BURN_ZERO_REQUIRE_WGPU=1` makes that a failure.

mod common;

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_zero_testing::{base_model_on, skip};

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;

#[test]
fn wgpu_ranks_train_like_one_rank() {
    if !skip::wgpu_adapter("wgpu_ranks_train_like_one_rank") {
        return;
    }
    let device = WgpuDevice::default();
    let base = base_model_on::<Plain>(&device);
    let used = common::check_parity::<Plain>(&base, 3, &device, "wgpu");
    println!("wgpu tolerances by world size: {used:?}");
}
