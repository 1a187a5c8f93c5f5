//! Pack kernels: one launch per member writes all of its `rows * len` bucket elements.

use burn::tensor::backend::Backend;
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use super::{
    KernelPacker, address_type, from_cube, into_cube_reading, same_type_ref, storage_type,
    vector_size,
};
use crate::KernelError;
use crate::spec::{BucketSpec, MemberSpec};

/// Copies a member's gradient into its columns of every row.
///
/// Unit `pos` (in vectors) is element `pos` of the zero-padded flat gradient: row
/// `pos / len`, column `offset + pos % len`. It casts to `O`, then divides in `O`.
#[cube(launch, address_type = "dynamic")]
fn pack_member<I: Float, O: Float, N: Size>(
    grad: &LinearView<Vector<I, N>>,
    bucket: &mut LinearView<Vector<O, N>, ReadWrite>,
    divisor: InputScalar,
    numel: usize,
    len: usize,
    row_len: usize,
    offset: usize,
    units: usize,
    #[comptime] divide: bool,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    if ABSOLUTE_POS >= units {
        terminate!();
    }
    let row = ABSOLUTE_POS / len;
    let column = ABSOLUTE_POS % len;
    let mut value = Vector::<O, N>::from_int(0);
    if ABSOLUTE_POS < numel {
        value = Vector::cast_from(grad[ABSOLUTE_POS]);
        if divide {
            value /= Vector::new(divisor.get::<O>());
        }
    }
    bucket[row * row_len + offset + column] = value;
}

/// Zero-fills a member's columns of every row (a member without a gradient).
#[cube(launch, address_type = "dynamic")]
fn zero_member<O: Float, N: Size>(
    bucket: &mut LinearView<Vector<O, N>, ReadWrite>,
    len: usize,
    row_len: usize,
    offset: usize,
    units: usize,
    #[define(O)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= units {
        terminate!();
    }
    let row = ABSOLUTE_POS / len;
    let column = ABSOLUTE_POS % len;
    bucket[row * row_len + offset + column] = Vector::from_int(0);
}

/// A bucket allocated once on a cubecl device, filled member by member.
pub(crate) struct CubePacker<R: CubeRuntime> {
    spec: BucketSpec,
    out: StorageType,
    bucket: CubeTensor<R>,
}

impl<R: CubeRuntime> CubePacker<R> {
    /// Allocates the bucket (uninitialised: the members will cover it). Fails when the
    /// device cannot compute in `spec.dtype`.
    pub(crate) fn new<B: Backend>(
        spec: &BucketSpec,
        device: &B::Device,
    ) -> Result<Self, KernelError> {
        let device: &R::Device =
            same_type_ref(device).expect("the kernel path is only taken when B's device is R's");
        let client = R::client(device);
        let out = storage_type(&client, spec.dtype)?;
        let bucket = empty_device_dtype(
            client,
            device.clone(),
            Shape::new([spec.numel()]),
            spec.dtype,
        );
        Ok(Self {
            spec: *spec,
            out,
            bucket,
        })
    }

    fn launch_zero(&self, member: &MemberSpec) {
        let client = &self.bucket.client;
        let spec = &self.spec;
        let elem = spec.dtype.size();
        let vector = vector_size(client, elem, &[member.len, member.offset, spec.row_len]);
        let units = spec.rows * member.len / vector;
        let cube_dim = CubeDim::new(client, units);
        zero_member::launch::<R>(
            client,
            calculate_cube_count_elemwise(client, units, cube_dim),
            cube_dim,
            address_type(&[&self.bucket]),
            vector,
            self.bucket.clone().into_linear_view(),
            member.len / vector,
            spec.row_len / vector,
            member.offset / vector,
            units,
            self.out,
        );
    }

    fn launch_pack(&self, member: &MemberSpec, grad: CubeTensor<R>) -> Result<(), KernelError> {
        let client = &self.bucket.client;
        let spec = &self.spec;
        let input = storage_type(client, grad.dtype)?;
        // A contiguous gradient is read as flat vectors; any other layout one element at a
        // time, through the view's strided indexing.
        let (grad, widths) = if grad.is_contiguous() {
            let flat = CubeTensor::new_contiguous(
                grad.client.clone(),
                grad.device.clone(),
                Shape::new([member.numel]),
                grad.handle.clone(),
                grad.dtype,
            );
            (
                flat,
                vec![member.numel, member.len, member.offset, spec.row_len],
            )
        } else {
            (grad, vec![1])
        };
        let elem = grad.dtype.size().max(spec.dtype.size());
        let vector = vector_size(client, elem, &widths);
        let units = spec.rows * member.len / vector;
        let cube_dim = CubeDim::new(client, units);
        let address = address_type(&[&grad, &self.bucket]);
        pack_member::launch::<R>(
            client,
            calculate_cube_count_elemwise(client, units, cube_dim),
            cube_dim,
            address,
            vector,
            grad.into_linear_view(),
            self.bucket.clone().into_linear_view(),
            InputScalar::new(spec.predivide, spec.dtype),
            member.numel / vector,
            member.len / vector,
            spec.row_len / vector,
            member.offset / vector,
            units,
            spec.predivide != 1.0,
            [input, self.out],
        );
        Ok(())
    }
}

impl<B: Backend, R: CubeRuntime> KernelPacker<B> for CubePacker<R> {
    fn push(
        &mut self,
        member: &MemberSpec,
        grad: Option<B::FloatTensorPrimitive>,
    ) -> Result<(), KernelError> {
        if self.spec.rows * member.len == 0 {
            return Ok(());
        }
        match grad {
            None => {
                self.launch_zero(member);
                Ok(())
            }
            Some(grad) => {
                // A dtype the kernel cannot read is cast by Burn first: cast-then-divide, as
                // the fallback does.
                let grad = if storage_type(&self.bucket.client, grad.dtype()).is_err() {
                    B::float_cast(grad, self.spec.dtype.into())
                } else {
                    grad
                };
                self.launch_pack(member, into_cube_reading::<B, R>(grad))
            }
        }
    }

    fn finish(self: Box<Self>) -> B::FloatTensorPrimitive {
        from_cube::<B, R>(self.bucket)
    }
}
