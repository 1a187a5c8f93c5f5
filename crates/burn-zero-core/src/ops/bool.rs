//! Bool ops: B's own, forwarded; only `bool_into_float` produces a float.

use super::prelude::*;
use crate::backend::Zero;

impl<B: Backend> BoolTensorOps<Self> for Zero<B> {
    forward_ops! {
        fn bool_empty(shape: [Shape], device: [&Device<B>], dtype: [BoolDType]) -> [BoolTensor<B>];
        fn bool_zeros(shape: [Shape], device: [&Device<B>], dtype: [BoolDType]) -> [BoolTensor<B>];
        fn bool_ones(shape: [Shape], device: [&Device<B>], dtype: [BoolDType]) -> [BoolTensor<B>];
        fn bool_from_data(data: [TensorData], device: [&Device<B>]) -> [BoolTensor<B>];
        fn bool_into_int(tensor: [BoolTensor<B>], out_dtype: [IntDType]) -> [IntTensor<B>];
        fn bool_into_float(tensor: [BoolTensor<B>], out_dtype: [FloatDType]) -> F;
        fn bool_device(tensor: [&BoolTensor<B>]) -> [Device<B>];
        fn bool_to_device(tensor: [BoolTensor<B>], device: [&Device<B>]) -> [BoolTensor<B>];
        fn bool_reshape(tensor: [BoolTensor<B>], shape: [Shape]) -> [BoolTensor<B>];
        fn bool_slice(tensor: [BoolTensor<B>], slices: [&[Slice]]) -> [BoolTensor<B>];
        fn bool_slice_assign(tensor: [BoolTensor<B>], slices: [&[Slice]], value: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_mask_where(tensor: [BoolTensor<B>], mask: [BoolTensor<B>], value: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_mask_fill(tensor: [BoolTensor<B>], mask: [BoolTensor<B>], value: [Scalar]) -> [BoolTensor<B>];
        fn bool_gather(dim: [usize], tensor: [BoolTensor<B>], indices: [IntTensor<B>]) -> [BoolTensor<B>];
        fn bool_scatter_or(dim: [usize], tensor: [BoolTensor<B>], indices: [IntTensor<B>], value: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_select(tensor: [BoolTensor<B>], dim: [usize], indices: [IntTensor<B>]) -> [BoolTensor<B>];
        fn bool_select_or(tensor: [BoolTensor<B>], dim: [usize], indices: [IntTensor<B>], value: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_repeat_dim(tensor: [BoolTensor<B>], dim: [usize], times: [usize]) -> [BoolTensor<B>];
        fn bool_cat(tensors: [Vec<BoolTensor<B>>], dim: [usize]) -> [BoolTensor<B>];
        fn bool_equal(lhs: [BoolTensor<B>], rhs: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_not_equal(lhs: [BoolTensor<B>], rhs: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_equal_elem(lhs: [BoolTensor<B>], rhs: [Scalar]) -> [BoolTensor<B>];
        fn bool_not_equal_elem(lhs: [BoolTensor<B>], rhs: [Scalar]) -> [BoolTensor<B>];
        fn bool_not(tensor: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_and(lhs: [BoolTensor<B>], rhs: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_or(lhs: [BoolTensor<B>], rhs: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_xor(lhs: [BoolTensor<B>], rhs: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_transpose(tensor: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_swap_dims(tensor: [BoolTensor<B>], dim1: [usize], dim2: [usize]) -> [BoolTensor<B>];
        fn bool_permute(tensor: [BoolTensor<B>], axes: [&[usize]]) -> [BoolTensor<B>];
        fn bool_flip(tensor: [BoolTensor<B>], axes: [&[usize]]) -> [BoolTensor<B>];
        fn bool_any(tensor: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_any_dim(tensor: [BoolTensor<B>], dim: [usize]) -> [BoolTensor<B>];
        fn bool_all(tensor: [BoolTensor<B>]) -> [BoolTensor<B>];
        fn bool_all_dim(tensor: [BoolTensor<B>], dim: [usize]) -> [BoolTensor<B>];
        fn bool_expand(tensor: [BoolTensor<B>], shape: [Shape]) -> [BoolTensor<B>];
        fn bool_unfold(tensor: [BoolTensor<B>], dim: [usize], size: [usize], step: [usize]) -> [BoolTensor<B>];
    }

    fn bool_into_data(
        tensor: BoolTensor<B>,
    ) -> impl Future<Output = Result<TensorData, burn::tensor::backend::ExecutionError>> + Send
    {
        B::bool_into_data(tensor)
    }

    fn bool_argwhere(
        tensor: BoolTensor<B>,
        out_dtype: IntDType,
    ) -> impl Future<Output = IntTensor<B>> + 'static + Send {
        B::bool_argwhere(tensor, out_dtype)
    }
}
