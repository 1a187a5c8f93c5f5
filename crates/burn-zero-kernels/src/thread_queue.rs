//! [`ThreadQueue`]: queueing device work on another thread's queue, so that what the work
//! allocates belongs to the thread that will read and drop it.

use burn::tensor::backend::Backend;

/// The device queue (cubecl's stream) of the thread that took it, for another thread to run
/// work on ([`ThreadQueue::run`]): what the work allocates is allocated in that queue's memory
/// pools, and what it launches is queued there, after what that thread had queued.
///
/// Why it matters: cubecl gives every thread its own stream and memory pools, and a buffer a
/// thread drops is free again at once *in the pool of the stream that allocated it*, ordered
/// only after that stream's own work. When thread A allocates a buffer that thread B reads
/// with kernels and then drops, A's next allocation can get the same memory and A's stream can
/// write it before B's queued kernels have read it: cubecl makes B wait for A's writes, never
/// A for B's reads. A buffer made for another thread is therefore allocated on that thread's
/// queue: dropped there, its memory is reused in that queue's order, after its readers. (A
/// [`crate::QueueMark`] orders one queue after another's *writes*; this is the other half.)
///
/// cubecl backends (`CubeBackend` on wgpu or CUDA) have such queues, plain or under Burn's
/// fusion layer: a thread's fusion stream carries the same id as its cubecl stream, and the
/// fusion server runs a stream's operations with that id as the current one, so work run here
/// is queued in the lender's fusion stream, behind what the lender had queued there, and its
/// kernels land in the lender's cubecl stream. On host backends `run` runs the work as it is.
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadQueue {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    stream: Option<cubecl::stream_id::StreamId>,
}

impl ThreadQueue {
    /// No queue: [`Self::run`] runs work on the calling thread's own queue.
    pub fn none() -> Self {
        Self::default()
    }

    /// The calling thread's queue, when `B` is a cubecl backend (plain or fused) in this build.
    pub fn current<B: Backend>() -> Self {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            Self {
                // Plain or fused: under fusion a thread's fusion stream has the id of its
                // cubecl stream, and the fusion server runs a stream's operations under it.
                stream: crate::kernel::available::<B>().then(cubecl::stream_id::StreamId::current),
            }
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            Self::none()
        }
    }

    /// Whether [`Self::run`] moves work to another queue (a cubecl backend's).
    pub fn is_on_device(&self) -> bool {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            self.stream.is_some()
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            false
        }
    }

    /// Runs `work` on the calling thread with this queue as its device queue: the device work
    /// it queues and the buffers it allocates go to this queue, until it returns (or unwinds).
    pub fn run<T>(&self, work: impl FnOnce() -> T) -> T {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if let Some(stream) = self.stream {
            return stream.executes(work);
        }
        work()
    }
}
