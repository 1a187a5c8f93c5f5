//! `unpack`: one member's part of a reduced row, divided and cast back.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, TensorMetadata};

use crate::host::{self, HostBackend, HostTensor};
use crate::spec::{PackPath, RowPart, check_divisor, check_range, is_float, is_slice};
use crate::{BufferPool, KernelError};

/// From `reduced` (1-D, one row), elements `[offset, offset + len)` divided by `postdivide`
/// (no division when it is 1) in the reduced dtype, then cast to `dtype`: 1-D, `len` elements.
///
/// When there is nothing to divide or cast, every path returns a slice of `reduced` without a
/// launch or a copy.
pub fn unpack<B: Backend>(
    reduced: &B::FloatTensorPrimitive,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
    path: PackPath,
) -> Result<B::FloatTensorPrimitive, KernelError> {
    let shape = reduced.shape();
    if shape.num_dims() != 1 {
        return Err(KernelError::NotFlat {
            rank: shape.num_dims(),
        });
    }
    check_range(offset, len, shape[0])?;
    check_divisor(postdivide)?;
    for dtype in [reduced.dtype(), dtype] {
        if !is_float(dtype) {
            return Err(KernelError::UnsupportedDType { dtype, path: "any" });
        }
    }
    if matches!(path, PackPath::Auto | PackPath::Host) {
        match host_unpack::<B>(reduced, offset, len, postdivide, dtype) {
            Ok(part) => return Ok(part),
            Err(error) if path == PackPath::Host => return Err(error),
            Err(_) => {}
        }
    }
    let kernel = match path {
        PackPath::Fallback | PackPath::Host => None,
        PackPath::Auto | PackPath::Kernel => {
            let trivial = is_slice(len, postdivide, reduced.dtype(), dtype);
            match kernel_unpack::<B>(reduced, offset, len, postdivide, dtype, trivial) {
                Some(Ok(part)) => return Ok(part),
                kernel => kernel,
            }
        }
    };
    match (kernel, path) {
        (Some(Err(error)), PackPath::Kernel) => Err(error),
        (None, PackPath::Kernel) => Err(KernelError::KernelUnavailable {
            backend: B::name(&B::float_device(reduced)),
        }),
        _ => Ok(crate::fallback::unpack::<B>(
            reduced, offset, len, postdivide, dtype,
        )),
    }
}

/// Every part of `reduced`, as [`unpack`] returns each of them, with the same values bit for
/// bit.
///
/// On the host path, when no part changes dtype, the row is divided once (in place when
/// nothing else holds it, else into a buffer of `pool` when one is given) and the parts are
/// slices of it: one pass and at most one allocation per row instead of one of each per part.
/// The parts then share the row's buffer until the last of them is dropped. On the kernel
/// path, the parts that need a divisor or a cast are unpacked by batched launches (up to 16
/// parts of one dtype and vector width each), each into a tensor of its own, and the others
/// are slices of the row. Elsewhere each part is unpacked on its own.
pub fn unpack_row<B: Backend>(
    reduced: B::FloatTensorPrimitive,
    parts: &[RowPart],
    postdivide: f64,
    path: PackPath,
    pool: Option<&BufferPool>,
) -> Result<Vec<B::FloatTensorPrimitive>, KernelError> {
    let shape = reduced.shape();
    if shape.num_dims() != 1 {
        return Err(KernelError::NotFlat {
            rank: shape.num_dims(),
        });
    }
    for part in parts {
        check_range(part.offset, part.len, shape[0])?;
    }
    check_divisor(postdivide)?;
    let same_dtype = parts.iter().all(|part| part.dtype == reduced.dtype());
    let host_row = HostBackend::of::<B>().is_some_and(|backend| backend.supports(reduced.dtype()));
    let reduced = if host_row
        && same_dtype
        && postdivide != 1.0
        && matches!(path, PackPath::Auto | PackPath::Host)
    {
        match HostTensor::from_primitive::<B>(reduced) {
            Ok(row) => {
                let divided = host::divide_row(row, postdivide, pool).into_primitive::<B>();
                // Nothing left to divide or cast: each part is a slice of the divided row.
                return parts
                    .iter()
                    .map(|part| unpack::<B>(&divided, part.offset, part.len, 1.0, part.dtype, path))
                    .collect();
            }
            Err(reduced) => reduced,
        }
    } else {
        reduced
    };
    // On a kernel backend the parts that need arithmetic come from batched launches.
    let batched = match path {
        PackPath::Auto | PackPath::Kernel => {
            match kernel_unpack_parts::<B>(&reduced, parts, postdivide) {
                Some(Ok(unpacked)) => unpacked,
                Some(Err(error)) if path == PackPath::Kernel => return Err(error),
                _ => Vec::new(),
            }
        }
        PackPath::Fallback | PackPath::Host => Vec::new(),
    };
    let mut batched = batched.into_iter();
    parts
        .iter()
        .map(|part| match batched.next().flatten() {
            Some(unpacked) => Ok(unpacked),
            // Not batched: as `unpack` answers it (a part without arithmetic is the row's
            // slice).
            None => unpack::<B>(
                &reduced,
                part.offset,
                part.len,
                postdivide,
                part.dtype,
                path,
            ),
        })
        .collect()
}

/// The host result: an error when `B` keeps no host memory or has no host type for one of
/// the dtypes. A trivial unpack is the fallback's slice, which shares the reduced row's buffer.
fn host_unpack<B: Backend>(
    reduced: &B::FloatTensorPrimitive,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
) -> Result<B::FloatTensorPrimitive, KernelError> {
    let backend = HostBackend::of::<B>().ok_or_else(|| KernelError::HostUnavailable {
        backend: B::name(&B::float_device(reduced)),
    })?;
    if let Some(dtype) = [reduced.dtype(), dtype]
        .into_iter()
        .find(|&dtype| !backend.supports(dtype))
    {
        return Err(KernelError::UnsupportedDType {
            dtype,
            path: "host",
        });
    }
    if is_slice(len, postdivide, reduced.dtype(), dtype) {
        return Ok(crate::fallback::unpack::<B>(
            reduced, offset, len, postdivide, dtype,
        ));
    }
    let row = HostTensor::from_primitive::<B>(reduced.clone()).map_err(|_| {
        KernelError::HostUnavailable {
            backend: B::name(&B::float_device(reduced)),
        }
    })?;
    Ok(host::unpack(&row, offset, len, postdivide, dtype).into_primitive::<B>())
}

/// The kernel result: `None` when `B` has no kernels in this build. A `trivial` unpack (a plain
/// slice) is answered with the fallback's slice, without a launch.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_unpack<B: Backend>(
    reduced: &B::FloatTensorPrimitive,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
    trivial: bool,
) -> Option<Result<B::FloatTensorPrimitive, KernelError>> {
    if trivial && crate::kernel_available::<B>() {
        return Some(Ok(crate::fallback::unpack::<B>(
            reduced, offset, len, postdivide, dtype,
        )));
    }
    crate::kernel::unpack::<B>(reduced, offset, len, postdivide, dtype)
}

/// The kernel results of [`unpack_row`]'s parts that need arithmetic: `None` when `B` has no
/// kernels in this build.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_unpack_parts<B: Backend>(
    reduced: &B::FloatTensorPrimitive,
    parts: &[RowPart],
    postdivide: f64,
) -> Option<Result<Vec<Option<B::FloatTensorPrimitive>>, KernelError>> {
    crate::kernel::unpack_parts::<B>(reduced, parts, postdivide)
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn kernel_unpack_parts<B: Backend>(
    _reduced: &B::FloatTensorPrimitive,
    _parts: &[RowPart],
    _postdivide: f64,
) -> Option<Result<Vec<Option<B::FloatTensorPrimitive>>, KernelError>> {
    None
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn kernel_unpack<B: Backend>(
    _reduced: &B::FloatTensorPrimitive,
    _offset: usize,
    _len: usize,
    _postdivide: f64,
    _dtype: DType,
    _trivial: bool,
) -> Option<Result<B::FloatTensorPrimitive, KernelError>> {
    None
}
