//! cubecl kernels and the run-time detection of the backends that can launch them.
//!
//! Burn has no specialisation, so a generic `B: Backend` is matched against the runtimes
//! compiled in by comparing `B::FloatTensorPrimitive` with `CubeTensor<R>` (a `CubeBackend`)
//! and with `FusionTensor<FusionCubeRuntime<R>>` (a `CubeBackend` under Burn's fusion layer,
//! which is what `burn::backend::Wgpu` and `burn::backend::Cuda` are with Burn's default
//! features). Neither type depends on `CubeBackend`'s element parameters, so one comparison
//! covers every `CubeBackend<R, F, I, BT>`. Under fusion, inputs are resolved to their
//! `CubeTensor` and results registered back ([`fused`]).

mod adam;
mod batch;
pub mod flag;
pub mod fused;
mod gathered;
pub mod launches;
mod memory;
mod pack;
mod pieces;
mod queue_mark;
mod sgd;
mod shifted;
mod unpack;

use std::any::{Any, TypeId};

use burn::tensor::DType;
use burn::tensor::backend::Backend;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::TypeUsage;
use cubecl::ir::{AddressType, StorageType};
use cubecl::prelude::ComputeClient;
use cubecl::stream_id::StreamId;

use crate::KernelError;
use crate::host::MultiplyAdd;
use crate::spec::{BucketSpec, MemberSpec};

pub(crate) use pack::CubePacker;
pub(crate) use queue_mark::Mark;

/// A bucket being packed by kernels on `B`'s device.
pub(crate) trait KernelPacker<B: Backend>: Send {
    /// Writes `member`'s `rows * len` elements; sizes have been checked by the caller.
    fn push(
        &mut self,
        member: &MemberSpec,
        grad: Option<B::FloatTensorPrimitive>,
    ) -> Result<(), KernelError>;

    /// The packed bucket.
    fn finish(self: Box<Self>) -> B::FloatTensorPrimitive;
}

/// Whether `B`'s float tensors are `CubeTensor<R>`, directly or under fusion.
fn is_runtime<B: Backend, R: CubeRuntime>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<CubeTensor<R>>()
        || fused::is_fused::<B, R>()
}

/// Whether `B` is a `CubeBackend` on a runtime compiled into this build.
pub(crate) fn available<B: Backend>() -> bool {
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return true;
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return true;
    }
    false
}

/// The device memory cubecl holds for `device`, when `B` is a `CubeBackend` in this build.
pub(crate) fn device_memory<B: Backend>(
    device: &B::Device,
) -> Option<crate::memory_reading::DeviceMemory> {
    #[cfg(feature = "wgpu")]
    if let Some(usage) = memory::usage::<B, cubecl::wgpu::WgpuRuntime>(device) {
        return Some(usage);
    }
    #[cfg(feature = "cuda")]
    if let Some(usage) = memory::usage::<B, cubecl::cuda::CudaRuntime>(device) {
        return Some(usage);
    }
    let _ = device;
    None
}

/// A mark of the calling thread's device queue, when `B` is a cubecl backend in this build
/// ([`crate::QueueMark`]).
pub(crate) fn queue_mark<B: Backend>(device: &B::Device) -> Option<std::sync::Arc<dyn Mark>> {
    #[cfg(feature = "wgpu")]
    if let Some(mark) = queue_mark::mark::<B, cubecl::wgpu::WgpuRuntime>(device) {
        return Some(mark);
    }
    #[cfg(feature = "cuda")]
    if let Some(mark) = queue_mark::mark::<B, cubecl::cuda::CudaRuntime>(device) {
        return Some(mark);
    }
    let _ = device;
    None
}

/// A kernel packer for `B`: `None` when `B` has no kernels in this build, an error when they
/// cannot produce `spec.dtype` on `device`.
pub(crate) fn packer<B: Backend>(
    spec: &BucketSpec,
    device: &B::Device,
) -> Option<Result<Box<dyn KernelPacker<B>>, KernelError>> {
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return Some(boxed(CubePacker::<cubecl::wgpu::WgpuRuntime>::new::<B>(
            spec, device,
        )));
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return Some(boxed(CubePacker::<cubecl::cuda::CudaRuntime>::new::<B>(
            spec, device,
        )));
    }
    let _ = (spec, device);
    None
}

fn boxed<B: Backend, R: CubeRuntime>(
    packer: Result<CubePacker<R>, KernelError>,
) -> Result<Box<dyn KernelPacker<B>>, KernelError> {
    packer.map(|packer| Box::new(packer) as Box<dyn KernelPacker<B>>)
}

/// Unpacks with a kernel: `None` when `B` has no kernels in this build, an error when they
/// cannot handle one of the dtypes.
pub(crate) fn unpack<B: Backend>(
    reduced: &B::FloatTensorPrimitive,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
) -> Option<Result<B::FloatTensorPrimitive, KernelError>> {
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return Some(unpack::unpack::<B, cubecl::wgpu::WgpuRuntime>(
            reduced, offset, len, postdivide, dtype,
        ));
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return Some(unpack::unpack::<B, cubecl::cuda::CudaRuntime>(
            reduced, offset, len, postdivide, dtype,
        ));
    }
    let _ = (reduced, offset, len, postdivide, dtype);
    None
}

/// Every part of a reduced row that needs a divisor or a cast, unpacked by batched kernel
/// launches (`None` in the place of a part that needs neither): `None` when `B` has no
/// kernels in this build, an error when they cannot handle one of the dtypes.
pub(crate) fn unpack_parts<B: Backend>(
    reduced: &B::FloatTensorPrimitive,
    parts: &[crate::RowPart],
    postdivide: f64,
) -> Option<Result<Vec<Option<B::FloatTensorPrimitive>>, KernelError>> {
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return Some(unpack::unpack_parts::<B, cubecl::wgpu::WgpuRuntime>(
            reduced, parts, postdivide,
        ));
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return Some(unpack::unpack_parts::<B, cubecl::cuda::CudaRuntime>(
            reduced, parts, postdivide,
        ));
    }
    let _ = (reduced, parts, postdivide);
    None
}

/// Every member of an all-gathered chunk cut out by batched kernel launches: `None` when `B`
/// has no kernels in this build, an error when they cannot handle its dtype.
pub(crate) fn cut_gathered<B: Backend>(
    gathered: &B::FloatTensorPrimitive,
    ranks: usize,
    members: &[crate::GatheredMember],
) -> Option<Result<Vec<B::FloatTensorPrimitive>, KernelError>> {
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return Some(gathered::cut::<B, cubecl::wgpu::WgpuRuntime>(
            gathered, ranks, members,
        ));
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return Some(gathered::cut::<B, cubecl::cuda::CudaRuntime>(
            gathered, ranks, members,
        ));
    }
    let _ = (gathered, ranks, members);
    None
}

/// `received`'s pieces reduced in rank order by one launch: `None` when `B` has no kernels in
/// this build.
pub(crate) fn reduce_pieces<B: Backend>(
    received: B::FloatTensorPrimitive,
    parts: usize,
    op: crate::spec::PieceOp,
) -> Option<Result<B::FloatTensorPrimitive, KernelError>> {
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return Some(pieces::reduce_pieces::<B, cubecl::wgpu::WgpuRuntime>(
            received, parts, op,
        ));
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return Some(pieces::reduce_pieces::<B, cubecl::cuda::CudaRuntime>(
            received, parts, op,
        ));
    }
    let _ = (received, parts, op);
    None
}

/// The rounding of multiply-adds `B`'s optimizer kernels compute with: fused on CUDA, whose
/// compiler contracts them anyway; rounded on wgpu, as Burn's ops round them. `None` when `B`
/// has no kernels in this build.
pub(crate) fn multiply_add<B: Backend>() -> Option<MultiplyAdd> {
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return Some(MultiplyAdd::Rounded);
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return Some(MultiplyAdd::Fused);
    }
    None
}

/// The rounding an optimizer kernel of `B` runs with: `requested`, or `B`'s own when none is;
/// `None` when `B` has no kernels in this build, an error for a rounding the runtime cannot
/// compute (CUDA's compiler contracts multiply-adds, so its kernels cannot round them apart).
fn chosen_multiply_add<B: Backend>(
    requested: Option<MultiplyAdd>,
) -> Option<Result<MultiplyAdd, KernelError>> {
    let native = self::multiply_add::<B>()?;
    Some(match requested.unwrap_or(native) {
        MultiplyAdd::Rounded if native == MultiplyAdd::Fused => {
            Err(KernelError::SeparateRoundingUnavailable)
        }
        chosen => Ok(chosen),
    })
}

/// One Adam/AdamW step with a kernel: `None` when `B` has no kernels in this build.
pub(crate) fn adam_step<B: Backend>(
    step: &crate::host::AdamStep,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    moments: Option<(B::FloatTensorPrimitive, B::FloatTensorPrimitive)>,
    copy: Option<DType>,
    multiply_add: Option<MultiplyAdd>,
) -> Option<Result<adam::Stepped<B::FloatTensorPrimitive>, KernelError>> {
    let multiply_add = match chosen_multiply_add::<B>(multiply_add)? {
        Ok(chosen) => chosen,
        Err(error) => return Some(Err(error)),
    };
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return Some(adam::adam_step::<B, cubecl::wgpu::WgpuRuntime>(
            step,
            param,
            grad,
            moments,
            copy,
            multiply_add,
        ));
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return Some(adam::adam_step::<B, cubecl::cuda::CudaRuntime>(
            step,
            param,
            grad,
            moments,
            copy,
            multiply_add,
        ));
    }
    let _ = (step, param, grad, moments, copy);
    None
}

/// One SGD step with a kernel: `None` when `B` has no kernels in this build.
pub(crate) fn sgd_step<B: Backend>(
    step: &crate::host::SgdStep,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    velocity: Option<B::FloatTensorPrimitive>,
    copy: Option<DType>,
    multiply_add: Option<MultiplyAdd>,
) -> Option<Result<sgd::Stepped<B::FloatTensorPrimitive>, KernelError>> {
    let multiply_add = match chosen_multiply_add::<B>(multiply_add)? {
        Ok(chosen) => chosen,
        Err(error) => return Some(Err(error)),
    };
    #[cfg(feature = "wgpu")]
    if is_runtime::<B, cubecl::wgpu::WgpuRuntime>() {
        return Some(sgd::sgd_step::<B, cubecl::wgpu::WgpuRuntime>(
            step,
            param,
            grad,
            velocity,
            copy,
            multiply_add,
        ));
    }
    #[cfg(feature = "cuda")]
    if is_runtime::<B, cubecl::cuda::CudaRuntime>() {
        return Some(sgd::sgd_step::<B, cubecl::cuda::CudaRuntime>(
            step,
            param,
            grad,
            velocity,
            copy,
            multiply_add,
        ));
    }
    let _ = (step, param, grad, velocity, copy);
    None
}

/// The checks an optimizer kernel makes before launching: every tensor f32, and the gradient
/// and state tensors (all after the first) as long as the parameter (the first).
fn check_flat_f32<P: burn::tensor::TensorMetadata>(
    tensors: &[&P],
    path: &'static str,
) -> Result<(), KernelError> {
    for tensor in tensors {
        let dtype = tensor.dtype();
        if dtype != DType::F32 {
            return Err(KernelError::UnsupportedDType { dtype, path });
        }
    }
    let expected = tensors.first().map_or(0, |t| t.shape().num_elements());
    for tensor in tensors.iter().skip(1) {
        let actual = tensor.shape().num_elements();
        if actual != expected {
            return Err(KernelError::GradientSize { expected, actual });
        }
    }
    Ok(())
}

/// `value` as a `U`, when `T` and `U` are the same type.
fn same_type<T: 'static, U: 'static>(value: T) -> Result<U, T> {
    let mut slot = Some(value);
    match (&mut slot as &mut dyn Any).downcast_mut::<Option<U>>() {
        Some(same) => Ok(same.take().expect("slot is filled")),
        None => Err(slot.expect("slot is untouched")),
    }
}

/// `B`'s float primitive as the `CubeTensor<R>` it is or, under fusion, stands for (checked
/// when the path was chosen). A fused tensor's pending operations run first.
fn into_cube<B: Backend, R: CubeRuntime>(tensor: B::FloatTensorPrimitive) -> CubeTensor<R> {
    let tensor = match same_type::<_, CubeTensor<R>>(tensor) {
        Ok(tensor) => return tensor,
        Err(tensor) => tensor,
    };
    match same_type(tensor) {
        Ok(tensor) => fused::resolve::<R>(tensor),
        Err(_) => unreachable!(
            "the kernel path is only taken when B's float tensor is CubeTensor<R> or its fused form"
        ),
    }
}

/// [`into_cube`] for a tensor the kernel only reads, which other threads may hold clones of
/// (a gradient the rank thread still holds while the issuing thread packs it). A fused tensor
/// is resolved while a clone of it is kept here: burn-fusion decides inside the device thread
/// whether the resolved tensor was the last handle, and a clone dropped on another thread at
/// that moment makes it register a drop from within the device thread, which cubecl refuses
/// ("Service state is already borrowed"). With the clone kept, the resolved handle is never
/// the last; the clone is dropped afterwards, here, like any other.
fn into_cube_reading<B: Backend, R: CubeRuntime>(tensor: B::FloatTensorPrimitive) -> CubeTensor<R> {
    let kept = tensor.clone();
    let resolved = into_cube::<B, R>(tensor);
    drop(kept);
    resolved
}

/// A `CubeTensor<R>` as `B`'s float primitive: itself, or under fusion a fused tensor that
/// holds it (checked when the path was chosen).
fn from_cube<B: Backend, R: CubeRuntime>(tensor: CubeTensor<R>) -> B::FloatTensorPrimitive {
    let tensor = match same_type(tensor) {
        Ok(tensor) => return tensor,
        Err(tensor) => tensor,
    };
    match same_type(fused::register::<R>(tensor)) {
        Ok(tensor) => tensor,
        Err(_) => unreachable!(
            "the kernel path is only taken when B's float tensor is CubeTensor<R> or its fused form"
        ),
    }
}

/// `value` as a `&U`, when `T` and `U` are the same type.
fn same_type_ref<T: 'static, U: 'static>(value: &T) -> Option<&U> {
    (value as &dyn Any).downcast_ref::<U>()
}

/// The kernels' element type for `dtype`, when `client` can load, convert and compute in it.
///
/// `Flex32` is left to the fallback: Burn gives it relaxed arithmetic that a kernel in `f32`
/// would not reproduce bit for bit.
fn storage_type<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dtype: DType,
) -> Result<StorageType, KernelError> {
    let unsupported = KernelError::UnsupportedDType {
        dtype,
        path: "kernel",
    };
    if !matches!(dtype, DType::F64 | DType::F32 | DType::F16 | DType::BF16) {
        return Err(unsupported);
    }
    let storage: StorageType = dtype.into();
    let usage = client.properties().type_usage(storage);
    if usage.is_superset(TypeUsage::Buffer | TypeUsage::Conversion | TypeUsage::Arithmetic) {
        Ok(storage)
    } else {
        Err(unsupported)
    }
}

/// The element type of an optimizer kernel's half-precision copy: `copy` (f16 or bf16) when
/// the client stores it, `main` (the kernel's own, unused) without a copy; an error naming
/// `path` for another dtype.
fn copy_storage_type<R: CubeRuntime>(
    client: &ComputeClient<R>,
    main: StorageType,
    copy: Option<DType>,
    path: &'static str,
) -> Result<StorageType, KernelError> {
    match copy {
        None => Ok(main),
        Some(half @ (DType::F16 | DType::BF16)) => storage_type(client, half),
        Some(dtype) => Err(KernelError::UnsupportedDType { dtype, path }),
    }
}

/// The widest vector size the client likes for elements of `elem_bytes` that divides every
/// length in `lengths` (all in elements); with no lengths, the widest it likes.
fn vector_size<R: CubeRuntime>(
    client: &ComputeClient<R>,
    elem_bytes: usize,
    lengths: &[usize],
) -> usize {
    client
        .io_optimized_vector_sizes(elem_bytes)
        .find(|&size| lengths.iter().all(|len| len % size == 0))
        .unwrap_or(1)
}

/// The narrowest address type that indexes every tensor in `tensors`.
fn address_type<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> AddressType {
    tensors
        .iter()
        .map(|t| t.required_address_type())
        .max()
        .unwrap_or_default()
}

/// Whether a kernel may write its output into `tensor`'s buffer: nothing else holds it, it is
/// laid out as the output is (contiguous), and it was made on the calling thread's stream.
///
/// cubecl orders a stream after another only for a buffer made on that other stream: a kernel
/// on this thread's stream waits for the writes the buffer's own stream queued, but the
/// buffer's stream never waits for this one. Written here, a buffer made on another thread
/// (the issuing thread's, say) could be read there, or its memory reused there, before this
/// thread's kernel has run. On wgpu's single queue that cannot show; on CUDA's stream per
/// thread it would. Such an input gets a new buffer instead.
fn writable_in_place<R: CubeRuntime>(tensor: &CubeTensor<R>) -> bool {
    tensor.can_mut() && tensor.is_contiguous() && tensor.handle.stream == StreamId::current()
}
