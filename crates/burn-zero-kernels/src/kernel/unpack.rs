//! Unpack kernel: one launch reads the columns of a batch of members out of a reduced row, each
//! into a tensor of its own ([`Batches`] says why batches).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use crate::KernelError;
use crate::spec::{RowPart, is_slice};

use super::batch::{Batches, UnitRanges};
use super::{address_type, from_cube, into_cube, storage_type, vector_size};

/// `output[k] = cast(reduced[offset + k] / divisor)` for a batch of members, each into an output
/// of its own: divides in `I`, then casts to `O`. Unit `pos` (in vectors) belongs to member `i`
/// when `starts[i] <= pos < ends[i]`, and is element `pos - starts[i]` of its output.
#[cube(launch_unchecked, address_type = "dynamic")]
fn unpack_members<I: Float, O: Float, N: Size>(
    reduced: &LinearView<Vector<I, N>>,
    outputs: &mut Sequence<LinearView<Vector<O, N>, ReadWrite>>,
    divisor: InputScalar,
    starts: Sequence<usize>,
    ends: Sequence<usize>,
    offsets: Sequence<usize>,
    units: usize,
    #[comptime] divide: bool,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    if ABSOLUTE_POS >= units {
        terminate!();
    }
    let count = comptime![outputs.len()];
    #[unroll]
    for i in 0..count {
        let start = starts[i];
        if ABSOLUTE_POS >= start && ABSOLUTE_POS < ends[i] {
            let local = ABSOLUTE_POS - start;
            let offset = offsets[i];
            let mut value = reduced[offset + local];
            if divide {
                value /= Vector::new(divisor.get::<I>());
            }
            let output = outputs.index_mut(i);
            output[local] = Vector::cast_from(value);
        }
    }
}

/// Unpacks on runtime `R`; fails when it cannot handle one of the dtypes.
pub(super) fn unpack<B: Backend, R: CubeRuntime>(
    reduced: &B::FloatTensorPrimitive,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
) -> Result<B::FloatTensorPrimitive, KernelError> {
    let part = RowPart { offset, len, dtype };
    match unpack_parts::<B, R>(reduced, &[part], postdivide)?
        .pop()
        .flatten()
    {
        Some(unpacked) => Ok(unpacked),
        // Neither a divisor nor a cast: the row's slice.
        None => Ok(crate::fallback::unpack::<B>(
            reduced, offset, len, postdivide, dtype,
        )),
    }
}

/// What the parts of one unpack launch share: the outputs' dtype and the vector width.
type Key = (StorageType, usize);

/// A part waiting for its launch: its index in the row's parts, where it lies, and its output.
type Waiting<R> = (usize, RowPart, CubeTensor<R>);

/// Every part of `reduced` that needs arithmetic (a divisor or a cast), on runtime `R`, in
/// batched launches; `None` in the place of a part that needs none (the caller slices it).
/// Fails when the device cannot handle one of the dtypes.
pub(super) fn unpack_parts<B: Backend, R: CubeRuntime>(
    reduced: &B::FloatTensorPrimitive,
    parts: &[RowPart],
    postdivide: f64,
) -> Result<Vec<Option<B::FloatTensorPrimitive>>, KernelError> {
    let reduced: CubeTensor<R> = into_cube::<B, R>(reduced.clone());
    let client = &reduced.client;
    let input = storage_type(client, reduced.dtype)?;
    // The reduced row and the scalars take a binding each.
    let mut batches: Batches<Key, Waiting<R>> = Batches::new(client, 2);
    let row_len = reduced.meta.shape()[0];
    let mut unpacked: Vec<Option<CubeTensor<R>>> = parts.iter().map(|_| None).collect();
    for (index, part) in parts.iter().enumerate() {
        if is_slice(part.len, postdivide, reduced.dtype, part.dtype) {
            continue;
        }
        let out = storage_type(client, part.dtype)?;
        let widths: &[usize] = if reduced.is_contiguous() {
            &[part.offset, part.len, row_len]
        } else {
            &[1]
        };
        let vector = vector_size(client, reduced.dtype.size().max(part.dtype.size()), widths);
        let output = empty_device_dtype(
            client.clone(),
            reduced.device.clone(),
            Shape::new([part.len]),
            part.dtype,
        );
        if let Some((key, full)) = batches.push((out, vector), (index, *part, output)) {
            launch(&reduced, input, postdivide, key, full, &mut unpacked);
        }
    }
    for (key, waiting) in batches.take() {
        launch(&reduced, input, postdivide, key, waiting, &mut unpacked);
    }
    Ok(unpacked
        .into_iter()
        .map(|output| output.map(from_cube::<B, R>))
        .collect())
}

/// Unpacks `parts` in one [`unpack_members`] launch, `vector` elements a unit, and puts each
/// output in its part's place of `unpacked`.
fn launch<R: CubeRuntime>(
    reduced: &CubeTensor<R>,
    input: StorageType,
    postdivide: f64,
    (out, vector): Key,
    parts: Vec<Waiting<R>>,
    unpacked: &mut [Option<CubeTensor<R>>],
) {
    let client = &reduced.client;
    let mut tensors: Vec<&CubeTensor<R>> = parts.iter().map(|(.., output)| output).collect();
    tensors.push(reduced);
    let address = address_type(&tensors);
    let divisor = InputScalar::new(postdivide, reduced.dtype);
    let UnitRanges {
        starts,
        ends,
        offsets,
        units,
    } = UnitRanges::<R>::new(parts.iter().map(|(_, p, _)| (p.offset, p.len)), vector);
    let mut outputs = SequenceArg::new();
    for (.., output) in &parts {
        outputs.push(output.clone().into_linear_view());
    }
    let cube_dim = CubeDim::new(client, units);
    // SAFETY: every unit below `units` falls in one part's range; it reads inside the part's
    // columns of the reduced row and writes below the part's length, both checked before the
    // launch.
    unsafe {
        unpack_members::launch_unchecked::<R>(
            client,
            calculate_cube_count_elemwise(client, units, cube_dim),
            cube_dim,
            address,
            vector,
            reduced.clone().into_linear_view(),
            outputs,
            divisor,
            starts,
            ends,
            offsets,
            units,
            postdivide != 1.0,
            [input, out],
        )
    };
    for (index, _, output) in parts {
        unpacked[index] = Some(output);
    }
}
