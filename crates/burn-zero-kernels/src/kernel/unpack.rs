//! Unpack kernels: one launch reads the columns of a batch of members out of a reduced row, each
//! into a tensor of its own ([`Batches`] says why batches); a member shifted against the vector
//! grid takes the shifted kernel (`shifted.rs`).

use burn::tensor::DType;
use burn::tensor::backend::Backend;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use crate::KernelError;
use crate::spec::{RowPart, is_slice};

use super::batch::{Batches, UnitRanges};
use super::shifted::{Grid, moves_shifted, rounded_up, trimmed};
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

/// [`unpack_members`] for members at any offset and of any length: unit `pos` reads the `N`
/// elements `(pos - starts[i]) * N + k` of member `i` (those below `lens[i]`) one by one from
/// `offsets[i]` (in elements) on, and writes them as one vector of its output, which holds
/// whole vectors (`shifted.rs`). Each element is divided and cast as [`unpack_members`] does.
#[cube(launch_unchecked, address_type = "dynamic")]
fn unpack_shifted<I: Float, O: Float, N: Size>(
    reduced: &LinearView<I>,
    outputs: &mut Sequence<LinearView<Vector<O, N>, ReadWrite>>,
    divisor: InputScalar,
    starts: Sequence<usize>,
    ends: Sequence<usize>,
    offsets: Sequence<usize>,
    lens: Sequence<usize>,
    units: usize,
    #[comptime] divide: bool,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    if ABSOLUTE_POS >= units {
        terminate!();
    }
    let count = comptime![outputs.len()];
    let width = N::value();
    #[unroll]
    for i in 0..count {
        let start = starts[i];
        if ABSOLUTE_POS >= start && ABSOLUTE_POS < ends[i] {
            let local = ABSOLUTE_POS - start;
            let first = local * width;
            let offset = offsets[i];
            let len = lens[i];
            let mut value = Vector::<O, N>::empty();
            #[unroll]
            for k in 0..width {
                let mut lane = I::from_int(0);
                if first + k < len {
                    lane = reduced[offset + first + k];
                    if divide {
                        lane /= divisor.get::<I>();
                    }
                }
                value[k] = O::cast_from(lane);
            }
            let output = outputs.index_mut(i);
            output[local] = value;
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

/// What the parts of one unpack launch share: the outputs' dtype, the vector width and how
/// they meet the vector grid.
type Key = (StorageType, usize, Grid);

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
        let elem = reduced.dtype.size().max(part.dtype.size());
        let aligned = vector_size(client, elem, widths);
        let widest = vector_size(client, elem, &[]);
        let key = if reduced.is_contiguous() && moves_shifted(aligned, widest, part.len) {
            (out, widest, Grid::Shifted)
        } else {
            (out, aligned, Grid::Aligned)
        };
        let output = rounded_up(client, &reduced.device, part.len, key.1, part.dtype);
        if let Some((key, full)) = batches.push(key, (index, *part, output)) {
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

/// The parts' lengths, for [`unpack_shifted`].
fn lens<R: CubeRuntime>(parts: &[Waiting<R>]) -> SequenceArg<R, usize> {
    let mut lens = SequenceArg::new();
    for (_, part, _) in parts {
        lens.push(part.len);
    }
    lens
}

/// Unpacks `parts` in one [`unpack_members`] or [`unpack_shifted`] launch, `vector` elements a
/// unit, and puts each output in its part's place of `unpacked`.
fn launch<R: CubeRuntime>(
    reduced: &CubeTensor<R>,
    input: StorageType,
    postdivide: f64,
    (out, vector, grid): Key,
    parts: Vec<Waiting<R>>,
    unpacked: &mut [Option<CubeTensor<R>>],
) {
    let client = &reduced.client;
    let mut tensors: Vec<&CubeTensor<R>> = parts.iter().map(|(.., output)| output).collect();
    tensors.push(reduced);
    let address = address_type(&tensors);
    let divisor = InputScalar::new(postdivide, reduced.dtype);
    let places = parts.iter().map(|(_, p, _)| (p.offset, p.len));
    let UnitRanges {
        starts,
        ends,
        offsets,
        units,
    } = UnitRanges::<R>::new(places, vector, grid);
    // The outputs' views, collected into the sequence type of the kernel they go to.
    let outputs = || {
        parts
            .iter()
            .map(|(.., output)| output.clone().into_linear_view())
    };
    let cube_dim = CubeDim::new(client, units);
    let cube_count = calculate_cube_count_elemwise(client, units, cube_dim);
    let divide = postdivide != 1.0;
    match grid {
        // SAFETY: every unit below `units` falls in one part's range; it reads inside the part's
        // columns of the reduced row and writes below the part's length, both checked before
        // the launch.
        Grid::Aligned => unsafe {
            unpack_members::launch_unchecked::<R>(
                client,
                cube_count,
                cube_dim,
                address,
                vector,
                reduced.clone().into_linear_view(),
                outputs().collect(),
                divisor,
                starts,
                ends,
                offsets,
                units,
                divide,
                [input, out],
            )
        },
        // SAFETY: as above; a unit reads only the part's elements below its length, and writes
        // one vector of its output, which was rounded up to whole vectors.
        Grid::Shifted => unsafe {
            unpack_shifted::launch_unchecked::<R>(
                client,
                cube_count,
                cube_dim,
                address,
                vector,
                reduced.clone().into_linear_view(),
                outputs().collect(),
                divisor,
                starts,
                ends,
                offsets,
                lens(&parts),
                units,
                divide,
                [input, out],
            )
        },
    };
    for (index, part, output) in parts {
        unpacked[index] = Some(trimmed(output, part.len));
    }
}
