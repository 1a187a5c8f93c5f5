//! Shared helpers: deterministic inputs and an independent host-side reference.

#![allow(dead_code)]

use burn::tensor::{DType, Tensor, TensorData, backend::Backend};
use half::{bf16, f16};

/// Element types the reference computes in, with the same rounding as the backends: one
/// IEEE operation at a time, in the buffer's own precision.
pub trait RefFloat:
    Copy + PartialOrd + std::ops::Add<Output = Self> + std::ops::Div<Output = Self>
{
    const DTYPE: DType;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl RefFloat for f32 {
    const DTYPE: DType = DType::F32;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl RefFloat for f16 {
    const DTYPE: DType = DType::F16;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl RefFloat for bf16 {
    const DTYPE: DType = DType::BF16;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// SplitMix64: a tiny deterministic generator, so inputs do not depend on any backend's RNG.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Rank `rank`'s input of `len` elements for test `salt`, already rounded to `T`.
///
/// f32 inputs are arbitrary values in [-1, 1); half-precision inputs are multiples of 1/8 in
/// [-4, 4), whose sums over four ranks are exact, so the reference never depends on how a
/// backend rounds intermediate sums.
pub fn input<T: RefFloat>(salt: u64, rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| {
            let bits = splitmix(salt ^ ((rank as u64) << 40) ^ i as u64);
            let v = if T::DTYPE == DType::F32 {
                (bits >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            } else {
                ((bits >> 58) as f32 - 32.0) / 8.0
            };
            T::from_f32(v)
        })
        .collect()
}

/// A 1-D tensor of `T`'s dtype holding `values`.
pub fn tensor<B: Backend, T: RefFloat>(values: &[T], device: &B::Device) -> Tensor<B, 1> {
    let data = TensorData::new(values.iter().map(|v| v.to_f32()).collect(), [values.len()])
        .convert_dtype(T::DTYPE);
    Tensor::from_data(data, (device, T::DTYPE))
}

/// The tensor's values, widened to f32 (exact for every dtype used here).
pub fn values<B: Backend>(tensor: Tensor<B, 1>) -> Vec<f32> {
    tensor
        .into_data()
        .convert_dtype(DType::F32)
        .to_vec::<f32>()
        .expect("f32 data")
}

pub fn widen<T: RefFloat>(values: &[T]) -> Vec<f32> {
    values.iter().map(|v| v.to_f32()).collect()
}

/// Rank-order reduction of `inputs` (one Vec per rank), element by element.
pub fn reduce<T: RefFloat>(inputs: &[Vec<T>], op: burn_zero_comm::ReduceOp) -> Vec<T> {
    use burn_zero_comm::ReduceOp;
    let n = inputs.len();
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = inputs[0][i];
            for input in &inputs[1..] {
                let x = input[i];
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Mean => acc + x,
                    ReduceOp::Max => {
                        if x > acc {
                            x
                        } else {
                            acc
                        }
                    }
                    ReduceOp::Min => {
                        if x < acc {
                            x
                        } else {
                            acc
                        }
                    }
                };
            }
            if op == ReduceOp::Mean && n > 1 {
                acc = acc / T::from_f32(n as f32);
            }
            acc
        })
        .collect()
}
