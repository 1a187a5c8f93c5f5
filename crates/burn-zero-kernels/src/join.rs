//! `join`: flat tensors end to end, as one tensor of one dtype.
//!
//! Burn's `cat` copies each part with a launch of its own on the cubecl backends (a slice
//! assignment per part). A join is a bucket of one row whose members are the parts, with
//! nothing to divide and no padding, so it takes the pack paths: the kernels copy up to 16
//! parts a launch, the host path one loop per part into one buffer, Burn's ops elsewhere.
//! A chunk whose parts the step must join (replicated gradients, delivered member by member)
//! then costs a launch per batch of members instead of one per member.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, TensorMetadata};

use crate::KernelError;
use crate::pack::Packer;
use crate::spec::{BucketSpec, MemberSpec, PackPath, is_float};

/// `parts` (any shapes) flattened and joined end to end, in their order, each cast to `dtype`
/// as Burn's cast casts: one 1-D tensor on `device`, bit for bit the parts' values. One part is
/// flattened and cast without a copy of its own; no part, or parts without elements, give an
/// empty tensor.
///
/// `path` picks the implementation as it does for a bucket ([`PackPath`]). Errors name a
/// `dtype` that is not a float type, and a part that is not a float tensor or lives on another
/// device.
pub fn join<B: Backend>(
    parts: Vec<B::FloatTensorPrimitive>,
    dtype: DType,
    device: &B::Device,
    path: PackPath,
) -> Result<B::FloatTensorPrimitive, KernelError> {
    if !is_float(dtype) {
        return Err(KernelError::UnsupportedDType { dtype, path: "any" });
    }
    let total: usize = parts.iter().map(|p| p.shape().num_elements()).sum();
    if parts.len() == 1 || total == 0 {
        let flat = match parts.into_iter().next() {
            Some(part) => B::float_reshape(part, Shape::new([total])),
            None => B::float_zeros(Shape::new([0]), device, dtype.into()),
        };
        return Ok(if flat.dtype() == dtype {
            flat
        } else {
            B::float_cast(flat, dtype.into())
        });
    }
    let spec = BucketSpec {
        rows: 1,
        row_len: total,
        dtype,
        predivide: 1.0,
    };
    let mut packer = Packer::<B>::new(spec, device, path)?;
    let mut offset = 0;
    for part in parts {
        let numel = part.shape().num_elements();
        let member = MemberSpec {
            numel,
            len: numel,
            offset,
        };
        packer.push(&member, Some(part))?;
        offset += numel;
    }
    packer.finish()
}

#[cfg(test)]
mod tests {
    //! Expectations are Burn's own `cat` of the same parts.

    use burn::backend::Flex;
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};

    use super::*;

    type B = Flex;

    fn part(values: &[f32], dtype: DType) -> Tensor<B, 1> {
        Tensor::<B, 1>::from_data(TensorData::from(values), &Default::default()).cast(dtype)
    }

    fn joined(parts: &[Tensor<B, 1>], dtype: DType, path: PackPath) -> Tensor<B, 1> {
        let primitives = parts
            .iter()
            .map(|p| p.clone().into_primitive().tensor())
            .collect();
        let raw = join::<B>(primitives, dtype, &Default::default(), path).unwrap();
        Tensor::from_primitive(TensorPrimitive::Float(raw))
    }

    #[test]
    fn a_join_is_burns_cat_of_the_parts_cast() {
        let values: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 5.0).collect();
        for from in [DType::F32, DType::F16, DType::BF16] {
            let parts = vec![
                part(&values[..5], from),
                part(&values[5..6], from),
                part(&values[6..], from),
            ];
            for to in [DType::F32, DType::F16] {
                let cast: Vec<_> = parts.iter().map(|p| p.clone().cast(to)).collect();
                let expected = Tensor::cat(cast, 0).into_data();
                for path in [PackPath::Auto, PackPath::Host, PackPath::Fallback] {
                    let got = joined(&parts, to, path).into_data();
                    assert_eq!(got.dtype, to, "{from:?} → {to:?} on {path:?}");
                    assert_eq!(got.as_bytes(), expected.as_bytes(), "{from:?} → {to:?}");
                }
            }
        }
    }

    #[test]
    fn one_part_or_none_needs_no_bucket() {
        let one = part(&[1.0, 2.0, 3.0], DType::F32).reshape([3]);
        let got = joined(std::slice::from_ref(&one), DType::F32, PackPath::Auto);
        assert_eq!(got.into_data(), one.into_data());
        let none = joined(&[], DType::F32, PackPath::Auto);
        assert_eq!(none.dims(), [0]);
        let empty = part(&[], DType::F32);
        let got = joined(&[empty.clone(), empty], DType::F16, PackPath::Auto);
        assert_eq!((got.dims(), got.dtype()), ([0], DType::F16));
    }

    #[test]
    fn a_dtype_that_is_not_a_float_is_refused_by_name() {
        let parts = [part(&[1.0], DType::F32), part(&[2.0], DType::F32)];
        for dtype in [DType::I32, DType::U8, DType::I64] {
            let primitives = parts
                .iter()
                .map(|p| p.clone().into_primitive().tensor())
                .collect();
            let error = join::<B>(primitives, dtype, &Default::default(), PackPath::Auto)
                .expect_err("an integer join is refused");
            assert!(
                matches!(error, KernelError::UnsupportedDType { dtype: d, .. } if d == dtype),
                "{dtype:?}: {error}"
            );
        }
    }
}
