//! `Packer`: assembles a bucket member by member, on the kernel, host or fallback path.

use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;

use crate::KernelError;
use crate::fallback::FallbackPacker;
use crate::host::{BufferPool, HostBackend, HostPacker};
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
    Host(HostPacker),
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    Kernel(Box<dyn crate::kernel::KernelPacker<B>>),
}

impl<B: Backend> Packer<B> {
    /// Starts a bucket on `device`. The kernel and host paths allocate the whole bucket here.
    pub fn new(spec: BucketSpec, device: &B::Device, path: PackPath) -> Result<Self, KernelError> {
        Self::start(spec, device, path, None)
    }

    /// Starts a bucket like [`Packer::new`], in memory from `pool` where the path can reuse
    /// it: the host path takes the buffer of an earlier bucket of the same size that nothing
    /// holds any more, and gives this one back to `pool` when finished. Keep one pool per
    /// bucket of a static layout and every step after the first packs into the same memory.
    pub fn with_pool(
        spec: BucketSpec,
        device: &B::Device,
        path: PackPath,
        pool: &BufferPool,
    ) -> Result<Self, KernelError> {
        Self::start(spec, device, path, Some(pool))
    }

    fn start(
        spec: BucketSpec,
        device: &B::Device,
        path: PackPath,
        pool: Option<&BufferPool>,
    ) -> Result<Self, KernelError> {
        spec.validate()?;
        let kernel = match path {
            PackPath::Fallback | PackPath::Host => None,
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
            (_, PackPath::Auto | PackPath::Host) => {
                match host_packer::<B>(&spec, device, path, pool)? {
                    Some(host) => Inner::Host(host),
                    None => Inner::Fallback(FallbackPacker::new(spec, device)),
                }
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
        self.path() == PackPath::Kernel
    }

    /// The path packing this bucket: `Kernel`, `Host` or `Fallback`.
    pub fn path(&self) -> PackPath {
        match self.inner {
            Inner::Fallback(_) => PackPath::Fallback,
            Inner::Host(_) => PackPath::Host,
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            Inner::Kernel(_) => PackPath::Kernel,
        }
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
                Inner::Host(packer) => packer.push::<B>(member, grad)?,
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
            Inner::Host(packer) => packer.finish().into_primitive::<B>(),
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            Inner::Kernel(packer) => packer.finish(),
        })
    }
}

/// The host packer: `None` to use the fallback (`Auto` on a backend without host memory or
/// for a dtype it does not store), an error for `PackPath::Host` in those cases.
fn host_packer<B: Backend>(
    spec: &BucketSpec,
    device: &B::Device,
    path: PackPath,
    pool: Option<&BufferPool>,
) -> Result<Option<HostPacker>, KernelError> {
    let backend = match HostBackend::of::<B>() {
        Some(backend) => backend,
        None if path == PackPath::Host => {
            return Err(KernelError::HostUnavailable {
                backend: B::name(device),
            });
        }
        None => return Ok(None),
    };
    match HostPacker::new(spec, backend, pool) {
        Ok(packer) => Ok(Some(packer)),
        Err(error) if path == PackPath::Host => Err(error),
        Err(_) => Ok(None),
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
