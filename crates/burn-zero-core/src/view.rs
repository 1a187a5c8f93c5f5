//! Lazy view ops: how a sharded parameter is looked at, replayed on the gathered tensor.

use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Slice, TensorMetadata};

/// A view op recorded on a sharded parameter instead of gathering it.
#[derive(Debug, Clone, PartialEq)]
pub enum ViewOp {
    /// `float_reshape`.
    Reshape(Shape),
    /// `float_swap_dims` (and `float_transpose`).
    SwapDims(usize, usize),
    /// `float_permute`.
    Permute(Vec<usize>),
    /// `float_expand`.
    Expand(Shape),
    /// `float_slice`.
    Slice(Vec<Slice>),
}

impl ViewOp {
    /// The shape after this op, from the shape before it (no data touched).
    pub fn output_shape(&self, input: &Shape) -> Shape {
        match self {
            ViewOp::Reshape(shape) | ViewOp::Expand(shape) => shape.clone(),
            ViewOp::SwapDims(a, b) => {
                let mut dims = input.to_vec();
                dims.swap(*a, *b);
                Shape::from(dims)
            }
            ViewOp::Permute(axes) => {
                Shape::from(axes.iter().map(|&a| input[a]).collect::<Vec<_>>())
            }
            ViewOp::Slice(slices) => {
                let mut dims = input.to_vec();
                for (dim, slice) in dims.iter_mut().zip(slices) {
                    *dim = slice.output_size(*dim);
                }
                Shape::from(dims)
            }
        }
    }

    /// Replays the op on a materialised tensor of the inner backend.
    pub fn apply<B: Backend>(&self, tensor: B::FloatTensorPrimitive) -> B::FloatTensorPrimitive {
        match self {
            ViewOp::Reshape(shape) => B::float_reshape(tensor, shape.clone()),
            ViewOp::SwapDims(a, b) => B::float_swap_dims(tensor, *a, *b),
            ViewOp::Permute(axes) => B::float_permute(tensor, axes),
            ViewOp::Expand(shape) => B::float_expand(tensor, shape.clone()),
            ViewOp::Slice(slices) => B::float_slice(tensor, slices),
        }
    }
}

/// Checks a primitive's shape after replaying views (debug builds only).
pub(crate) fn debug_check_shape<P: TensorMetadata>(tensor: &P, expected: &Shape) {
    debug_assert_eq!(
        &tensor.shape(),
        expected,
        "a lazy view replayed to an unexpected shape"
    );
}
