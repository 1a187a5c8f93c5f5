//! Unpack kernel: one launch reads a member's columns of a reduced row.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use crate::KernelError;

use super::{address_type, from_cube, into_cube, storage_type, vector_size};

/// `output[i] = cast(reduced[offset + i] / divisor)`: divides in `I`, then casts to `O`.
#[cube(launch, address_type = "dynamic")]
fn unpack_member<I: Float, O: Float, N: Size>(
    reduced: &LinearView<Vector<I, N>>,
    output: &mut LinearView<Vector<O, N>, ReadWrite>,
    divisor: InputScalar,
    offset: usize,
    #[comptime] divide: bool,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    if !output.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let mut value = reduced[offset + ABSOLUTE_POS];
    if divide {
        value /= Vector::new(divisor.get::<I>());
    }
    output[ABSOLUTE_POS] = Vector::cast_from(value);
}

/// Unpacks on runtime `R`; fails when it cannot handle one of the dtypes.
pub(super) fn unpack<B: Backend, R: CubeRuntime>(
    reduced: &B::FloatTensorPrimitive,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
) -> Result<B::FloatTensorPrimitive, KernelError> {
    let reduced: CubeTensor<R> = into_cube::<B, R>(reduced.clone());
    let reduced = &reduced;
    let client = &reduced.client;
    let input = storage_type(client, reduced.dtype)?;
    let out = storage_type(client, dtype)?;
    let output = empty_device_dtype(
        client.clone(),
        reduced.device.clone(),
        Shape::new([len]),
        dtype,
    );
    let widths: &[usize] = if reduced.is_contiguous() {
        &[offset, len, reduced.meta.shape()[0]]
    } else {
        &[1]
    };
    let vector = vector_size(client, reduced.dtype.size().max(dtype.size()), widths);
    let units = len / vector;
    let cube_dim = CubeDim::new(client, units);
    unpack_member::launch::<R>(
        client,
        calculate_cube_count_elemwise(client, units, cube_dim),
        cube_dim,
        address_type(&[reduced, &output]),
        vector,
        reduced.clone().into_linear_view(),
        output.clone().into_linear_view(),
        InputScalar::new(postdivide, reduced.dtype),
        offset / vector,
        postdivide != 1.0,
        [input, out],
    );
    Ok(from_cube::<B, R>(output))
}
