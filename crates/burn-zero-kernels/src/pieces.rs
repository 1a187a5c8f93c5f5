//! `reduce_pieces`: the pieces an all-to-all received (one per rank, end to end) reduced
//! element by element in rank order, the arithmetic of the engines that sum on their own side.

use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;

use crate::KernelError;
use crate::spec::{PieceOp, is_float};

/// Reduces `received`, `parts` pieces of equal length end to end, in one kernel launch on a
/// `CubeBackend` (wgpu or CUDA, plain or fused): from piece 0, each later piece folded in in
/// order, every step rounded in the tensor's dtype, a mean divided once at the end. That is
/// bit for bit what Burn's `+`, `max_pair`, `min_pair` and `div_scalar` give folded over the
/// pieces on the same device, in one launch instead of one per piece.
///
/// `None` when `B` has no kernels in this build; an error, with nothing launched, for no pieces
/// or a length that `parts` does not divide ([`KernelError::UnevenPieces`]), a non-float dtype,
/// or one the device cannot compute in ([`KernelError::UnsupportedDType`]).
pub fn reduce_pieces<B: Backend>(
    received: B::FloatTensorPrimitive,
    parts: usize,
    op: PieceOp,
) -> Option<Result<B::FloatTensorPrimitive, KernelError>> {
    if !crate::kernel_available::<B>() {
        return None;
    }
    let numel = received.shape().num_elements();
    if parts == 0 || !numel.is_multiple_of(parts) {
        return Some(Err(KernelError::UnevenPieces { numel, parts }));
    }
    let dtype = received.dtype();
    if !is_float(dtype) {
        return Some(Err(KernelError::UnsupportedDType {
            dtype,
            path: "piece reduction",
        }));
    }
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        crate::kernel::reduce_pieces::<B>(received, parts, op)
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = op;
        None
    }
}
