//! Quantized ops: B's own quantized primitive, forwarded; floats cross in `quantize` and `dequantize`.

use super::prelude::*;
use crate::backend::Zero;
use crate::tensor::ZeroTensor;
use burn::tensor::quantization::QuantizationParametersPrimitive;

impl<B: Backend> QTensorOps<Self> for Zero<B> {
    forward_ops! {
        fn q_from_data(data: [TensorData], device: [&Device<B>]) -> [QuantizedTensor<B>];
        fn quantize_dynamic(tensor: F, scheme: [&QuantScheme]) -> [QuantizedTensor<B>];
        fn dequantize(tensor: [QuantizedTensor<B>], dtype: [FloatDType]) -> F;
        fn q_device(tensor: [&QuantizedTensor<B>]) -> [Device<B>];
        fn q_to_device(tensor: [QuantizedTensor<B>], device: [&Device<B>]) -> [QuantizedTensor<B>];
        fn q_reshape(tensor: [QuantizedTensor<B>], shape: [Shape]) -> [QuantizedTensor<B>];
        fn q_detach(tensor: [QuantizedTensor<B>]) -> [QuantizedTensor<B>];
        fn q_set_require_grad(tensor: [QuantizedTensor<B>], require_grad: [bool]) -> [QuantizedTensor<B>];
        fn q_is_require_grad(tensor: [&QuantizedTensor<B>]) -> [bool];
        fn q_expand(tensor: [QuantizedTensor<B>], shape: [Shape]) -> [QuantizedTensor<B>];
        fn q_transpose(tensor: [QuantizedTensor<B>]) -> [QuantizedTensor<B>];
        fn q_swap_dims(tensor: [QuantizedTensor<B>], dim1: [usize], dim2: [usize]) -> [QuantizedTensor<B>];
        fn q_permute(tensor: [QuantizedTensor<B>], axes: [&[usize]]) -> [QuantizedTensor<B>];
        fn q_flip(tensor: [QuantizedTensor<B>], axes: [&[usize]]) -> [QuantizedTensor<B>];
        fn q_select(tensor: [QuantizedTensor<B>], dim: [usize], indices: [IntTensor<B>]) -> [QuantizedTensor<B>];
        fn q_slice(tensor: [QuantizedTensor<B>], slices: [&[Slice]]) -> [QuantizedTensor<B>];
        fn q_gather(dim: [usize], tensor: [QuantizedTensor<B>], indices: [IntTensor<B>]) -> [QuantizedTensor<B>];
        fn q_repeat_dim(tensor: [QuantizedTensor<B>], dim: [usize], times: [usize]) -> [QuantizedTensor<B>];
        fn q_abs(tensor: [QuantizedTensor<B>]) -> [QuantizedTensor<B>];
        fn q_cat(tensors: [Vec<QuantizedTensor<B>>], dim: [usize]) -> [QuantizedTensor<B>];
        fn q_argmax(tensor: [QuantizedTensor<B>], dim: [usize], out_dtype: [IntDType]) -> [IntTensor<B>];
        fn q_argtopk(tensor: [QuantizedTensor<B>], dim: [usize], k: [usize], out_dtype: [IntDType]) -> [IntTensor<B>];
        fn q_topk(tensor: [QuantizedTensor<B>], dim: [usize], k: [usize]) -> [QuantizedTensor<B>];
        fn q_argmin(tensor: [QuantizedTensor<B>], dim: [usize], out_dtype: [IntDType]) -> [IntTensor<B>];
        fn q_max(tensor: [QuantizedTensor<B>]) -> [QuantizedTensor<B>];
        fn q_max_dim(tensor: [QuantizedTensor<B>], dim: [usize]) -> [QuantizedTensor<B>];
        fn q_max_dim_with_indices(tensor: [QuantizedTensor<B>], dim: [usize], out_dtype: [IntDType]) -> [(QuantizedTensor<B>, IntTensor<B>)];
        fn q_min(tensor: [QuantizedTensor<B>]) -> [QuantizedTensor<B>];
        fn q_min_dim(tensor: [QuantizedTensor<B>], dim: [usize]) -> [QuantizedTensor<B>];
        fn q_min_dim_with_indices(tensor: [QuantizedTensor<B>], dim: [usize], out_dtype: [IntDType]) -> [(QuantizedTensor<B>, IntTensor<B>)];
        fn q_max_abs(tensor: [QuantizedTensor<B>]) -> [QuantizedTensor<B>];
        fn q_max_abs_dim(tensor: [QuantizedTensor<B>], dim: [usize]) -> [QuantizedTensor<B>];
        fn q_any(tensor: [QuantizedTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn q_any_dim(tensor: [QuantizedTensor<B>], dim: [usize], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn q_all(tensor: [QuantizedTensor<B>], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn q_all_dim(tensor: [QuantizedTensor<B>], dim: [usize], out_dtype: [BoolDType]) -> [BoolTensor<B>];
        fn q_sort(tensor: [QuantizedTensor<B>], dim: [usize], descending: [bool]) -> [QuantizedTensor<B>];
        fn q_sort_with_indices(tensor: [QuantizedTensor<B>], dim: [usize], descending: [bool], out_dtype: [IntDType]) -> [(QuantizedTensor<B>, IntTensor<B>)];
        fn q_argsort(tensor: [QuantizedTensor<B>], dim: [usize], descending: [bool], out_dtype: [IntDType]) -> [IntTensor<B>];
    }

    fn quantize(
        tensor: ZeroTensor<B>,
        scheme: &QuantScheme,
        qparams: QuantizationParametersPrimitive<Self>,
    ) -> QuantizedTensor<B> {
        let qparams = QuantizationParametersPrimitive {
            scales: qparams.scales.materialize(),
        };
        B::quantize(tensor.materialize(), scheme, qparams)
    }

    fn q_into_data(
        tensor: QuantizedTensor<B>,
    ) -> impl Future<Output = Result<TensorData, burn::tensor::backend::ExecutionError>> + Send
    {
        B::q_into_data(tensor)
    }
}
