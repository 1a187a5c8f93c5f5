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

/// `device_memory` sees what tensors hold, on whichever thread (stream) made them: a 4 MiB
/// tensor made on another thread raises the bytes in use by at least its size while it lives,
/// and they fall back once it is dropped (cubecl may keep the pages reserved). Not a backend of
/// cubecl: `None`.
#[test]
fn device_memory_counts_tensors_of_every_stream() {
    use burn::backend::Flex;
    use burn::tensor::Tensor;
    use burn::tensor::backend::Backend;
    use burn_zero_kernels::device_memory;
    let Some(device) = device("device_memory_counts_tensors_of_every_stream") else {
        return;
    };
    assert_eq!(device_memory::<Flex>(&Default::default()), None);
    let before = device_memory::<B>(&device).expect("a cubecl backend");
    let size = 1 << 20;
    let made = {
        let device = device.clone();
        std::thread::spawn(move || {
            let tensor = Tensor::<B, 1>::ones([size], &device);
            B::sync(&device).unwrap();
            tensor
        })
        .join()
        .unwrap()
    };
    let holding = device_memory::<B>(&device).unwrap();
    assert!(
        holding.in_use >= before.in_use + 4 * size as u64,
        "{before:?} → {holding:?}"
    );
    assert!(holding.reserved >= holding.in_use, "{holding:?}");
    // The tensor's stream is the thread that made it: only a sum over every stream sees it.
    drop(made);
    B::sync(&device).unwrap();
    let after = device_memory::<B>(&device).unwrap();
    assert!(after.in_use < holding.in_use, "{holding:?} → {after:?}");
}
