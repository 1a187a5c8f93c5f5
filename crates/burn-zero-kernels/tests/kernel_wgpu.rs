//! Kernel against fallback on `CubeBackend<WgpuRuntime>` (Mesa lavapipe where there is no
//! GPU): buckets and unpacked shards must be bitwise identical. The cases are shared with the
//! CUDA tests (`kernel_cases`). Without a wgpu adapter every test says it was skipped, unless
//! `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

mod common;
mod kernel_cases;

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_zero_kernels::kernel_available;
use burn_zero_testing::skip;

type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// The default wgpu device, or `None` (after saying so) when wgpu has no adapter here.
fn device(test: &str) -> Option<WgpuDevice> {
    skip::wgpu_adapter(test).then(WgpuDevice::default)
}

kernel_tests!(B, device);

#[test]
fn kernel_is_detected_for_half_precision_backends() {
    if device("kernel_is_detected_for_half_precision_backends").is_none() {
        return;
    }
    assert!(kernel_available::<
        CubeBackend<WgpuRuntime, half::f16, i32, u32>,
    >());
}

#[test]
fn gradient_on_another_device() {
    let Some(device) = device("gradient_on_another_device") else {
        return;
    };
    // lavapipe is also the adapter behind `WgpuDevice::Cpu`: a second device on this machine.
    kernel_cases::gradient_on_another_device::<B>(&device, &WgpuDevice::Cpu);
}
