//! Int ops: B's own, forwarded; only `int_into_float` produces a float.

use super::prelude::*;
use crate::backend::Zero;

impl<B: Backend> IntTensorOps<Self> for Zero<B> {
    forward_ops! {
        fn int_empty(shape: [Shape], device: [&Device<B>], dtype: [IntDType]) -> [IntTensor<B>];
        fn int_from_data(data: [TensorData], device: [&Device<B>]) -> [IntTensor<B>];
        fn int_device(tensor: [&IntTensor<B>]) -> [Device<B>];
        fn int_to_device(tensor: [IntTensor<B>], device: [&Device<B>]) -> [IntTensor<B>];
        fn int_reshape(tensor: [IntTensor<B>], shape: [Shape]) -> [IntTensor<B>];
        fn int_slice(tensor: [IntTensor<B>], slices: [&[Slice]]) -> [IntTensor<B>];
        fn int_slice_assign(tensor: [IntTensor<B>], slices: [&[Slice]], value: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_into_float(tensor: [IntTensor<B>], out_dtype: [FloatDType]) -> F;
        fn int_mask_where(tensor: [IntTensor<B>], mask: [BoolTensor<B>], value: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_mask_fill(tensor: [IntTensor<B>], mask: [BoolTensor<B>], value: [Scalar]) -> [IntTensor<B>];
        fn int_gather(dim: [usize], tensor: [IntTensor<B>], indices: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_scatter_add(dim: [usize], tensor: [IntTensor<B>], indices: [IntTensor<B>], value: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_scatter_nd(data: [IntTensor<B>], indices: [IntTensor<B>], values: [IntTensor<B>], reduction: [burn::tensor::IndexingUpdateOp]) -> [IntTensor<B>];
        fn int_gather_nd(data: [IntTensor<B>], indices: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_select(tensor: [IntTensor<B>], dim: [usize], indices: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_select_add(tensor: [IntTensor<B>], dim: [usize], indices: [IntTensor<B>], value: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_repeat_dim(tensor: [IntTensor<B>], dim: [usize], times: [usize]) -> [IntTensor<B>];
        fn int_cat(tensors: [Vec<IntTensor<B>>], dim: [usize]) -> [IntTensor<B>];
        fn int_equal(lhs: [IntTensor<B>], rhs: [IntTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_not_equal(lhs: [IntTensor<B>], rhs: [IntTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_equal_elem(lhs: [IntTensor<B>], rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_not_equal_elem(lhs: [IntTensor<B>], rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_greater(lhs: [IntTensor<B>], rhs: [IntTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_greater_elem(lhs: [IntTensor<B>], rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_greater_equal(lhs: [IntTensor<B>], rhs: [IntTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_greater_equal_elem(lhs: [IntTensor<B>], rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_lower(lhs: [IntTensor<B>], rhs: [IntTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_lower_elem(lhs: [IntTensor<B>], rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_lower_equal(lhs: [IntTensor<B>], rhs: [IntTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_lower_equal_elem(lhs: [IntTensor<B>], rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_add(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_add_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn int_powi(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_powi_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn int_powi_scalar_impl(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn int_clamp_min(tensor: [IntTensor<B>], min: [Scalar]) -> [IntTensor<B>];
        fn int_clamp_max(tensor: [IntTensor<B>], max: [Scalar]) -> [IntTensor<B>];
        fn int_clamp(tensor: [IntTensor<B>], min: [Scalar], max: [Scalar]) -> [IntTensor<B>];
        fn int_sub(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_sub_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn int_mul(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_mul_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn int_div(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_div_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn int_remainder(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_remainder_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn int_matmul(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_neg(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_zeros(shape: [Shape], device: [&Device<B>], dtype: [IntDType]) -> [IntTensor<B>];
        fn int_ones(shape: [Shape], device: [&Device<B>], dtype: [IntDType]) -> [IntTensor<B>];
        fn int_full(shape: [Shape], fill_value: [Scalar], device: [&Device<B>], dtype: [IntDType]) -> [IntTensor<B>];
        fn int_sum(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_sum_dim(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_prod(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_prod_dim(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_mean(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_mean_dim(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_cumsum(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_cumprod(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_cummin(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_cummax(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_argmax(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_argtopk(tensor: [IntTensor<B>], dim: [usize], k: [usize]) -> [IntTensor<B>];
        fn int_topk(tensor: [IntTensor<B>], dim: [usize], k: [usize]) -> [IntTensor<B>];
        fn int_argmin(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_max(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_max_dim(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_max_dim_with_indices(tensor: [IntTensor<B>], dim: [usize]) -> [(IntTensor<B>, IntTensor<B>)];
        fn int_max_abs(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_max_abs_dim(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_min(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_min_dim(tensor: [IntTensor<B>], dim: [usize]) -> [IntTensor<B>];
        fn int_min_dim_with_indices(tensor: [IntTensor<B>], dim: [usize]) -> [(IntTensor<B>, IntTensor<B>)];
        fn int_abs(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_transpose(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_swap_dims(tensor: [IntTensor<B>], dim1: [usize], dim2: [usize]) -> [IntTensor<B>];
        fn int_permute(tensor: [IntTensor<B>], axes: [&[usize]]) -> [IntTensor<B>];
        fn int_flip(tensor: [IntTensor<B>], axes: [&[usize]]) -> [IntTensor<B>];
        fn int_random(shape: [Shape], distribution: [Distribution], device: [&Device<B>], dtype: [IntDType]) -> [IntTensor<B>];
        fn int_arange_step(range: [Range<i64>], step: [usize], device: [&Device<B>], dtype: [IntDType]) -> [IntTensor<B>];
        fn int_arange(range: [Range<i64>], device: [&Device<B>], dtype: [IntDType]) -> [IntTensor<B>];
        fn int_any(tensor: [IntTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_any_dim(tensor: [IntTensor<B>], dim: [usize], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_all(tensor: [IntTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_all_dim(tensor: [IntTensor<B>], dim: [usize], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn int_sign(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn int_expand(tensor: [IntTensor<B>], shape: [Shape]) -> [IntTensor<B>];
        fn int_sort(tensor: [IntTensor<B>], dim: [usize], descending: [bool]) -> [IntTensor<B>];
        fn int_sort_with_indices(tensor: [IntTensor<B>], dim: [usize], descending: [bool]) -> [(IntTensor<B>, IntTensor<B>)];
        fn int_argsort(tensor: [IntTensor<B>], dim: [usize], descending: [bool]) -> [IntTensor<B>];
        fn bitwise_and(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn bitwise_and_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn bitwise_or(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn bitwise_or_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn bitwise_xor(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn bitwise_xor_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn bitwise_not(tensor: [IntTensor<B>]) -> [IntTensor<B>];
        fn bitwise_left_shift(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn bitwise_left_shift_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn bitwise_right_shift(lhs: [IntTensor<B>], rhs: [IntTensor<B>]) -> [IntTensor<B>];
        fn bitwise_right_shift_scalar(lhs: [IntTensor<B>], rhs: [Scalar]) -> [IntTensor<B>];
        fn int_cast(tensor: [IntTensor<B>], dtype: [IntDType]) -> [IntTensor<B>];
        fn int_unfold(tensor: [IntTensor<B>], dim: [usize], size: [usize], step: [usize]) -> [IntTensor<B>];
    }

    fn int_into_data(
        tensor: IntTensor<B>,
    ) -> impl Future<Output = Result<TensorData, burn::tensor::backend::ExecutionError>> + Send
    {
        B::int_into_data(tensor)
    }
}
