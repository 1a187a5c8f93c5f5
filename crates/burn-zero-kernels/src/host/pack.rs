//! Pack and unpack on host memory: one pass per member over contiguous slices.
//!
//! Same arithmetic as the Burn-ops path, in the same order: cast to the reduce dtype (none
//! when the dtypes are equal), then divide in that dtype; padding is positive zero.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, TensorMetadata};

use super::{BufferPool, FloatVisitor, HostBackend, HostFloat, HostTensor, visit};
use crate::KernelError;
use crate::spec::{BucketSpec, MemberSpec};

/// A bucket written in place in a host buffer, taken from a [`BufferPool`] when one is given.
pub(crate) struct HostPacker {
    spec: BucketSpec,
    bucket: HostTensor,
    pool: Option<BufferPool>,
}

/// The error for a dtype the backend has no host tensors of.
fn unsupported(dtype: DType) -> KernelError {
    KernelError::UnsupportedDType {
        dtype,
        path: "host",
    }
}

impl HostPacker {
    /// Takes the bucket's buffer from `pool` (or allocates it). Fails when `backend` has no
    /// tensors of the reduce dtype.
    pub(crate) fn new(
        spec: &BucketSpec,
        backend: HostBackend,
        pool: Option<&BufferPool>,
    ) -> Result<Self, KernelError> {
        if !backend.supports(spec.dtype) {
            return Err(unsupported(spec.dtype));
        }
        struct Take<'a> {
            backend: HostBackend,
            numel: usize,
            pool: Option<&'a BufferPool>,
        }
        impl FloatVisitor for Take<'_> {
            type Output = HostTensor;
            fn visit<E: HostFloat>(self) -> HostTensor {
                match self.pool {
                    Some(pool) => pool.take::<E>(self.backend, self.numel),
                    None => HostTensor::zeros::<E>(self.backend, self.numel),
                }
            }
        }
        let bucket = visit(
            spec.dtype,
            Take {
                backend,
                numel: spec.numel(),
                pool,
            },
        )
        .ok_or_else(|| unsupported(spec.dtype))?;
        Ok(Self {
            spec: *spec,
            bucket,
            pool: pool.map(BufferPool::share),
        })
    }

    /// Writes `member`'s block; sizes have been checked by the caller. `grad` is `B`'s float
    /// tensor; one of a dtype the host path cannot read is cast by Burn first (cast, then
    /// divide, as the Burn-ops path does).
    pub(crate) fn push<B: Backend>(
        &mut self,
        member: &MemberSpec,
        grad: Option<B::FloatTensorPrimitive>,
    ) -> Result<(), KernelError> {
        let grad = match grad {
            None => None,
            Some(grad) => {
                let grad = if self.bucket.backend().supports(grad.dtype()) {
                    grad
                } else {
                    B::float_cast(grad, self.spec.dtype.into())
                };
                let grad = HostTensor::from_primitive::<B>(grad)
                    .map_err(|_| unsupported(self.spec.dtype))?;
                Some(grad.into_contiguous())
            }
        };
        let write = WriteMember {
            spec: &self.spec,
            member,
            grad: grad.as_ref(),
            bucket: &mut self.bucket,
        };
        visit(self.spec.dtype, write).ok_or_else(|| unsupported(self.spec.dtype))
    }

    /// The packed bucket; the pool it came from keeps a handle on it for the next step.
    pub(crate) fn finish(self) -> HostTensor {
        if let Some(pool) = &self.pool {
            pool.keep(&self.bucket);
        }
        self.bucket
    }
}

/// Writes one member into the bucket, for the bucket's element type `O`.
struct WriteMember<'a> {
    spec: &'a BucketSpec,
    member: &'a MemberSpec,
    grad: Option<&'a HostTensor>,
    bucket: &'a mut HostTensor,
}

impl FloatVisitor for WriteMember<'_> {
    type Output = ();

    fn visit<O: HostFloat>(self) {
        let Self {
            spec,
            member,
            grad,
            bucket,
        } = self;
        let dst = bucket
            .as_mut_slice::<O>()
            .expect("the packer holds the only handle on its contiguous bucket");
        match grad {
            None => {
                for row in 0..spec.rows {
                    let start = row * spec.row_len + member.offset;
                    dst[start..start + member.len].fill(O::ZERO);
                }
            }
            Some(grad) => {
                let copy = CopyMember::<O> {
                    spec,
                    member,
                    grad,
                    dst,
                };
                visit(grad.dtype(), copy).expect("the gradient's dtype was checked");
            }
        }
    }
}

/// Copies a gradient of element type `I` into its columns of a bucket of `O`s.
struct CopyMember<'a, O> {
    spec: &'a BucketSpec,
    member: &'a MemberSpec,
    grad: &'a HostTensor,
    dst: &'a mut [O],
}

impl<O: HostFloat> FloatVisitor for CopyMember<'_, O> {
    type Output = ();

    fn visit<I: HostFloat>(self) {
        let Self {
            spec,
            member,
            grad,
            dst,
        } = self;
        let src = grad
            .as_slice::<I>()
            .expect("the gradient was made contiguous");
        let divisor = (spec.predivide != 1.0).then(|| O::divisor(spec.predivide));
        for row in 0..spec.rows {
            let start = row * spec.row_len + member.offset;
            let out = &mut dst[start..start + member.len];
            // Rows past the gradient's end are all padding.
            let first = (row * member.len).min(src.len());
            let take = (src.len() - first).min(member.len);
            let (values, padding) = out.split_at_mut(take);
            convert(&src[first..first + take], values, divisor);
            padding.fill(O::ZERO);
        }
    }
}

/// `out[i] = cast(src[i])`, divided by `divisor` when there is one: one pass, no temporary.
#[inline]
fn convert<I: HostFloat, O: HostFloat>(src: &[I], out: &mut [O], divisor: Option<O::Divisor>) {
    if I::DTYPE == O::DTYPE {
        // Same type: no cast, as the Burn-ops path skips it (a cast through f64 could change
        // NaN payloads).
        let src: &[O] = bytemuck::cast_slice(src);
        match divisor {
            None => out.copy_from_slice(src),
            Some(divisor) => {
                for (out, &value) in out.iter_mut().zip(src) {
                    *out = value.div(divisor);
                }
            }
        }
    } else {
        match divisor {
            None => {
                for (out, &value) in out.iter_mut().zip(src) {
                    *out = O::cast_from(value);
                }
            }
            Some(divisor) => {
                for (out, &value) in out.iter_mut().zip(src) {
                    *out = O::cast_from(value).div(divisor);
                }
            }
        }
    }
}

/// `reduced[offset..offset + len] / postdivide` (no division when it is 1) cast to `dtype`, in
/// a new buffer (it becomes a gradient the caller keeps); arguments have been checked, and the
/// backend stores both dtypes.
pub(crate) fn unpack(
    reduced: &HostTensor,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
) -> HostTensor {
    let reduced = reduced.clone().into_contiguous();
    let read = ReadRow {
        reduced: &reduced,
        range: offset..offset + len,
        postdivide,
        dtype,
    };
    visit(reduced.dtype(), read)
        .and_then(|part| part)
        .expect("the caller checked that the backend stores both dtypes")
}

/// Reads a reduced row of element type `R`.
struct ReadRow<'a> {
    reduced: &'a HostTensor,
    range: std::ops::Range<usize>,
    postdivide: f64,
    dtype: DType,
}

impl FloatVisitor for ReadRow<'_> {
    type Output = Option<HostTensor>;

    fn visit<R: HostFloat>(self) -> Option<HostTensor> {
        let row = self.reduced.as_slice::<R>()?;
        let write = WritePart {
            backend: self.reduced.backend(),
            part: &row[self.range],
            divisor: (self.postdivide != 1.0).then(|| R::divisor(self.postdivide)),
        };
        visit(self.dtype, write)
    }
}

/// Divides a part of a row of `R`s and casts it to the element type `D`.
struct WritePart<'a, R: HostFloat> {
    backend: HostBackend,
    part: &'a [R],
    divisor: Option<R::Divisor>,
}

impl<R: HostFloat> FloatVisitor for WritePart<'_, R> {
    type Output = HostTensor;

    fn visit<D: HostFloat>(self) -> HostTensor {
        let values: Vec<D> = match self.divisor {
            None => self.part.iter().map(|&v| D::cast_from(v)).collect(),
            Some(divisor) => self
                .part
                .iter()
                .map(|&v| D::cast_from(v.div(divisor)))
                .collect(),
        };
        HostTensor::from_vec(self.backend, values)
    }
}

/// `row` divided by `divisor` element by element in its own dtype, as [`unpack`] divides each
/// part of it: in place when `row` alone holds its buffer, else into one buffer for the whole
/// row, taken from `pool` when one is given. The members' parts are then slices of the result,
/// so a bucket costs at most one buffer instead of one per member (each a fresh, page-faulting
/// allocation once glibc's allocator has trimmed its heap), and none from a warm pool.
pub(crate) fn divide_row(row: HostTensor, divisor: f64, pool: Option<&BufferPool>) -> HostTensor {
    struct Divide<'a> {
        row: HostTensor,
        divisor: f64,
        pool: Option<&'a BufferPool>,
    }
    impl FloatVisitor for Divide<'_> {
        type Output = Option<HostTensor>;
        fn visit<R: HostFloat>(mut self) -> Option<HostTensor> {
            let divisor = R::divisor(self.divisor);
            if let Some(values) = self.row.as_mut_slice::<R>() {
                for value in values.iter_mut() {
                    *value = value.div(divisor);
                }
                return Some(self.row);
            }
            let values = self.row.as_slice::<R>()?;
            let backend = self.row.backend();
            let Some(pool) = self.pool else {
                let divided = values.iter().map(|&v| v.div(divisor)).collect();
                return Some(HostTensor::from_vec(backend, divided));
            };
            let mut out = pool.take::<R>(backend, values.len());
            let dst = out.as_mut_slice::<R>()?;
            for (dst, &v) in dst.iter_mut().zip(values) {
                *dst = v.div(divisor);
            }
            pool.keep(&out);
            Some(out)
        }
    }
    let row = row.into_contiguous();
    visit(row.dtype(), Divide { row, divisor, pool })
        .and_then(|divided| divided)
        .expect("the caller checked that the backend stores the row's dtype")
}
