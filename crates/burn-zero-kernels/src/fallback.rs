//! Pack, unpack and cut with Burn tensor ops: works on every backend.
//!
//! This is the arithmetic the kernels reproduce: cast to the reduce dtype first, then divide
//! in that dtype; padding is zeros. Cutting a member out of an all-gathered chunk is a slice
//! (one rank) or its blocks joined (several); the cut kernel takes the slice for members that
//! are views.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Slice, Tensor, TensorMetadata, TensorPrimitive};

use crate::spec::{BucketSpec, GatheredMember, MemberSpec};

/// A bucket being assembled from `[rows, len]` blocks, concatenated at the end.
pub(crate) struct FallbackPacker<B: Backend> {
    spec: BucketSpec,
    device: B::Device,
    parts: Vec<Tensor<B, 2>>,
}

impl<B: Backend> FallbackPacker<B> {
    pub(crate) fn new(spec: BucketSpec, device: &B::Device) -> Self {
        Self {
            spec,
            device: device.clone(),
            parts: Vec::new(),
        }
    }

    /// Adds `member`'s block; sizes have been checked by the caller.
    pub(crate) fn push(&mut self, member: &MemberSpec, grad: Option<B::FloatTensorPrimitive>) {
        let BucketSpec {
            rows,
            dtype,
            predivide,
            ..
        } = self.spec;
        let values = grad.map(|grad| {
            let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
                grad,
                Shape::new([member.numel]),
            )));
            let flat = if flat.dtype() == dtype {
                flat
            } else {
                flat.cast(dtype)
            };
            if predivide == 1.0 {
                flat
            } else {
                flat.div_scalar(predivide)
            }
        });
        let padded = rows * member.len;
        let padding = padded - values.as_ref().map_or(0, |_| member.numel);
        let block = match (values, padding) {
            (Some(values), 0) => values,
            (Some(values), _) => Tensor::cat(
                vec![values, Tensor::zeros([padding], (&self.device, dtype))],
                0,
            ),
            (None, _) => Tensor::zeros([padded], (&self.device, dtype)),
        };
        self.parts.push(block.reshape([rows, member.len]));
    }

    /// The bucket, 1-D.
    pub(crate) fn finish(self) -> B::FloatTensorPrimitive {
        let numel = self.spec.numel();
        Tensor::cat(self.parts, 1)
            .reshape([numel])
            .into_primitive()
            .tensor()
    }
}

/// `reduced[offset..offset + len] / postdivide`, cast to `dtype`; arguments have been checked.
pub(crate) fn unpack<B: Backend>(
    reduced: &B::FloatTensorPrimitive,
    offset: usize,
    len: usize,
    postdivide: f64,
    dtype: DType,
) -> B::FloatTensorPrimitive {
    let part = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(reduced.clone()))
        .slice(offset..offset + len);
    let part = if postdivide == 1.0 {
        part
    } else {
        part.div_scalar(postdivide)
    };
    let part = if part.dtype() == dtype {
        part
    } else {
        part.cast(dtype)
    };
    part.into_primitive().tensor()
}

/// One member of an all-gathered chunk (see `cut_gathered`) with Burn's ops: a slice of the one row, or the member's blocks of every row
/// joined (a copy) and its padding cut off.
pub(crate) fn cut_member<B: Backend>(
    gathered: B::FloatTensorPrimitive,
    ranks: usize,
    member: &GatheredMember,
) -> B::FloatTensorPrimitive {
    let GatheredMember {
        offset,
        block_len,
        numel,
    } = *member;
    if ranks == 1 {
        return B::float_slice(gathered, &[Slice::from(offset..offset + numel)]);
    }
    let row = gathered.shape()[0] / ranks;
    let rows = B::float_reshape(gathered, Shape::new([ranks, row]));
    let blocks = B::float_slice(
        rows,
        &[
            Slice::from(0..ranks),
            Slice::from(offset..offset + block_len),
        ],
    );
    let flat = B::float_reshape(blocks, Shape::new([ranks * block_len]));
    B::float_slice(flat, &[Slice::from(0..numel)])
}
