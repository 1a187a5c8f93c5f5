//! Kernel against fallback on `CubeBackend<CudaRuntime>` (feature `cuda`): the cases of the
//! wgpu tests (`kernel_cases`: f32, f16, bf16, odd sizes and offsets, strided gradients),
//! bitwise; the optimizer kernels with gradient multiplier and half-precision copy against the
//! host pass with fused multiply-adds and Burn's cast, bitwise. Every test says it was skipped when no CUDA device is visible, unless
//! `BURN_ZERO_REQUIRE_CUDA=1` makes that a failure.

mod common;
mod kernel_cases;

use burn_cubecl::CubeBackend;
use burn_zero_kernels::kernel_available;
use burn_zero_testing::skip;
use cubecl::cuda::{CudaDevice, CudaRuntime};

type B = CubeBackend<CudaRuntime, f32, i32, u8>;

/// CUDA device 0, or `None` (after saying so) when no CUDA device is visible.
fn device(test: &str) -> Option<CudaDevice> {
    skip::cuda_devices(test, 1).map(|_| CudaDevice::new(0))
}

kernel_tests!(B, device);

#[test]
fn kernel_is_detected_for_half_precision_backends() {
    if device("kernel_is_detected_for_half_precision_backends").is_none() {
        return;
    }
    assert!(kernel_available::<
        CubeBackend<CudaRuntime, half::f16, i32, u8>,
    >());
    assert!(kernel_available::<
        CubeBackend<CudaRuntime, half::bf16, i32, u8>,
    >());
}

#[test]
fn gradient_on_another_device() {
    let test = "gradient_on_another_device";
    if skip::cuda_devices(test, 2).is_none() {
        return;
    }
    kernel_cases::gradient_on_another_device::<B>(&CudaDevice::new(0), &CudaDevice::new(1));
}
