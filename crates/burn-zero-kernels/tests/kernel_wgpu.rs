//! Kernel against fallback on `CubeBackend<WgpuRuntime>` (Mesa lavapipe where there is no
//! GPU): buckets and unpacked shards must be bitwise identical. The cases are shared with the
//! CUDA tests (`kernel_cases`). Without a wgpu adapter every test says it was skipped, unless
//! `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

mod common;
mod kernel_cases;

use burn::backend::wgpu::{CubeBackend, CubeTensor, WgpuDevice, WgpuRuntime};
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

/// The device flag's store lands with its value, each later one replacing the last, and a
/// tensor that is not one `u32` is refused by name.
#[test]
fn a_device_flag_holds_the_last_value_signalled() {
    use burn::tensor::{DType, Shape};
    use burn_zero_kernels::{KernelError, flag};
    use cubecl::Runtime;
    let Some(device) = device("a_device_flag_holds_the_last_value_signalled") else {
        return;
    };
    let client = WgpuRuntime::client(&device);
    let make = |dtype: DType, len: usize| {
        let handle = client.create_from_slice(&vec![0u8; 4 * len]);
        CubeTensor::new_contiguous(
            client.clone(),
            device.clone(),
            Shape::new([len]),
            handle,
            dtype,
        )
    };
    let word = make(DType::U32, 1);
    for value in [1u32, 7, 0x8000_0001, u32::MAX, 2] {
        flag::signal(&word, value).unwrap();
        let bytes = client.read_one(word.handle.clone()).unwrap();
        assert_eq!(u32::from_le_bytes(bytes[..4].try_into().unwrap()), value);
    }
    for (dtype, len) in [(DType::F32, 1), (DType::U32, 2)] {
        let error = flag::signal(&make(dtype, len), 1).unwrap_err();
        assert!(
            matches!(error, KernelError::UnsupportedDType { .. }),
            "{error}"
        );
    }
}

/// A thread's queue lent to another thread: what the other thread allocates in it belongs to
/// the lender's stream (and its memory to the lender's pool), what it allocates outside it to
/// its own; on the plain backend and under Burn's fusion layer, where the other thread's
/// operations join the lender's fusion stream. Host backends lend nothing.
#[test]
fn a_thread_queue_allocates_for_the_thread_that_lent_it() {
    use burn::backend::Flex;
    use burn::tensor::Tensor;
    use burn_fusion::Fusion;
    use burn_zero_kernels::{ThreadQueue, fused};
    let Some(device) = device("a_thread_queue_allocates_for_the_thread_that_lent_it") else {
        return;
    };
    assert!(!ThreadQueue::current::<Flex>().is_on_device());
    assert!(!ThreadQueue::none().is_on_device());
    let plain = |tensor: Tensor<B, 1>| tensor.into_primitive().tensor().handle.stream;
    lends_its_queue::<B>(&device, plain);
    let fused = |tensor: Tensor<Fusion<B>, 1>| {
        fused::resolve::<WgpuRuntime>(tensor.into_primitive().tensor())
            .handle
            .stream
    };
    lends_its_queue::<Fusion<B>>(&device, fused);
}

/// Lends the calling thread's queue to a new thread and checks where that thread's tensors,
/// made inside and outside the lent queue, are allocated (`stream` resolves one on the
/// calling thread and names its buffer's stream).
fn lends_its_queue<K: burn::tensor::backend::Backend<Device = WgpuDevice>>(
    device: &WgpuDevice,
    stream: fn(burn::tensor::Tensor<K, 1>) -> cubecl::stream_id::StreamId,
) {
    use burn::tensor::Tensor;
    use burn_zero_kernels::ThreadQueue;
    let lent = ThreadQueue::current::<K>();
    assert!(lent.is_on_device());
    let here = stream(Tensor::<K, 1>::zeros([4], device));
    let device = device.clone();
    let (inside, outside) = std::thread::spawn(move || {
        let inside = lent.run(|| Tensor::<K, 1>::ones([4], &device).add_scalar(1.0));
        let outside = Tensor::<K, 1>::ones([4], &device).add_scalar(1.0);
        (stream(inside), stream(outside))
    })
    .join()
    .expect("the borrowing thread");
    assert_eq!(inside, here, "made in the lent queue");
    assert_ne!(outside, here, "made in the borrower's own queue");
}

/// A queue mark made on one thread after an in-place write, ordered after on another, which
/// then reads the written values; host backends' marks order nothing. (wgpu has one queue, so
/// this checks the hand-over, not the ordering, which only CUDA's stream per thread needs.)
#[test]
fn a_queue_mark_hands_work_to_another_thread() {
    use burn::backend::Flex;
    use burn::tensor::Tensor;
    use burn_zero_kernels::QueueMark;
    let Some(device) = device("a_queue_mark_hands_work_to_another_thread") else {
        return;
    };
    assert!(!QueueMark::here::<Flex>(&Default::default()).is_on_device());
    assert!(!QueueMark::none().is_on_device());
    let (tensor, mark) = {
        let device = device.clone();
        std::thread::spawn(move || {
            let tensor = Tensor::<B, 1>::ones([4096], &device);
            // The only handle: Burn adds in place.
            let tensor = tensor.add_scalar(1.0);
            (tensor, QueueMark::here::<B>(&device))
        })
        .join()
        .expect("the writing thread")
    };
    assert!(mark.is_on_device());
    let values = std::thread::spawn(move || {
        mark.order_here();
        tensor.into_data().to_vec::<f32>().unwrap()
    })
    .join()
    .expect("the reading thread");
    assert!(values.iter().all(|&v| v == 2.0));
}
