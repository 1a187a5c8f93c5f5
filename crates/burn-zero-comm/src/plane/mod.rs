//! The engines' shared arithmetic: how a rank reduces the ranks' values and where the
//! pieces of a buffer go, so that every engine that sums on its own side (`LocalGroup` in one
//! process, `MpiGroup` across processes) produces the same bits.
//!
//! - [`HostPlane`]: loops over host memory on CPU backends (Flex, NdArray), into pooled buffers.
//! - [`fold_parts`]: the same reduction with Burn's tensor ops, on any other backend.
//!
//! Both start from rank 0's values (not from zero: `0 + (-0.0)` is `+0.0`), add the others in
//! rank order, rounding in the storage dtype after each addition, and divide once at the end
//! for a mean.

mod host;

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_zero_kernels::PieceOp;

use crate::call::ReduceOp;
pub(crate) use host::HostPlane;

/// The parts (one per rank, in rank order, all on one device) reduced element by element with
/// Burn's ops: folded left to right from the first, then divided by their number for a mean
/// of more than one.
pub(crate) fn fold_parts<B: Backend>(
    parts: impl IntoIterator<Item = Tensor<B, 1>>,
    op: ReduceOp,
) -> Tensor<B, 1> {
    let mut parts = parts.into_iter();
    let first = parts
        .next()
        .unwrap_or_else(|| unreachable!("a group has a rank"));
    let mut count = 1usize;
    let folded = parts.fold(first, |acc, part| {
        count += 1;
        match op {
            ReduceOp::Sum | ReduceOp::Mean => acc + part,
            ReduceOp::Max => acc.max_pair(part),
            ReduceOp::Min => acc.min_pair(part),
        }
    });
    match op {
        ReduceOp::Mean if count > 1 => folded.div_scalar(count as f64),
        _ => folded,
    }
}

/// `all`, `parts` pieces of equal length end to end (one per rank, in rank order, as an
/// all-to-all receives them), reduced as [`fold_parts`] reduces them: on a cubecl backend by
/// one kernel launch of the same arithmetic ([`burn_zero_kernels::reduce_pieces`]), elsewhere,
/// or for a dtype the kernel cannot compute in, with [`fold_parts`] itself.
pub(crate) fn fold_pieces<B: Backend>(
    all: Tensor<B, 1>,
    parts: usize,
    op: ReduceOp,
) -> Tensor<B, 1> {
    let piece_op = match op {
        ReduceOp::Sum => PieceOp::Sum,
        ReduceOp::Mean => PieceOp::Mean,
        ReduceOp::Max => PieceOp::Max,
        ReduceOp::Min => PieceOp::Min,
    };
    let primitive = all.clone().into_primitive().tensor();
    match burn_zero_kernels::reduce_pieces::<B>(primitive, parts, piece_op) {
        Some(Ok(reduced)) => return Tensor::from_primitive(TensorPrimitive::Float(reduced)),
        Some(Err(error)) => tracing::debug!(%error, "pieces folded with Burn's ops"),
        None => {}
    }
    let len = all.dims()[0] / parts;
    fold_parts(
        (0..parts).map(|part| all.clone().slice(part * len..(part + 1) * len)),
        op,
    )
}

/// Bounds of block `index` when `numel` elements are split into `parts` nearly equal blocks
/// (the first `numel % parts` blocks get one element more): each rank's share of an
/// all-reduce.
pub(crate) fn block_bounds(numel: usize, parts: usize, index: usize) -> Range<usize> {
    let base = numel / parts;
    let extra = numel % parts;
    let start = index * base + index.min(extra);
    let len = base + usize::from(index < extra);
    start..start + len
}

#[cfg(test)]
mod tests {
    use super::block_bounds;

    #[test]
    fn blocks_cover_the_buffer_in_order() {
        for numel in 0..20 {
            for parts in 1..6 {
                let mut next = 0;
                for index in 0..parts {
                    let range = block_bounds(numel, parts, index);
                    assert_eq!(range.start, next);
                    assert!(range.len() == numel / parts || range.len() == numel / parts + 1);
                    next = range.end;
                }
                assert_eq!(next, numel);
            }
        }
    }
}
