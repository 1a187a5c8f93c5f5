//! Activations: forwarded so the inner backend's fused kernels run.

use super::prelude::*;
use crate::backend::Zero;

impl<B: Backend> ActivationOps<Self> for Zero<B> {
    forward_ops! {
        fn leaky_relu(tensor: F, negative_slope: [Scalar]) -> F;
        fn relu(tensor: F) -> F;
        fn relu_backward(output: F, grad: F) -> F;
        fn gelu(tensor: F) -> F;
        fn prelu(tensor: F, alpha: F) -> F;
        fn gelu_backward(x: F, grad: F) -> F;
        fn sigmoid(tensor: F) -> F;
        fn sigmoid_backward(output: F, grad: F) -> F;
        fn hard_sigmoid(tensor: F, alpha: [Scalar], beta: [Scalar]) -> F;
        fn log_sigmoid(tensor: F) -> F;
        fn softmax(tensor: F, dim: [usize]) -> F;
        fn log_softmax(tensor: F, dim: [usize]) -> F;
        fn softmin(tensor: F, dim: [usize]) -> F;
        fn log_sigmoid_backward(x: F, grad: F) -> F;
    }
}
