//! Test helpers: deterministic gradients, host-side values, and a host reference of the pack
//! and unpack arithmetic.

#![allow(dead_code)]

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorData, TensorPrimitive};
use burn_zero_kernels::{BucketSpec, GatheredMember, MemberSpec};
use half::{bf16, f16};

/// `n` values in `[-4, 4)` with full f64 mantissas, from `seed` (xorshift64*).
pub fn raw_values(seed: u64, n: usize) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
            (bits >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0
        })
        .collect()
}

/// `value` rounded to the nearest `dtype` value (ties to even), widened back to f64.
pub fn round_to(dtype: DType, value: f64) -> f64 {
    match dtype {
        DType::F32 => value as f32 as f64,
        DType::F16 => f16::from_f64(value).to_f64(),
        DType::BF16 => bf16::from_f64(value).to_f64(),
        other => panic!("no host reference for {other:?}"),
    }
}

/// `value / divisor` in `dtype` (`value` is a `dtype` value): one IEEE division in f32 for
/// f32; for f16/bf16, the f32 quotient of the widened operands rounded back, which is the
/// correctly rounded half-precision quotient (f32 has more than twice their precision).
pub fn div_in(dtype: DType, value: f64, divisor: f64) -> f64 {
    let divisor = round_to(dtype, divisor) as f32;
    round_to(dtype, (value as f32 / divisor) as f64)
}

/// `values` (each exactly representable in `dtype`) as `TensorData` of `dtype`.
pub fn data(dtype: DType, values: &[f64], shape: impl Into<Shape>) -> TensorData {
    match dtype {
        DType::F32 => TensorData::new(values.iter().map(|&v| v as f32).collect(), shape),
        DType::F16 => TensorData::new(values.iter().map(|&v| f16::from_f64(v)).collect(), shape),
        DType::BF16 => TensorData::new(values.iter().map(|&v| bf16::from_f64(v)).collect(), shape),
        other => panic!("no host data for {other:?}"),
    }
}

/// The values of `data`, widened to f64.
pub fn host(data: &TensorData) -> Vec<f64> {
    match data.dtype {
        DType::F32 => data
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        DType::F16 => data
            .to_vec::<f16>()
            .unwrap()
            .into_iter()
            .map(f16::to_f64)
            .collect(),
        DType::BF16 => data
            .to_vec::<bf16>()
            .unwrap()
            .into_iter()
            .map(bf16::to_f64)
            .collect(),
        other => panic!("no host values for {other:?}"),
    }
}

/// A gradient: its dtype, its shape and its values (exact in that dtype).
#[derive(Debug, Clone)]
pub struct Grad {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

impl Grad {
    /// `numel` values of `dtype` from `seed`, in a shape of `dims` dimensions.
    pub fn new(dtype: DType, seed: u64, numel: usize, dims: usize) -> Self {
        let values = raw_values(seed, numel)
            .into_iter()
            .map(|v| round_to(dtype, v))
            .collect();
        Self {
            dtype,
            shape: shape_of(numel, dims),
            values,
        }
    }

    /// The gradient as a float primitive of `B` on `device`.
    pub fn primitive<B: Backend>(&self, device: &B::Device) -> B::FloatTensorPrimitive {
        let flat = Tensor::<B, 1>::from_data(
            data(self.dtype, &self.values, [self.values.len()]),
            (device, self.dtype),
        );
        let flat = flat.into_primitive().tensor();
        B::float_reshape(flat, Shape::from(self.shape.clone()))
    }
}

/// A shape of `dims` dimensions with `numel` elements: the leading dims absorb small factors.
pub fn shape_of(numel: usize, dims: usize) -> Vec<usize> {
    let mut shape = vec![1; dims.max(1)];
    let mut rest = numel;
    for dim in shape.iter_mut().take(dims.saturating_sub(1)) {
        if let Some(f) = (2..=7).find(|&f| rest.is_multiple_of(f)) {
            *dim = f;
            rest /= f;
        }
    }
    *shape.last_mut().unwrap() = rest;
    shape
}

/// One test bucket: the spec, its members and their gradients (`None`: zeros).
#[derive(Debug, Clone)]
pub struct Case {
    pub spec: BucketSpec,
    pub members: Vec<(MemberSpec, Option<Grad>)>,
}

impl Case {
    /// Members of `numels` elements laid out in order, each `len = ceil(numel / rows)` plus
    /// `extra[i]` columns of padding. `grad_dtypes[i]` is member `i`'s gradient dtype, `None`
    /// for a member without a gradient.
    pub fn new(
        rows: usize,
        dtype: DType,
        predivide: f64,
        numels: &[usize],
        extra: &[usize],
        grad_dtypes: &[Option<DType>],
        seed: u64,
    ) -> Self {
        let mut offset = 0;
        let mut members = Vec::new();
        for (i, &numel) in numels.iter().enumerate() {
            let len = numel.div_ceil(rows) + extra[i];
            let member = MemberSpec { numel, len, offset };
            let grad = grad_dtypes[i].map(|g| Grad::new(g, seed + i as u64, numel, 1 + i % 3));
            members.push((member, grad));
            offset += len;
        }
        Self {
            spec: BucketSpec {
                rows,
                row_len: offset,
                dtype,
                predivide,
            },
            members,
        }
    }

    /// The packed bucket computed on the host.
    pub fn reference(&self) -> TensorData {
        let spec = &self.spec;
        let mut out = vec![f64::NAN; spec.rows * spec.row_len];
        for (member, grad) in &self.members {
            for i in 0..spec.rows * member.len {
                let value = match grad {
                    Some(grad) if i < member.numel => {
                        let v = round_to(spec.dtype, grad.values[i]);
                        if spec.predivide == 1.0 {
                            v
                        } else {
                            div_in(spec.dtype, v, spec.predivide)
                        }
                    }
                    _ => 0.0,
                };
                out[(i / member.len) * spec.row_len + member.offset + i % member.len] = value;
            }
        }
        assert!(
            out.iter().all(|v| !v.is_nan()),
            "members must cover the bucket"
        );
        data(spec.dtype, &out, [out.len()])
    }
}

/// Host reference of `unpack`: `row[offset..offset + len] / postdivide` in the row's dtype,
/// then rounded to `dtype`.
pub fn reference_unpack(
    row: &TensorData,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
) -> TensorData {
    let values: Vec<f64> = host(row)[offset..offset + len]
        .iter()
        .map(|&v| {
            let v = if postdivide == 1.0 {
                v
            } else {
                div_in(row.dtype, v, postdivide)
            };
            round_to(dtype, v)
        })
        .collect();
    data(dtype, &values, [len])
}

/// The data of a float primitive.
pub fn read<B: Backend>(tensor: B::FloatTensorPrimitive) -> TensorData {
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(tensor)).into_data()
}

/// Panics unless `actual` and `expected` have the same dtype, shape and bytes, naming the
/// first differing element.
pub fn assert_bitwise(actual: &TensorData, expected: &TensorData, what: &str) {
    assert_eq!(actual.dtype, expected.dtype, "{what}: dtype");
    assert_eq!(actual.shape, expected.shape, "{what}: shape");
    if actual.as_bytes() != expected.as_bytes() {
        let (a, e) = (host(actual), host(expected));
        let i = (0..a.len())
            .find(|&i| a[i].to_bits() != e[i].to_bits())
            .unwrap_or(0);
        panic!(
            "{what}: {} of {} element(s) differ; first at {i}: {} != {}",
            (0..a.len())
                .filter(|&i| a[i].to_bits() != e[i].to_bits())
                .count(),
            a.len(),
            a[i],
            e[i]
        );
    }
}

/// The members of a chunk of members of `numels` elements gathered from `ranks` ranks: each
/// rank's row holds their blocks end to end, `ceil(numel / ranks)` elements each. Returns them
/// and the row's length.
pub fn gathered_members(ranks: usize, numels: &[usize]) -> (Vec<GatheredMember>, usize) {
    let mut offset = 0;
    let members = numels
        .iter()
        .map(|&numel| {
            let block_len = numel.div_ceil(ranks);
            let member = GatheredMember {
                offset,
                block_len,
                numel,
            };
            offset += block_len;
            member
        })
        .collect();
    (members, offset)
}

/// Where element `k` of `member` sits in a gathered chunk of rows of `row` elements: in row
/// `k / block`, at the member's offset plus `k % block`.
pub fn gathered_at(member: &GatheredMember, row: usize, k: usize) -> usize {
    (k / member.block_len) * row + member.offset + k % member.block_len
}
