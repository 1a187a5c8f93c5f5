//! Device memory as cubecl counts it: the independent measurement that tests and benchmarks
//! hold burn-zero's own accounting, and its memory targets, against.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use burn::tensor::backend::Backend;

/// Device memory as cubecl counts it, summed over every stream of the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes of live allocations.
    pub in_use: u64,
    /// Bytes cubecl has reserved from the device (live allocations, their padding and the
    /// free space of its pools): what the device has given up.
    pub reserved: u64,
}

/// What cubecl holds on `device` when `B` is a `CubeBackend` (wgpu or CUDA, plain or fused)
/// in this build, summed over every stream that may have allocated there; `None` for other
/// backends. Independent of burn-zero's own memory accounting.
pub fn device_memory<B: Backend>(device: &B::Device) -> Option<DeviceMemory> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        crate::kernel::device_memory::<B>(device)
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        None
    }
}

/// Runs `work` while a thread reads `device_memory` every `every`, and returns its result with
/// the most bytes reserved and the most in use seen by any reading (before, during and after
/// it); `None` for a backend without the count. A reading is a snapshot: a peak shorter than
/// `every` may fall between two.
pub fn peak_device_memory<B: Backend, T>(
    device: &B::Device,
    every: Duration,
    work: impl FnOnce() -> T,
) -> (T, Option<DeviceMemory>) {
    let Some(start) = device_memory::<B>(device) else {
        return (work(), None);
    };
    let reserved = Arc::new(AtomicU64::new(start.reserved));
    let in_use = Arc::new(AtomicU64::new(start.in_use));
    let done = Arc::new(AtomicBool::new(false));
    let record = |now: DeviceMemory, reserved: &AtomicU64, in_use: &AtomicU64| {
        reserved.fetch_max(now.reserved, Ordering::Relaxed);
        in_use.fetch_max(now.in_use, Ordering::Relaxed);
    };
    let sampler = {
        let (reserved, in_use, done) = (reserved.clone(), in_use.clone(), done.clone());
        let device = device.clone();
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if let Some(now) = device_memory::<B>(&device) {
                    record(now, &reserved, &in_use);
                }
                std::thread::sleep(every);
            }
        })
    };
    let out = work();
    done.store(true, Ordering::Relaxed);
    sampler.join().expect("the memory sampler does not panic");
    if let Some(end) = device_memory::<B>(device) {
        record(end, &reserved, &in_use);
    }
    let peak = DeviceMemory {
        in_use: in_use.load(Ordering::Relaxed),
        reserved: reserved.load(Ordering::Relaxed),
    };
    (out, Some(peak))
}
