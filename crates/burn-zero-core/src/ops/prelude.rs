//! What every op file needs: the forwarding macros and the types their signatures name.

pub(crate) use super::forward::{forward_ops, zero_arg, zero_ret, zero_ty};
pub(crate) use burn::tensor::backend::Backend;
pub(crate) use burn::tensor::ops::*;
pub(crate) use burn::tensor::quantization::QuantScheme;
pub(crate) use burn::tensor::{
    BoolDType, Distribution, FloatDType, IntDType, Scalar, Shape, Slice, TensorData,
};
pub(crate) use std::ops::Range;
