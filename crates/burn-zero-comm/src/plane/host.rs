//! Data movement on host memory, for CPU backends (Flex, NdArray).
//!
//! On these backends a collective is a loop over slices: `LocalGroup`'s ranks read each
//! other's buffers in place (every rank's tensors live in the same process memory), and
//! `MpiGroup` reads what MPI received; either writes its result into a buffer of the rank's
//! own pool, reused from call to call (see [`BufferPool`]). The arithmetic is
//! [`HostFloat`]'s, which reproduces the backends' own tensor ops, and the reduction order is
//! rank order, so results are bitwise those of the Burn-ops path ([`super::fold_parts`]).

use std::ops::Range;

#[cfg(feature = "mpi")]
use burn::tensor::DType;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_zero_kernels::host::{
    BufferPool, FloatVisitor, HostBackend, HostFloat, HostTensor, visit,
};

use crate::call::ReduceOp;

/// Elements folded per chunk: the partial result stays in L1 cache while each further rank's
/// values are added to it, so a reduction over `n` ranks still reads each input once and
/// writes the result once.
const CHUNK: usize = 4096;

/// One rank's host data plane: which backend, and the pool its results are written into.
pub(crate) struct HostPlane {
    backend: HostBackend,
    pool: BufferPool,
}

impl HostPlane {
    /// The host data plane for `B`, when `B` is a host backend.
    pub fn new<B: Backend>() -> Option<Self> {
        Some(Self {
            backend: HostBackend::of::<B>()?,
            pool: BufferPool::default(),
        })
    }

    /// `tensor` as contiguous host memory; `None` (use the Burn-ops path) when it is not a
    /// host tensor of a dtype this backend stores.
    pub fn view<B: Backend>(&self, tensor: &Tensor<B, 1>) -> Option<HostTensor> {
        self.views(std::iter::once(tensor))?.pop()
    }

    /// A buffer of `numel` elements of `dtype` from the pool, no other tensor sharing it
    /// (`None` for a dtype this backend does not store); give it back with
    /// [`HostPlane::keep`] once written.
    #[cfg(feature = "mpi")]
    pub fn take(&self, dtype: DType, numel: usize) -> Option<HostTensor> {
        if !self.backend.supports(dtype) {
            return None;
        }
        visit(
            dtype,
            Take {
                backend: self.backend,
                pool: &self.pool,
                numel,
            },
        )
    }

    /// Remembers a buffer of [`HostPlane::take`] for reuse once every tensor made from it is
    /// dropped.
    #[cfg(feature = "mpi")]
    pub fn keep(&self, buffer: &HostTensor) {
        self.pool.keep(buffer);
    }

    /// A tensor of `B` from a buffer of this plane.
    pub fn tensor<B: Backend>(host: HostTensor) -> Tensor<B, 1> {
        Tensor::from_primitive(TensorPrimitive::Float(host.into_primitive::<B>()))
    }

    /// The `parts` (equal, consecutive ranges of `buffer`, one per rank) reduced element by
    /// element in rank order into a pooled buffer: what `LocalGroup::reduce_scatter` computes
    /// from the ranks' buffers, from their blocks received end to end. `None` when `buffer`
    /// is not of a dtype this plane reduces.
    pub fn reduce_parts(
        &self,
        buffer: &HostTensor,
        parts: usize,
        op: ReduceOp,
    ) -> Option<HostTensor> {
        visit(
            buffer.dtype(),
            ReduceParts {
                backend: self.backend,
                pool: &self.pool,
                buffer,
                parts,
                op,
            },
        )?
    }

    /// The tensors as contiguous host memory; `None` (use the Burn-ops path) when one is not
    /// a host tensor of a dtype this backend stores.
    fn views<'a, B: Backend>(
        &self,
        tensors: impl Iterator<Item = &'a Tensor<B, 1>>,
    ) -> Option<Vec<HostTensor>> {
        tensors
            .map(|tensor| {
                let tensor = tensor.clone().into_primitive().tensor();
                let host = HostTensor::from_primitive::<B>(tensor).ok()?;
                self.backend
                    .supports(host.dtype())
                    .then(|| host.into_contiguous())
            })
            .collect()
    }

    /// The parts in order, end to end (absent ones are empty): all-gather's result, and
    /// all-reduce's second phase. `None` when they are not host tensors.
    pub fn concat<B: Backend>(&self, parts: &[Option<Tensor<B, 1>>]) -> Option<Tensor<B, 1>> {
        let parts = self.views(parts.iter().flatten())?;
        let dtype = parts.first()?.dtype();
        let out = visit(
            dtype,
            Concat {
                backend: self.backend,
                pool: &self.pool,
                parts: &parts,
            },
        )??;
        Some(Self::tensor(out))
    }

    /// `range` of every rank's buffer, reduced element by element in rank order. `None` when
    /// the buffers are not host tensors.
    pub fn reduce<B: Backend>(
        &self,
        buffers: &[Option<Tensor<B, 1>>],
        range: Range<usize>,
        op: ReduceOp,
    ) -> Option<Tensor<B, 1>> {
        if buffers.iter().any(Option::is_none) {
            return None;
        }
        let inputs = self.views(buffers.iter().flatten())?;
        let dtype = inputs.first()?.dtype();
        let out = visit(
            dtype,
            Reduce {
                backend: self.backend,
                pool: &self.pool,
                inputs: &inputs,
                range,
                op,
            },
        )??;
        Some(Self::tensor(out))
    }
}

/// Writes the parts end to end into a pooled buffer of their element type `E`.
struct Concat<'a> {
    backend: HostBackend,
    pool: &'a BufferPool,
    parts: &'a [HostTensor],
}

impl FloatVisitor for Concat<'_> {
    type Output = Option<HostTensor>;

    fn visit<E: HostFloat>(self) -> Option<HostTensor> {
        let parts: Vec<&[E]> = self
            .parts
            .iter()
            .map(|part| part.as_slice::<E>())
            .collect::<Option<_>>()?;
        let numel = parts.iter().map(|part| part.len()).sum();
        let mut out = self.pool.take::<E>(self.backend, numel);
        let dst = out.as_mut_slice::<E>()?;
        let mut start = 0;
        for part in parts {
            dst[start..start + part.len()].copy_from_slice(part);
            start += part.len();
        }
        self.pool.keep(&out);
        Some(out)
    }
}

/// Takes a pooled buffer of element type `E`.
#[cfg(feature = "mpi")]
struct Take<'a> {
    backend: HostBackend,
    pool: &'a BufferPool,
    numel: usize,
}

#[cfg(feature = "mpi")]
impl FloatVisitor for Take<'_> {
    type Output = HostTensor;

    fn visit<E: HostFloat>(self) -> HostTensor {
        self.pool.take::<E>(self.backend, self.numel)
    }
}

/// Reduces the consecutive parts of one buffer into a pooled buffer of their element type.
struct ReduceParts<'a> {
    backend: HostBackend,
    pool: &'a BufferPool,
    buffer: &'a HostTensor,
    parts: usize,
    op: ReduceOp,
}

impl FloatVisitor for ReduceParts<'_> {
    type Output = Option<HostTensor>;

    fn visit<E: HostFloat>(self) -> Option<HostTensor> {
        let all = self.buffer.as_slice::<E>()?;
        let len = all.len() / self.parts.max(1);
        let inputs: Vec<&[E]> = all.chunks_exact(len.max(1)).take(self.parts).collect();
        let mut out = self.pool.take::<E>(self.backend, len);
        if len > 0 {
            reduce_into(out.as_mut_slice::<E>()?, &inputs, self.op);
        }
        self.pool.keep(&out);
        Some(out)
    }
}

/// Reduces a range of the inputs into a pooled buffer of their element type `E`.
struct Reduce<'a> {
    backend: HostBackend,
    pool: &'a BufferPool,
    inputs: &'a [HostTensor],
    range: Range<usize>,
    op: ReduceOp,
}

impl FloatVisitor for Reduce<'_> {
    type Output = Option<HostTensor>;

    fn visit<E: HostFloat>(self) -> Option<HostTensor> {
        let inputs: Vec<&[E]> = self
            .inputs
            .iter()
            .map(|input| input.as_slice::<E>().map(|all| &all[self.range.clone()]))
            .collect::<Option<_>>()?;
        let mut out = self.pool.take::<E>(self.backend, self.range.len());
        reduce_into(out.as_mut_slice::<E>()?, &inputs, self.op);
        self.pool.keep(&out);
        Some(out)
    }
}

/// `out[i] = inputs[0][i] op inputs[1][i] op …`, left to right (rank order), then divided by
/// the number of inputs for a mean of more than one: the Burn-ops path's fold, element for
/// element.
fn reduce_into<E: HostFloat>(out: &mut [E], inputs: &[&[E]], op: ReduceOp) {
    let mean = (op == ReduceOp::Mean && inputs.len() > 1).then(|| E::divisor(inputs.len() as f64));
    for (index, out) in out.chunks_mut(CHUNK).enumerate() {
        let chunk = index * CHUNK..index * CHUNK + out.len();
        let (first, rest) = inputs.split_first().expect("a group has a rank");
        out.copy_from_slice(&first[chunk.clone()]);
        for input in rest {
            fold(out, &input[chunk.clone()], op);
        }
        if let Some(divisor) = mean {
            for value in out.iter_mut() {
                *value = value.div(divisor);
            }
        }
    }
}

/// `acc[i] = acc[i] op values[i]`.
#[inline]
fn fold<E: HostFloat>(acc: &mut [E], values: &[E], op: ReduceOp) {
    let pairs = acc.iter_mut().zip(values);
    match op {
        ReduceOp::Sum | ReduceOp::Mean => pairs.for_each(|(acc, &value)| *acc = acc.add(value)),
        ReduceOp::Max => pairs.for_each(|(acc, &value)| *acc = acc.max_pair(value)),
        ReduceOp::Min => pairs.for_each(|(acc, &value)| *acc = acc.min_pair(value)),
    }
}
