//! Members shifted against the vector grid.
//!
//! A batch launch moves `N` elements a unit when every length and offset it touches divides
//! by `N`. A member whose place in the shared buffer (the bucket, the reduced row, the
//! gathered chunk) is shifted against that grid, or whose length is odd, cannot be read and
//! written in vectors on both sides. The shifted kernels still move it `N` elements a unit:
//! they read the shifted side element by element and write whole vectors on the other, so a
//! long member's body moves vectorised, whatever its offset and length; only the ends of a
//! member are special.
//!
//! The side written in vectors is the member's own output (unpack, cut: rounded up here to
//! whole vectors, the tensor handed out keeps its length) or the bucket (pack: the bucket is
//! allocated in whole vectors; where a vector of the bucket holds elements of two members, the
//! kernel reads it, replaces its own elements and writes it back, see `pack.rs`).

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::ComputeClient;

/// How a batch launch meets the vector grid: part of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Grid {
    /// Both sides read and written in vectors.
    Aligned,
    /// The shared buffer's side element by element, the other in vectors.
    Shifted,
}

/// A member moves shifted when it cannot move in vectors on both sides (`aligned == 1`), the
/// device has wider vectors (`widest`), and it is long enough for whole vectors to matter.
pub(super) fn moves_shifted(aligned: usize, widest: usize, len: usize) -> bool {
    aligned == 1 && widest > 1 && len >= 2 * widest
}

/// An uninitialised tensor of `len` elements whose buffer holds whole vectors of `vector`
/// elements: write through this tensor's linear view, hand out [`trimmed`].
pub(super) fn rounded_up<R: CubeRuntime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    len: usize,
    vector: usize,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_dtype(
        client.clone(),
        device.clone(),
        Shape::new([len.next_multiple_of(vector)]),
        dtype,
    )
}

/// `rounded` as a tensor of its first `len` elements (same buffer: Burn reads and indexes a
/// tensor through its shape, so the rounding never shows).
pub(super) fn trimmed<R: CubeRuntime>(rounded: CubeTensor<R>, len: usize) -> CubeTensor<R> {
    CubeTensor::new_contiguous(
        rounded.client,
        rounded.device,
        Shape::new([len]),
        rounded.handle,
        rounded.dtype,
    )
}
