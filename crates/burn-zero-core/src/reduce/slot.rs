//! `GradSlot`: autodiff's slot for one parameter's gradient, as the gradient hook hands it
//! over; the reduced gradient is written back into it when backward ends.

use burn::tensor::backend::Backend;

use crate::tensor::ZeroTensor;

/// Autodiff's slot for one parameter's gradient.
pub(crate) struct GradSlot<B: Backend>(*mut ZeroTensor<B>);

// SAFETY: a slot is created, written and dropped on the thread that runs `backward`, between
// `register_sync_parameters` and `submit_sync_collective` of that backward pass; it only
// travels inside the rank's own gradient reducer, never to another thread while live.
unsafe impl<B: Backend> Send for GradSlot<B> {}

impl<B: Backend> GradSlot<B> {
    /// Wraps the pointer autodiff hands to `submit_gradient_sync`.
    pub(crate) fn new(ptr: *mut ZeroTensor<B>) -> Self {
        Self(ptr)
    }

    /// The gradient in the slot.
    pub(crate) fn read(&self) -> ZeroTensor<B> {
        // SAFETY: the pointer comes from burn-autodiff's `Gradients` container, whose boxed
        // entry for this parameter stays in place, untouched by anyone else, until the
        // gradients are handed back after `submit_sync_collective` (Burn's own sync server
        // relies on the same guarantee).
        unsafe { (*self.0).clone() }
    }

    /// Replaces the gradient in the slot.
    pub(crate) fn write(&self, value: ZeroTensor<B>) {
        // SAFETY: as in `read`; no other reference to the entry exists during backward.
        unsafe { *self.0 = value }
    }
}
