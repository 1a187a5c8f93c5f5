//! Gradient bucket pack and unpack for burn-zero.
//!
//! A bucket is `rows` rank rows of `row_len` elements in the reduce dtype. Each member (one
//! gradient) owns the same column range of every row. [`Packer`] writes members in offset
//! order: cast to the reduce dtype, divide by the predivide factor, zero-pad. [`unpack`] reads
//! one member's columns of a reduced row back: divide, cast to the parameter dtype.
//!
//! On `CubeBackend<WgpuRuntime, ..>` (feature `wgpu`) and `CubeBackend<CudaRuntime, ..>`
//! (feature `cuda`), plain or under Burn's fusion layer (`burn::backend::Wgpu`,
//! `burn::backend::Cuda`), each member is one kernel launch and the bucket is allocated once.
//! On Flex and NdArray (features `flex`, `ndarray`, on by default) each member is one loop
//! over host memory ([`host`]), and a [`BufferPool`] gives the bucket the previous step's
//! buffer. Every other backend uses Burn tensor ops. All paths do the same arithmetic in the
//! same order, so they agree bit for bit on the same backend.

mod error;
mod fallback;
pub mod host;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernel;
mod pack;
mod spec;
mod unpack;

use burn::tensor::backend::Backend;

pub use error::KernelError;
pub use host::BufferPool;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub use kernel::fused;
pub use pack::Packer;
pub use spec::{BucketSpec, MemberSpec, PackPath};
pub use unpack::{RowPart, unpack, unpack_row};

/// Whether `B` gets the kernel path: a `CubeBackend` on a runtime compiled into this build,
/// plain or fused.
pub fn kernel_available<B: Backend>() -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        kernel::available::<B>()
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        false
    }
}
