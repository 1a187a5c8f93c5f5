//! Module ops (conv, pooling, attention, …): operands gathered, B's kernels run.

use super::prelude::*;
use crate::backend::Zero;
use crate::tensor::ZeroTensor;

impl<B: Backend> ModuleOps<Self> for Zero<B> {
    forward_ops! {
        fn embedding(weights: F, indices: [IntTensor<B>]) -> F;
        fn embedding_backward(weights: F, output_grad: F, indices: [IntTensor<B>]) -> F;
        fn linear(x: F, weight: F, bias: OF) -> F;
        fn linear_x_backward(weight: F, output_grad: F) -> F;
        fn linear_weight_backward(x: F, output_grad: F) -> F;
        fn linear_bias_backward(output_grad: F) -> F;
        fn conv1d(x: F, weight: F, bias: OF, options: [ConvOptions<1>]) -> F;
        fn conv1d_x_backward(x: F, weight: F, output_grad: F, options: [ConvOptions<1>]) -> F;
        fn conv1d_weight_backward(x: F, weight: F, output_grad: F, options: [ConvOptions<1>]) -> F;
        fn conv1d_bias_backward(x: F, bias: F, output_grad: F) -> F;
        fn conv2d(x: F, weight: F, bias: OF, options: [ConvOptions<2>]) -> F;
        fn conv2d_x_backward(x: F, weight: F, output_grad: F, options: [ConvOptions<2>]) -> F;
        fn conv2d_weight_backward(x: F, weight: F, output_grad: F, options: [ConvOptions<2>]) -> F;
        fn conv2d_bias_backward(x: F, bias: F, output_grad: F) -> F;
        fn deform_conv2d(x: F, offset: F, weight: F, mask: OF, bias: OF, options: [DeformConvOptions<2>]) -> F;
        fn conv3d(x: F, weight: F, bias: OF, options: [ConvOptions<3>]) -> F;
        fn conv3d_x_backward(x: F, weight: F, output_grad: F, options: [ConvOptions<3>]) -> F;
        fn conv3d_weight_backward(x: F, weight: F, output_grad: F, options: [ConvOptions<3>]) -> F;
        fn conv3d_bias_backward(x: F, bias: F, output_grad: F) -> F;
        fn conv_transpose1d(x: F, weight: F, bias: OF, options: [ConvTransposeOptions<1>]) -> F;
        fn conv_transpose1d_x_backward(weight: F, output_grad: F, options: [ConvTransposeOptions<1>]) -> F;
        fn conv_transpose1d_weight_backward(x: F, weight: F, output_grad: F, options: [ConvTransposeOptions<1>]) -> F;
        fn conv_transpose1d_bias_backward(x: F, bias: F, output_grad: F) -> F;
        fn conv_transpose2d(x: F, weight: F, bias: OF, options: [ConvTransposeOptions<2>]) -> F;
        fn conv_transpose2d_x_backward(weight: F, output_grad: F, options: [ConvTransposeOptions<2>]) -> F;
        fn conv_transpose2d_weight_backward(x: F, weight: F, output_grad: F, options: [ConvTransposeOptions<2>]) -> F;
        fn conv_transpose2d_bias_backward(x: F, bias: F, output_grad: F) -> F;
        fn conv_transpose3d(x: F, weight: F, bias: OF, options: [ConvTransposeOptions<3>]) -> F;
        fn conv_transpose3d_x_backward(weight: F, output_grad: F, options: [ConvTransposeOptions<3>]) -> F;
        fn conv_transpose3d_weight_backward(x: F, weight: F, output_grad: F, options: [ConvTransposeOptions<3>]) -> F;
        fn conv_transpose3d_bias_backward(x: F, bias: F, output_grad: F) -> F;
        fn unfold4d(x: F, kernel_size: [[usize; 2]], options: [UnfoldOptions]) -> F;
        fn avg_pool1d(x: F, kernel_size: [usize], stride: [usize], padding: [usize], count_include_pad: [bool], ceil_mode: [bool]) -> F;
        fn avg_pool1d_backward(x: F, grad: F, kernel_size: [usize], stride: [usize], padding: [usize], count_include_pad: [bool], ceil_mode: [bool]) -> F;
        fn avg_pool2d(x: F, kernel_size: [[usize; 2]], stride: [[usize; 2]], padding: [[usize; 2]], count_include_pad: [bool], ceil_mode: [bool]) -> F;
        fn avg_pool2d_backward(x: F, grad: F, kernel_size: [[usize; 2]], stride: [[usize; 2]], padding: [[usize; 2]], count_include_pad: [bool], ceil_mode: [bool]) -> F;
        fn adaptive_avg_pool2d(x: F, output_size: [[usize; 2]]) -> F;
        fn adaptive_avg_pool2d_backward(x: F, grad: F) -> F;
        fn adaptive_avg_pool1d(x: F, output_size: [usize]) -> F;
        fn adaptive_avg_pool1d_backward(x: F, grad: F) -> F;
        fn max_pool1d(x: F, kernel_size: [usize], stride: [usize], padding: [usize], dilation: [usize], ceil_mode: [bool]) -> F;
        fn max_pool2d(x: F, kernel_size: [[usize; 2]], stride: [[usize; 2]], padding: [[usize; 2]], dilation: [[usize; 2]], ceil_mode: [bool]) -> F;
        fn interpolate(x: F, output_size: [[usize; 2]], options: [InterpolateOptions]) -> F;
        fn interpolate_backward(x: F, grad: F, output_size: [[usize; 2]], options: [InterpolateOptions]) -> F;
        fn attention(query: F, key: F, value: F, mask: [Option<BoolTensor<B>>], attn_bias: OF, options: [AttentionModuleOptions]) -> F;
        fn layer_norm(tensor: F, gamma: F, beta: OF, epsilon: [f64]) -> F;
        fn ctc_loss(log_probs: F, targets: [IntTensor<B>], input_lengths: [IntTensor<B>], target_lengths: [IntTensor<B>], blank: [usize]) -> F;
        fn has_ctc_loss_backward() -> [bool];
        fn ctc_loss_backward(log_probs: F, targets: [IntTensor<B>], input_lengths: [IntTensor<B>], target_lengths: [IntTensor<B>], grad_loss: F, blank: [usize]) -> F;
        fn rfft(signal: F, dim: [usize], n: [Option<usize>]) -> FF;
        fn irfft(spectrum_re: F, spectrum_im: F, dim: [usize], n: [Option<usize>]) -> F;
    }

    fn deform_conv2d_backward(
        x: ZeroTensor<B>,
        offset: ZeroTensor<B>,
        weight: ZeroTensor<B>,
        mask: Option<ZeroTensor<B>>,
        bias: Option<ZeroTensor<B>>,
        output_grad: ZeroTensor<B>,
        options: DeformConvOptions<2>,
    ) -> DeformConv2dBackward<Self> {
        let out = B::deform_conv2d_backward(
            x.materialize(),
            offset.materialize(),
            weight.materialize(),
            mask.map(ZeroTensor::materialize),
            bias.map(ZeroTensor::materialize),
            output_grad.materialize(),
            options,
        );
        DeformConv2dBackward::new(
            ZeroTensor::Local(out.x_grad),
            ZeroTensor::Local(out.offset_grad),
            ZeroTensor::Local(out.weight_grad),
            out.mask_grad.map(ZeroTensor::Local),
            out.bias_grad.map(ZeroTensor::Local),
        )
    }

    fn max_pool1d_with_indices(
        x: ZeroTensor<B>,
        kernel_size: usize,
        stride: usize,
        padding: usize,
        dilation: usize,
        ceil_mode: bool,
    ) -> MaxPool1dWithIndices<Self> {
        let out = B::max_pool1d_with_indices(
            x.materialize(),
            kernel_size,
            stride,
            padding,
            dilation,
            ceil_mode,
        );
        MaxPool1dWithIndices::new(ZeroTensor::Local(out.output), out.indices)
    }

    #[allow(clippy::too_many_arguments)]
    fn max_pool1d_with_indices_backward(
        x: ZeroTensor<B>,
        kernel_size: usize,
        stride: usize,
        padding: usize,
        dilation: usize,
        ceil_mode: bool,
        output_grad: ZeroTensor<B>,
        indices: IntTensor<B>,
    ) -> MaxPool1dBackward<Self> {
        let out = B::max_pool1d_with_indices_backward(
            x.materialize(),
            kernel_size,
            stride,
            padding,
            dilation,
            ceil_mode,
            output_grad.materialize(),
            indices,
        );
        MaxPool1dBackward::new(ZeroTensor::Local(out.x_grad))
    }

    fn max_pool2d_with_indices(
        x: ZeroTensor<B>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        ceil_mode: bool,
    ) -> MaxPool2dWithIndices<Self> {
        let out = B::max_pool2d_with_indices(
            x.materialize(),
            kernel_size,
            stride,
            padding,
            dilation,
            ceil_mode,
        );
        MaxPool2dWithIndices::new(ZeroTensor::Local(out.output), out.indices)
    }

    #[allow(clippy::too_many_arguments)]
    fn max_pool2d_with_indices_backward(
        x: ZeroTensor<B>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        ceil_mode: bool,
        output_grad: ZeroTensor<B>,
        indices: IntTensor<B>,
    ) -> MaxPool2dBackward<Self> {
        let out = B::max_pool2d_with_indices_backward(
            x.materialize(),
            kernel_size,
            stride,
            padding,
            dilation,
            ceil_mode,
            output_grad.materialize(),
            indices,
        );
        MaxPool2dBackward::new(ZeroTensor::Local(out.x_grad))
    }
}
