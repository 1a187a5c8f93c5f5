//! The float types the host path computes in, each with Burn's CPU arithmetic reproduced
//! operation for operation.
//!
//! Bitwise agreement with the Burn-ops path is the contract, so every function here mirrors
//! what Flex and NdArray do, including the detours: a cast widens through `f64` and narrows
//! with `as f32` or `f16::from_f64` (which, on x86 with F16C, itself goes through `f32`); a
//! half-precision scalar division computes in `f32` with the divisor rounded to the tensor's
//! dtype first. Calling the same `half` functions the backends call keeps the results equal
//! on every machine, whatever its conversion instructions.

use burn::tensor::{DType, Element};
use half::{bf16, f16};

/// An element type of host tensors: `f64`, `f32`, `f16` or `bf16`.
pub trait HostFloat:
    super::access::BackendAccess
    + Element
    + bytemuck::Pod
    + PartialOrd
    + Copy
    + Send
    + Sync
    + std::fmt::Debug
    + 'static
{
    /// The dtype of tensors of this element.
    const DTYPE: DType;
    /// Positive zero: the padding value.
    const ZERO: Self;

    /// The divisor of `div_scalar(divisor)` as tensors of this type apply it.
    type Divisor: Copy + Send + Sync;

    /// The first half of Burn's float cast: this value as an `f64`.
    fn widen(self) -> f64;
    /// The second half of Burn's float cast: an `f64` rounded to this type.
    fn narrow(value: f64) -> Self;
    /// `divisor` as `div_scalar` rounds it for this type.
    fn divisor(divisor: f64) -> Self::Divisor;
    /// `self / divisor`, as `div_scalar` computes it.
    fn div(self, divisor: Self::Divisor) -> Self;
    /// `self + other`, as an element-wise tensor addition computes it.
    fn add(self, other: Self) -> Self;

    /// `max_pair`: `other` where `self < other`, else `self`.
    #[inline]
    fn max_pair(self, other: Self) -> Self {
        if self < other { other } else { self }
    }

    /// `min_pair`: `other` where `other < self`, else `self`.
    #[inline]
    fn min_pair(self, other: Self) -> Self {
        if other < self { other } else { self }
    }

    /// Burn's cast from `S` to this type: nothing when the types are equal, else through `f64`.
    #[inline]
    fn cast_from<S: HostFloat>(value: S) -> Self {
        match same::<S, Self>(&value) {
            Some(same) => same,
            None => Self::narrow(value.widen()),
        }
    }
}

/// `value` as a `T` when `S` and `T` are the same type.
#[inline]
fn same<S: HostFloat, T: HostFloat>(value: &S) -> Option<T> {
    if S::DTYPE == T::DTYPE {
        // Same dtype, same type: the four implementors have distinct dtypes.
        Some(bytemuck::cast(*value))
    } else {
        None
    }
}

impl HostFloat for f64 {
    const DTYPE: DType = DType::F64;
    const ZERO: Self = 0.0;
    type Divisor = f64;

    #[inline]
    fn widen(self) -> f64 {
        self
    }
    #[inline]
    fn narrow(value: f64) -> Self {
        value
    }
    #[inline]
    fn divisor(divisor: f64) -> f64 {
        divisor
    }
    #[inline]
    fn div(self, divisor: f64) -> Self {
        self / divisor
    }
    #[inline]
    fn add(self, other: Self) -> Self {
        self + other
    }
}

impl HostFloat for f32 {
    const DTYPE: DType = DType::F32;
    const ZERO: Self = 0.0;
    type Divisor = f32;

    #[inline]
    fn widen(self) -> f64 {
        self as f64
    }
    #[inline]
    fn narrow(value: f64) -> Self {
        value as f32
    }
    #[inline]
    fn divisor(divisor: f64) -> f32 {
        divisor as f32
    }
    #[inline]
    fn div(self, divisor: f32) -> Self {
        self / divisor
    }
    #[inline]
    fn add(self, other: Self) -> Self {
        self + other
    }
}

/// The half-precision types: Burn's CPU backends widen to f32 for every op and round back.
macro_rules! half_float {
    ($ty:ident, $dtype:ident) => {
        impl HostFloat for $ty {
            const DTYPE: DType = DType::$dtype;
            const ZERO: Self = $ty::ZERO;
            type Divisor = f32;

            #[inline]
            fn widen(self) -> f64 {
                self.to_f32() as f64
            }
            #[inline]
            fn narrow(value: f64) -> Self {
                $ty::from_f64(value)
            }
            #[inline]
            fn divisor(divisor: f64) -> f32 {
                $ty::from_f32(divisor as f32).to_f32()
            }
            #[inline]
            fn div(self, divisor: f32) -> Self {
                $ty::from_f32(self.to_f32() / divisor)
            }
            #[inline]
            fn add(self, other: Self) -> Self {
                $ty::from_f32(self.to_f32() + other.to_f32())
            }
        }
    };
}

half_float!(f16, F16);
half_float!(bf16, BF16);

/// A computation generic over the element type, run by [`visit`] for a dtype known at run time.
pub trait FloatVisitor {
    type Output;
    fn visit<E: HostFloat>(self) -> Self::Output;
}

/// Runs `visitor` with the element type of `dtype`; `None` for a dtype without one (integers,
/// bool, `Flex32`, quantized).
pub fn visit<V: FloatVisitor>(dtype: DType, visitor: V) -> Option<V::Output> {
    match dtype {
        DType::F64 => Some(visitor.visit::<f64>()),
        DType::F32 => Some(visitor.visit::<f32>()),
        DType::F16 => Some(visitor.visit::<f16>()),
        DType::BF16 => Some(visitor.visit::<bf16>()),
        _ => None,
    }
}
