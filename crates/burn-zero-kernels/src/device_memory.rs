//! Device memory as cubecl counts it: the independent measurement that tests and benchmarks
//! hold burn-zero's own accounting, and its memory targets, against.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use burn::tensor::backend::Backend;

use crate::memory_reading::DeviceMemory;

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

/// How many samplers started with [`DeviceMemorySampler::start`] are running in this process.
static WATCHING: AtomicUsize = AtomicUsize::new(0);

/// Whether a [`DeviceMemorySampler`] started with [`DeviceMemorySampler::start`] reads device
/// memory in this process now. cubecl counts a buffer from the call that allocates it until
/// its handle drops, whether or not the device has run anything; work whose memory peaks only
/// for that instant (a rank alone packing a gradient bucket) waits for the device while a
/// sampler watches, so that the peak lasts long enough to be read, and does not otherwise.
/// A process-wide fact, as the device's memory is: a sampler of any device counts.
pub fn peaks_watched() -> bool {
    WATCHING.load(Ordering::Relaxed) > 0
}

/// A thread that reads `device_memory` every `every` and keeps the most bytes in use and
/// reserved it has seen, until it is stopped or dropped (which joins it). A reading is a
/// snapshot: a peak shorter than `every` may fall between two.
#[derive(Debug)]
pub struct DeviceMemorySampler {
    in_use: Arc<AtomicU64>,
    reserved: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Counted in [`peaks_watched`] while it runs.
    watching: bool,
}

impl DeviceMemorySampler {
    /// Starts sampling `device`'s memory every `every`; `None` for a backend without the
    /// count, or when no thread could be started. Short peaks are held for it while it runs
    /// ([`peaks_watched`]): what tests and benchmarks that judge a run by its peak use.
    pub fn start<B: Backend>(device: &B::Device, every: Duration) -> Option<Self> {
        Self::start_with::<B>(device, every, true)
    }

    /// As [`DeviceMemorySampler::start`], without asking for short peaks to be held: for a
    /// reader that reads those peaks at their instant itself (the auto placement's warm-up),
    /// so that training does not wait for the device on its account.
    pub fn start_unwatched<B: Backend>(device: &B::Device, every: Duration) -> Option<Self> {
        Self::start_with::<B>(device, every, false)
    }

    fn start_with<B: Backend>(device: &B::Device, every: Duration, watching: bool) -> Option<Self> {
        let first = device_memory::<B>(device)?;
        let in_use = Arc::new(AtomicU64::new(first.in_use));
        let reserved = Arc::new(AtomicU64::new(first.reserved));
        let done = Arc::new(AtomicBool::new(false));
        let thread = {
            let (in_use, reserved, done) = (in_use.clone(), reserved.clone(), done.clone());
            let device = device.clone();
            std::thread::Builder::new()
                .name("burn-zero-memory-sampler".into())
                .spawn(move || {
                    while !done.load(Ordering::Relaxed) {
                        if let Some(now) = device_memory::<B>(&device) {
                            in_use.fetch_max(now.in_use, Ordering::Relaxed);
                            reserved.fetch_max(now.reserved, Ordering::Relaxed);
                        }
                        std::thread::sleep(every);
                    }
                })
                .ok()?
        };
        if watching {
            WATCHING.fetch_add(1, Ordering::Relaxed);
        }
        Some(Self {
            in_use,
            reserved,
            done,
            thread: Some(thread),
            watching,
        })
    }

    /// The most bytes in use and reserved seen so far.
    pub fn peak(&self) -> DeviceMemory {
        DeviceMemory {
            in_use: self.in_use.load(Ordering::Relaxed),
            reserved: self.reserved.load(Ordering::Relaxed),
        }
    }

    /// The most bytes in use and reserved seen since the last call (or the start), and starts
    /// the next such reading from nothing: the peak of each of a run's periods in turn.
    pub fn take_peak(&self) -> DeviceMemory {
        DeviceMemory {
            in_use: self.in_use.swap(0, Ordering::Relaxed),
            reserved: self.reserved.swap(0, Ordering::Relaxed),
        }
    }

    /// Stops the thread and returns the peak.
    pub fn stop(mut self) -> DeviceMemory {
        self.join();
        self.peak()
    }

    fn join(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            // A sampler that panicked has no reading to add.
            let _ = thread.join();
            if self.watching {
                WATCHING.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for DeviceMemorySampler {
    fn drop(&mut self) {
        self.join();
    }
}

/// Runs `work` while a [`DeviceMemorySampler`] reads `device`'s memory every `every`, and
/// returns its result with the most bytes in use and reserved seen before, during and after
/// it; `None` for a backend without the count.
pub fn peak_device_memory<B: Backend, T>(
    device: &B::Device,
    every: Duration,
    work: impl FnOnce() -> T,
) -> (T, Option<DeviceMemory>) {
    let Some(sampler) = DeviceMemorySampler::start::<B>(device, every) else {
        return (work(), None);
    };
    let out = work();
    let mut peak = sampler.stop();
    if let Some(end) = device_memory::<B>(device) {
        peak.in_use = peak.in_use.max(end.in_use);
        peak.reserved = peak.reserved.max(end.reserved);
    }
    (out, Some(peak))
}
