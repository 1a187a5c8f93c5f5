//! `device_memory` against the tensors a test makes, on `CubeBackend<WgpuRuntime>` (Mesa
//! lavapipe where there is no GPU). A binary of its own: the counts are the whole device's, so
//! no other test may allocate on it meanwhile. Without a wgpu adapter the test says it was
//! skipped, unless `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn_zero_testing::skip;

type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

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
    if !skip::wgpu_adapter("device_memory_counts_tensors_of_every_stream") {
        return;
    }
    let device = WgpuDevice::default();
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
