//! Float ops: operands gathered at dispatch, B's op run, the result local. View ops on a
//! sharded tensor stay lazy; shape, dtype and device never gather.

use super::prelude::*;
use crate::backend::Zero;
use crate::tensor::ZeroTensor;
use crate::view::ViewOp;

impl<B: Backend> FloatTensorOps<Self> for Zero<B> {
    forward_ops! {
        fn float_from_data(data: [TensorData], device: [&Device<B>]) -> F;
        fn float_random(shape: [Shape], distribution: [Distribution], device: [&Device<B>], dtype: [FloatDType]) -> F;
        fn float_zeros(shape: [Shape], device: [&Device<B>], dtype: [FloatDType]) -> F;
        fn float_ones(shape: [Shape], device: [&Device<B>], dtype: [FloatDType]) -> F;
        fn float_full(shape: [Shape], fill_value: [Scalar], device: [&Device<B>], dtype: [FloatDType]) -> F;
        fn float_into_int(tensor: F, out_dtype: [IntDType]) -> [IntTensor<B>];
        fn float_empty(shape: [Shape], device: [&Device<B>], dtype: [FloatDType]) -> F;
        fn float_repeat_dim(tensor: F, dim: [usize], times: [usize]) -> F;
        fn float_add(lhs: F, rhs: F) -> F;
        fn float_add_scalar(lhs: F, rhs: [Scalar]) -> F;
        fn float_clamp_min(tensor: F, min: [Scalar]) -> F;
        fn float_clamp_max(tensor: F, max: [Scalar]) -> F;
        fn float_clamp(tensor: F, min: [Scalar], max: [Scalar]) -> F;
        fn float_sub(lhs: F, rhs: F) -> F;
        fn float_sub_scalar(lhs: F, rhs: [Scalar]) -> F;
        fn float_mul(lhs: F, rhs: F) -> F;
        fn float_mul_scalar(lhs: F, rhs: [Scalar]) -> F;
        fn float_div(lhs: F, rhs: F) -> F;
        fn float_div_scalar(lhs: F, rhs: [Scalar]) -> F;
        fn float_remainder(lhs: F, rhs: F) -> F;
        fn float_remainder_scalar(lhs: F, rhs: [Scalar]) -> F;
        fn float_matmul(lhs: F, rhs: F) -> F;
        fn float_cross(lhs: F, rhs: F, dim: [usize]) -> F;
        fn float_neg(tensor: F) -> F;
        fn float_recip(tensor: F) -> F;
        fn float_flip(tensor: F, axes: [&[usize]]) -> F;
        fn float_gather(dim: [usize], tensor: F, indices: [IntTensor<B>]) -> F;
        fn float_scatter_add(dim: [usize], tensor: F, indices: [IntTensor<B>], value: F) -> F;
        fn float_scatter_nd(data: F, indices: [IntTensor<B>], values: F, reduction: [burn::tensor::IndexingUpdateOp]) -> F;
        fn float_gather_nd(data: F, indices: [IntTensor<B>]) -> F;
        fn float_select(tensor: F, dim: [usize], indices: [IntTensor<B>]) -> F;
        fn float_select_add(tensor: F, dim: [usize], indices: [IntTensor<B>], value: F) -> F;
        fn float_slice_assign(tensor: F, slices: [&[Slice]], value: F) -> F;
        fn float_mask_where(tensor: F, mask: [BoolTensor<B>], value: F) -> F;
        fn float_mask_fill(tensor: F, mask: [BoolTensor<B>], value: [Scalar]) -> F;
        fn float_equal(lhs: F, rhs: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_not_equal(lhs: F, rhs: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_equal_elem(lhs: F, rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_not_equal_elem(lhs: F, rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_greater(lhs: F, rhs: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_greater_elem(lhs: F, rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_greater_equal(lhs: F, rhs: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_greater_equal_elem(lhs: F, rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_lower(lhs: F, rhs: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_lower_elem(lhs: F, rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_lower_equal(lhs: F, rhs: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_lower_equal_elem(lhs: F, rhs: [Scalar], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_sum(tensor: F) -> F;
        fn float_sum_dim(tensor: F, dim: [usize]) -> F;
        fn float_prod(tensor: F) -> F;
        fn float_prod_dim(tensor: F, dim: [usize]) -> F;
        fn float_mean(tensor: F) -> F;
        fn float_mean_dim(tensor: F, dim: [usize]) -> F;
        fn float_cumsum(tensor: F, dim: [usize]) -> F;
        fn float_cumprod(tensor: F, dim: [usize]) -> F;
        fn float_cummin(tensor: F, dim: [usize]) -> F;
        fn float_cummax(tensor: F, dim: [usize]) -> F;
        fn float_cast(tensor: F, dtype: [FloatDType]) -> F;
        fn float_exp(tensor: F) -> F;
        fn float_log(tensor: F) -> F;
        fn float_log1p(tensor: F) -> F;
        fn float_powf(lhs: F, rhs: F) -> F;
        fn float_powi(lhs: F, rhs: [IntTensor<B>]) -> F;
        fn float_powi_scalar(lhs: F, rhs: [Scalar]) -> F;
        fn float_powi_scalar_impl(lhs: F, rhs: [Scalar]) -> F;
        fn float_powf_scalar(tensor: F, value: [Scalar]) -> F;
        fn float_powf_scalar_impl(tensor: F, value: [Scalar]) -> F;
        fn float_sqrt(tensor: F) -> F;
        fn float_abs(tensor: F) -> F;
        fn float_cos(tensor: F) -> F;
        fn float_sin(tensor: F) -> F;
        fn float_tan(tensor: F) -> F;
        fn float_cosh(tensor: F) -> F;
        fn float_sinh(tensor: F) -> F;
        fn float_tanh(tensor: F) -> F;
        fn float_acos(tensor: F) -> F;
        fn float_acosh(tensor: F) -> F;
        fn float_asin(tensor: F) -> F;
        fn float_asinh(tensor: F) -> F;
        fn float_atan(tensor: F) -> F;
        fn float_atanh(tensor: F) -> F;
        fn float_atan2(lhs: F, rhs: F) -> F;
        fn float_round(tensor: F) -> F;
        fn float_floor(tensor: F) -> F;
        fn float_ceil(tensor: F) -> F;
        fn float_trunc(tensor: F) -> F;
        fn float_erf(tensor: F) -> F;
        fn float_cat(tensors: VF, dim: [usize]) -> F;
        fn float_argmax(tensor: F, dim: [usize], out_dtype: [IntDType]) -> [IntTensor<B>];
        fn float_argtopk(tensor: F, dim: [usize], k: [usize], out_dtype: [IntDType]) -> [IntTensor<B>];
        fn float_topk(tensor: F, dim: [usize], k: [usize]) -> F;
        fn float_argmin(tensor: F, dim: [usize], out_dtype: [IntDType]) -> [IntTensor<B>];
        fn float_max(tensor: F) -> F;
        fn float_max_dim(tensor: F, dim: [usize]) -> F;
        fn float_max_dim_with_indices(tensor: F, dim: [usize], indices_dtype: [IntDType]) -> FI;
        fn float_min(tensor: F) -> F;
        fn float_min_dim(tensor: F, dim: [usize]) -> F;
        fn float_min_dim_with_indices(tensor: F, dim: [usize], indices_dtype: [IntDType]) -> FI;
        fn float_max_abs(tensor: F) -> F;
        fn float_max_abs_dim(tensor: F, dim: [usize]) -> F;
        fn float_any(tensor: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_any_dim(tensor: F, dim: [usize], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_all(tensor: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_all_dim(tensor: F, dim: [usize], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_sign(tensor: F) -> F;
        fn float_sort(tensor: F, dim: [usize], descending: [bool]) -> F;
        fn float_sort_with_indices(tensor: F, dim: [usize], descending: [bool], indices_dtype: [IntDType]) -> FI;
        fn float_argsort(tensor: F, dim: [usize], descending: [bool], out_dtype: [IntDType]) -> [IntTensor<B>];
        fn float_grid_sample_2d(tensor: F, grid: F, options: [GridSampleOptions]) -> F;
        fn float_unfold(tensor: F, dim: [usize], size: [usize], step: [usize]) -> F;
        fn float_is_nan(tensor: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn float_is_inf(tensor: F, out_dtype: [BoolDType]) -> [BoolTensor<B>];
    }

    fn float_into_data(
        tensor: ZeroTensor<B>,
    ) -> impl Future<Output = Result<TensorData, burn::tensor::backend::ExecutionError>> + Send
    {
        // Gather before the future is built, so that it holds only the inner primitive.
        B::float_into_data(tensor.materialize())
    }

    fn float_device(tensor: &ZeroTensor<B>) -> B::Device {
        tensor.device()
    }

    fn float_to_device(tensor: ZeroTensor<B>, device: &B::Device) -> ZeroTensor<B> {
        ZeroTensor::Local(B::float_to_device(tensor.materialize(), device))
    }

    fn float_transpose(tensor: ZeroTensor<B>) -> ZeroTensor<B> {
        let ndims = burn::tensor::TensorMetadata::shape(&tensor).num_dims();
        Self::float_swap_dims(tensor, ndims - 2, ndims - 1)
    }

    fn float_swap_dims(tensor: ZeroTensor<B>, dim1: usize, dim2: usize) -> ZeroTensor<B> {
        tensor.view(ViewOp::SwapDims(dim1, dim2))
    }

    fn float_permute(tensor: ZeroTensor<B>, axes: &[usize]) -> ZeroTensor<B> {
        tensor.view(ViewOp::Permute(axes.to_vec()))
    }

    fn float_reshape(tensor: ZeroTensor<B>, shape: Shape) -> ZeroTensor<B> {
        tensor.view(ViewOp::Reshape(shape))
    }

    fn float_slice(tensor: ZeroTensor<B>, slices: &[Slice]) -> ZeroTensor<B> {
        tensor.view(ViewOp::Slice(slices.to_vec()))
    }

    fn float_expand(tensor: ZeroTensor<B>, shape: Shape) -> ZeroTensor<B> {
        tensor.view(ViewOp::Expand(shape))
    }

    // Detach and require-grad are identities below autodiff; keep sharded tensors sharded.
    fn float_detach(tensor: ZeroTensor<B>) -> ZeroTensor<B> {
        match tensor {
            ZeroTensor::Local(t) => ZeroTensor::Local(B::float_detach(t)),
            sharded => sharded,
        }
    }

    fn float_set_require_grad(tensor: ZeroTensor<B>, require_grad: bool) -> ZeroTensor<B> {
        match tensor {
            ZeroTensor::Local(t) => ZeroTensor::Local(B::float_set_require_grad(t, require_grad)),
            sharded => sharded,
        }
    }

    fn float_is_require_grad(tensor: &ZeroTensor<B>) -> bool {
        match tensor {
            ZeroTensor::Local(t) => B::float_is_require_grad(t),
            ZeroTensor::Sharded(_) => false,
        }
    }
}
