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
//!
//! The optimizer's step has the same two paths: [`host::adam_step`] and [`host::sgd_step`]
//! over host memory, [`adam_step_kernel`] and [`sgd_step_kernel`], one launch per flat shard
//! on the cubecl backends above.

mod device_memory;
mod error;
mod fallback;
mod gathered;
pub mod host;
mod join;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernel;
mod memory_reading;
mod pack;
mod pieces;
mod queue_mark;
mod spec;
mod thread_queue;
mod unpack;

use burn::tensor::DType;
use burn::tensor::backend::Backend;

pub use device_memory::{DeviceMemorySampler, device_memory, peak_device_memory, peaks_watched};
pub use error::KernelError;
pub use gathered::cut_gathered;
pub use host::BufferPool;
pub use join::join;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub use kernel::flag;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub use kernel::fused;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub use kernel::launches::{LaunchCountError, LaunchLog};
pub use memory_reading::DeviceMemory;
pub use pack::Packer;
pub use pieces::reduce_pieces;
pub use queue_mark::QueueMark;
pub use spec::{BucketSpec, GatheredMember, MemberSpec, PackPath, PieceOp, RowPart};
pub use thread_queue::ThreadQueue;
pub use unpack::{unpack, unpack_row};

/// One Adam or AdamW step of a flat f32 shard in one kernel launch, on a `CubeBackend` (wgpu
/// or CUDA, plain or fused): per element, [`host::adam_step_with`]'s arithmetic (Burn's
/// operations in Burn's order) with [`kernel_multiply_add`]'s rounding, and the step's
/// scalars computed on the host as it computes them. On wgpu that is [`host::adam_step`] bit
/// for bit, and Burn's own Adam; on CUDA every multiply-add is one fused operation.
///
/// `param`, `grad` and the moments `(m, v)` hold the same number of f32 elements (any shape;
/// contiguous ones are read in vectors). `moments` is `None` when there are none yet: on the
/// first step (`step.time == 1`) the moments are built from the gradient, as Burn does, and
/// moments given then are not read (their buffers may be written); on a later step `None`
/// means zero moments. Returns the new parameter (in `param`'s shape) and moments. Each is
/// written into its input's buffer when nothing else holds that buffer, else into a new one.
///
/// `None` when `B` has no kernel in this build ([`kernel_available`] is false); an error, with
/// nothing launched, for a tensor that is not f32 or an f32 the device cannot compute in
/// ([`KernelError::UnsupportedDType`]), or a gradient or moment whose length differs from the
/// parameter's ([`KernelError::GradientSize`]).
#[allow(clippy::type_complexity)]
pub fn adam_step_kernel<B: Backend>(
    step: &host::AdamStep,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    moments: Option<(B::FloatTensorPrimitive, B::FloatTensorPrimitive)>,
) -> Option<
    Result<
        (
            B::FloatTensorPrimitive,
            B::FloatTensorPrimitive,
            B::FloatTensorPrimitive,
        ),
        KernelError,
    >,
> {
    adam_step_kernel_copying::<B>(step, param, grad, moments, None)
        .map(|stepped| stepped.map(|(p, m, v, _)| (p, m, v)))
}

/// [`adam_step_kernel`], and with `copy` (`DType::F16` or `DType::BF16`) the new parameter
/// also written in that dtype by the same launch, rounded as Burn's cast rounds: the cast a
/// half-precision model needs after each step, without a second launch reading the master
/// again. Returns the copy last; an error, with nothing launched, for another copy dtype or
/// one the device cannot store.
#[allow(clippy::type_complexity)]
pub fn adam_step_kernel_copying<B: Backend>(
    step: &host::AdamStep,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    moments: Option<(B::FloatTensorPrimitive, B::FloatTensorPrimitive)>,
    copy: Option<DType>,
) -> Option<
    Result<
        (
            B::FloatTensorPrimitive,
            B::FloatTensorPrimitive,
            B::FloatTensorPrimitive,
            Option<B::FloatTensorPrimitive>,
        ),
        KernelError,
    >,
> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        kernel::adam_step::<B>(step, param, grad, moments, copy, None)
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (step, param, grad, moments, copy);
        None
    }
}

/// One SGD step of a flat f32 shard in one kernel launch, on a `CubeBackend` (wgpu or CUDA,
/// plain or fused): per element, [`host::sgd_step_with`]'s arithmetic (Burn's operations in
/// Burn's order) with [`kernel_multiply_add`]'s rounding. `velocity` is read on a momentum
/// step that is not the first (`step.momentum`'s `first`); without momentum it is ignored.
/// Returns the new parameter and, with momentum, the velocity, each written into its input's
/// buffer when nothing else holds it.
///
/// `None` when `B` has no kernel in this build; an error, with nothing launched, for a tensor
/// that is not f32 ([`KernelError::UnsupportedDType`]) or a gradient or velocity whose length
/// differs from the parameter's ([`KernelError::GradientSize`]).
#[allow(clippy::type_complexity)]
pub fn sgd_step_kernel<B: Backend>(
    step: &host::SgdStep,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    velocity: Option<B::FloatTensorPrimitive>,
) -> Option<Result<(B::FloatTensorPrimitive, Option<B::FloatTensorPrimitive>), KernelError>> {
    sgd_step_kernel_copying::<B>(step, param, grad, velocity, None)
        .map(|stepped| stepped.map(|(p, v, _)| (p, v)))
}

/// [`sgd_step_kernel`], and with `copy` (`DType::F16` or `DType::BF16`) the new parameter
/// also written in that dtype by the same launch, rounded as Burn's cast rounds, as
/// [`adam_step_kernel_copying`] writes it. Returns the copy last; an error, with nothing
/// launched, for another copy dtype or one the device cannot store.
#[allow(clippy::type_complexity)]
pub fn sgd_step_kernel_copying<B: Backend>(
    step: &host::SgdStep,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    velocity: Option<B::FloatTensorPrimitive>,
    copy: Option<DType>,
) -> Option<
    Result<
        (
            B::FloatTensorPrimitive,
            Option<B::FloatTensorPrimitive>,
            Option<B::FloatTensorPrimitive>,
        ),
        KernelError,
    >,
> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        kernel::sgd_step::<B>(step, param, grad, velocity, copy, None)
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (step, param, grad, velocity, copy);
        None
    }
}

/// [`adam_step_kernel`] with the rounding of its multiply-adds chosen: the way to run the
/// fused variant, CUDA's, on wgpu. Vulkan does not promise that `fma` is fused, so on wgpu
/// the result is [`host::adam_step_with`]'s with [`host::MultiplyAdd::Fused`] only on a
/// device whose `fma` is (lavapipe's is). An error, with nothing launched, for
/// [`host::MultiplyAdd::Rounded`] on CUDA ([`KernelError::SeparateRoundingUnavailable`]).
#[allow(clippy::type_complexity)]
pub fn adam_step_kernel_with<B: Backend>(
    step: &host::AdamStep,
    multiply_add: host::MultiplyAdd,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    moments: Option<(B::FloatTensorPrimitive, B::FloatTensorPrimitive)>,
) -> Option<
    Result<
        (
            B::FloatTensorPrimitive,
            B::FloatTensorPrimitive,
            B::FloatTensorPrimitive,
        ),
        KernelError,
    >,
> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        kernel::adam_step::<B>(step, param, grad, moments, None, Some(multiply_add))
            .map(|stepped| stepped.map(|(p, m, v, _)| (p, m, v)))
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (step, multiply_add, param, grad, moments);
        None
    }
}

/// [`sgd_step_kernel`] with the rounding of its multiply-adds chosen, as
/// [`adam_step_kernel_with`].
#[allow(clippy::type_complexity)]
pub fn sgd_step_kernel_with<B: Backend>(
    step: &host::SgdStep,
    multiply_add: host::MultiplyAdd,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    velocity: Option<B::FloatTensorPrimitive>,
) -> Option<Result<(B::FloatTensorPrimitive, Option<B::FloatTensorPrimitive>), KernelError>> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        kernel::sgd_step::<B>(step, param, grad, velocity, None, Some(multiply_add))
            .map(|stepped| stepped.map(|(p, v, _)| (p, v)))
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (step, multiply_add, param, grad, velocity);
        None
    }
}

/// The rounding of multiply-adds in `B`'s optimizer kernels, so the host pass they equal bit
/// for bit ([`host::adam_step_with`], [`host::sgd_step_with`]): [`host::MultiplyAdd::Fused`]
/// on CUDA, whose compiler contracts multiply-adds (the kernels write each one out as `fma`);
/// [`host::MultiplyAdd::Rounded`] on wgpu, which is also Burn's own arithmetic. `None` when
/// `B` has no kernel in this build.
pub fn kernel_multiply_add<B: Backend>() -> Option<host::MultiplyAdd> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        kernel::multiply_add::<B>()
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        None
    }
}

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
