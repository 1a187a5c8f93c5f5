//! `Packer`: assembles a bucket member by member, on the kernel or the fallback path.

use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;

use crate::KernelError;
use crate::fallback::FallbackPacker;
use crate::spec::{BucketSpec, MemberSpec, PackPath, is_float};

/// Packs the members of one bucket, in offset order, into a 1-D tensor of
/// `rows * row_len` elements of the reduce dtype.
pub struct Packer<B: Backend> {
    spec: BucketSpec,
    device: B::Device,
    inner: Inner<B>,
    /// End of the members pushed so far, within a row.
    cursor: usize,
}

enum Inner<B: Backend> {
    Fallback(FallbackPacker<B>),
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    Kernel(Box<dyn crate::kernel::KernelPacker<B>>),
}

impl<B: Backend> Packer<B> {
    /// Starts a bucket on `device`. The kernel path allocates the whole bucket here.
    pub fn new(spec: BucketSpec, device: &B::Device, path: PackPath) -> Result<Self, KernelError> {
        spec.validate()?;
        let kernel = match path {
            PackPath::Fallback => None,
            PackPath::Auto | PackPath::Kernel => kernel_packer::<B>(&spec, device),
        };
        let inner = match (kernel, path) {
            (Some(Ok(kernel)), _) => kernel,
            (Some(Err(error)), PackPath::Kernel) => return Err(error),
            (None, PackPath::Kernel) => {
                return Err(KernelError::KernelUnavailable {
                    backend: B::name(device),
                });
            }
            _ => Inner::Fallback(FallbackPacker::new(spec, device)),
        };
        Ok(Self {
            spec,
            device: device.clone(),
            inner,
            cursor: 0,
        })
    }

    /// The bucket's layout.
    pub fn spec(&self) -> &BucketSpec {
        &self.spec
    }

    /// Whether this bucket is packed by kernels.
    pub fn uses_kernel(&self) -> bool {
        !matches!(self.inner, Inner::Fallback(_))
    }

    /// Writes the next member: `cast(grad) / predivide` (no division when `predivide` is 1),
    /// zero-padded to `rows * len`. `grad` may have any shape with `member.numel` elements and
    /// any float dtype; `None` writes zeros.
    pub fn push(
        &mut self,
        member: &MemberSpec,
        grad: Option<B::FloatTensorPrimitive>,
    ) -> Result<(), KernelError> {
        self.spec.check_member(member, self.cursor)?;
        if let Some(grad) = &grad {
            let actual = grad.shape().num_elements();
            if actual != member.numel {
                return Err(KernelError::GradientSize {
                    expected: member.numel,
                    actual,
                });
            }
            if !is_float(grad.dtype()) {
                return Err(KernelError::UnsupportedDType {
                    dtype: grad.dtype(),
                    path: "any",
                });
            }
            let device = B::float_device(grad);
            if device != self.device {
                return Err(KernelError::DeviceMismatch {
                    expected: format!("{:?}", self.device),
                    actual: format!("{device:?}"),
                });
            }
        }
        // An empty gradient is all padding.
        let grad = grad.filter(|_| member.numel > 0);
        if member.len > 0 {
            match &mut self.inner {
                Inner::Fallback(packer) => packer.push(member, grad),
                #[cfg(any(feature = "wgpu", feature = "cuda"))]
                Inner::Kernel(packer) => packer.push(member, grad)?,
            }
        }
        self.cursor = member.offset + member.len;
        Ok(())
    }

    /// The packed bucket: 1-D, `rows * row_len` elements of `spec.dtype`. Fails unless the
    /// members cover every row.
    pub fn finish(self) -> Result<B::FloatTensorPrimitive, KernelError> {
        if self.cursor != self.spec.row_len {
            return Err(KernelError::Incomplete {
                covered: self.cursor,
                row_len: self.spec.row_len,
            });
        }
        Ok(match self.inner {
            Inner::Fallback(packer) => packer.finish(),
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            Inner::Kernel(packer) => packer.finish(),
        })
    }
}

/// The kernel packer: `None` when `B` has no kernels in this build.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_packer<B: Backend>(
    spec: &BucketSpec,
    device: &B::Device,
) -> Option<Result<Inner<B>, KernelError>> {
    crate::kernel::packer::<B>(spec, device).map(|packer| packer.map(Inner::Kernel))
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn kernel_packer<B: Backend>(
    _spec: &BucketSpec,
    _device: &B::Device,
) -> Option<Result<Inner<B>, KernelError>> {
    None
}
