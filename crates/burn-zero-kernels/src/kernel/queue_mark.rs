//! Marks in a thread's device queue that another thread's queue is ordered after, on the
//! device: the one cross-stream ordering cubecl offers in its public API, used where it is
//! reliable.
//!
//! cubecl gives each thread its own stream. When a stream uses a buffer made on another
//! stream, cubecl makes it wait (an event, no host wait) for the other stream's work, but only
//! if it has not already waited for that stream since the buffer was *allocated*: the test
//! compares the last point it waited for with the buffer's allocation point. A write into an
//! existing buffer (an optimizer's step in place, a gradient accumulated in place) after such
//! a wait is not seen, and a reader on another stream could run before it.
//!
//! A mark is a buffer of four bytes allocated on the marking thread's stream at the moment of
//! marking, after everything that thread has queued. A thread that resolves it on its own
//! stream is, by the rule above, made to wait for the marking stream's work up to then, which
//! includes every earlier write to any buffer, in place or not.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;

use super::fused::{after_pending, is_fused};
use super::{is_runtime, same_type_ref};

/// A mark on runtime `R`: the client and the four-byte buffer.
struct CubeMark<R: CubeRuntime> {
    client: ComputeClient<R>,
    handle: Handle,
}

/// A mark, whatever its runtime.
pub(crate) trait Mark: Send + Sync {
    /// Orders the calling thread's stream after the marked point.
    fn order_current_stream(&self);
}

impl<R: CubeRuntime> Mark for CubeMark<R> {
    fn order_current_stream(&self) {
        // Resolving the buffer on this thread's stream is what makes cubecl order the stream
        // after the buffer's own; the resource itself is not used. An error here is a failed
        // device, which the next use of the device reports.
        let _ = self.client.get_resource(self.handle.clone());
    }
}

/// Marks the calling thread's device queue on `device`, when `B` is a cubecl backend on
/// runtime `R` (plain or fused). Under fusion the thread's pending operations are let through
/// to its stream first, so that the mark comes after them there.
pub(crate) fn mark<B: Backend, R: CubeRuntime>(device: &B::Device) -> Option<Arc<dyn Mark>> {
    if !is_runtime::<B, R>() {
        return None;
    }
    let device: &R::Device = same_type_ref(device)?;
    let client = R::client(device);
    let handle = if is_fused::<B, R>() {
        let client = client.clone();
        after_pending::<R, _>(device, move || client.empty(4))
    } else {
        client.empty(4)
    };
    Some(Arc::new(CubeMark { client, handle }))
}
