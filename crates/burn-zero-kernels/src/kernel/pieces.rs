//! The reduction of an all-to-all's pieces in rank order: one launch reads every rank's piece
//! of this rank's shard and writes their sum (or mean, max, min), instead of one Burn operation
//! per rank.

use burn::tensor::Shape;
use burn::tensor::backend::Backend;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use super::{address_type, from_cube, into_cube_reading, storage_type, vector_size};
use crate::KernelError;
use crate::spec::PieceOp;

/// `output[i]` = piece 0's element `i`, then each later piece's folded in in order, rounded in
/// `F` after each step: added (`max`/`min` false), or kept when it is not greater (`max`: Burn's
/// `max_pair`, which takes the other value only where the kept one is lower) or not lower
/// (`min`); divided by `divisor` at the end with `divide`. Pieces lie end to end, `piece_len`
/// vectors each.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
fn fold_pieces<F: Float, N: Size>(
    pieces: &LinearView<Vector<F, N>>,
    output: &mut LinearView<Vector<F, N>, ReadWrite>,
    divisor: InputScalar,
    piece_len: usize,
    parts: usize,
    #[comptime] max: bool,
    #[comptime] min: bool,
    #[comptime] divide: bool,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= piece_len {
        terminate!();
    }
    let mut acc = pieces[ABSOLUTE_POS];
    for part in 1..parts {
        let value = pieces[part * piece_len + ABSOLUTE_POS];
        if max {
            acc = select_many(acc.less_than(value), value, acc);
        } else if min {
            acc = select_many(value.less_than(acc), value, acc);
        } else {
            acc += value;
        }
    }
    if divide {
        acc /= Vector::new(divisor.get::<F>());
    }
    output[ABSOLUTE_POS] = acc;
}

/// Reduces `received`'s `parts` pieces on runtime `R`; fails when the device cannot compute in
/// its dtype. The length divides by `parts` (checked by the caller).
pub(super) fn reduce_pieces<B: Backend, R: CubeRuntime>(
    received: B::FloatTensorPrimitive,
    parts: usize,
    op: PieceOp,
) -> Result<B::FloatTensorPrimitive, KernelError> {
    let received: CubeTensor<R> = into_cube_reading::<B, R>(received);
    let client = received.client.clone();
    let dtype = storage_type(&client, received.dtype)?;
    let received = if received.is_contiguous() {
        received
    } else {
        into_contiguous(received)
    };
    let len = received.meta.shape().num_elements() / parts;
    let output = empty_device_dtype(
        client.clone(),
        received.device.clone(),
        Shape::new([len]),
        received.dtype,
    );
    if len == 0 {
        return Ok(from_cube::<B, R>(output));
    }
    let vector = vector_size(&client, received.dtype.size(), &[len]);
    let units = len / vector;
    let cube_dim = CubeDim::new(&client, units);
    let address = address_type(&[&received, &output]);
    // SAFETY: units below `piece_len` read `parts` pieces of `piece_len` vectors inside the
    // received buffer (its length is `parts` pieces, checked by the caller) and write below the
    // output's `piece_len`.
    unsafe {
        fold_pieces::launch_unchecked::<R>(
            &client,
            calculate_cube_count_elemwise(&client, units, cube_dim),
            cube_dim,
            address,
            vector,
            received.clone().into_linear_view(),
            output.clone().into_linear_view(),
            InputScalar::new(parts as f64, received.dtype),
            units,
            parts,
            op == PieceOp::Max,
            op == PieceOp::Min,
            op == PieceOp::Mean && parts > 1,
            dtype,
        )
    };
    Ok(from_cube::<B, R>(output))
}
