//! [`QueueMark`]: handing device work from one thread to another without the host waiting.

use std::sync::Arc;

use burn::tensor::backend::Backend;

/// A point in one thread's device queue that another thread orders its own queue after, on
/// the device and without the host waiting: what a thread hands over with a tensor another
/// thread's device work will read, so that the reader runs after every write queued before the
/// mark, also writes into buffers made earlier (in place).
///
/// On cubecl backends (wgpu, CUDA; plain or fused) each thread has its own queue (stream), and
/// cubecl orders one after another only for buffers allocated after their last meeting; a
/// mark is such a buffer, four bytes allocated when marking (the module's source says more).
/// Under Burn's fusion layer, marking first lets the thread's pending fused operations through
/// to its stream, so that the mark comes after them (the host waits for the fusion server to
/// hand them to cubecl, not for the device).
/// Elsewhere, and for [`QueueMark::none`], ordering is a no-op: host backends have no queue,
/// and the thread that made the work needs no mark to read it.
#[derive(Clone, Default)]
pub struct QueueMark {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    mark: Option<Arc<dyn crate::kernel::Mark>>,
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    mark: Option<Arc<()>>,
}

impl QueueMark {
    /// No mark: ordering after it does nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// Marks the calling thread's queue on `device`, after everything it has queued so far.
    pub fn here<B: Backend>(device: &B::Device) -> Self {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            Self {
                mark: crate::kernel::queue_mark::<B>(device),
            }
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            let _ = device;
            Self::none()
        }
    }

    /// Whether this mark orders anything (a cubecl backend's mark).
    pub fn is_on_device(&self) -> bool {
        self.mark.is_some()
    }

    /// Orders the calling thread's queue after the marked point: its work queued from now on
    /// runs after the marking thread's work queued before the mark.
    pub fn order_here(&self) {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if let Some(mark) = &self.mark {
            mark.order_current_stream();
        }
    }
}

impl std::fmt::Debug for QueueMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueMark")
            .field("on_device", &self.is_on_device())
            .finish()
    }
}
