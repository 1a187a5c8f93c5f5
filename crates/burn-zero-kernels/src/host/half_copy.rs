//! The half-precision copy a one-pass optimizer step writes beside its fp32 master.
//!
//! A half-precision model's parameters are the master's values cast after each step. Written
//! by the step's own pass, block by block while the updated values are still in cache, the
//! cast costs no second read of the master. The Adam and SGD passes share what is here: the
//! destination ([`HalfCopy`]), the conversion ([`CopyElement`]) and the block size.

use half::{bf16, f16};

/// Elements updated before their half-precision copy is written: small enough that the
/// updated values are still in the first-level cache when they are read again for the copy.
pub(super) const COPY_BLOCK: usize = 2048;

/// Where the parameter's new values go in half precision, written in the same pass as the
/// step: the cast a half-precision model needs after each step of its fp32 master.
#[derive(Debug)]
pub enum HalfCopy<'a> {
    /// IEEE half precision, converted as Flex's cast converts.
    F16(&'a mut [f16]),
    /// bfloat16, converted as Flex's cast converts (see `CopyElement` on how that rounds).
    Bf16(&'a mut [bf16]),
}

impl HalfCopy<'_> {
    /// The number of elements the copy holds.
    pub fn len(&self) -> usize {
        match self {
            Self::F16(copy) => copy.len(),
            Self::Bf16(copy) => copy.len(),
        }
    }

    /// Whether the copy holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A half-precision element a step's values are copied into.
///
/// Converted as Flex's cast converts (`from_f64` of the value widened to f64), not with
/// `from_f32`: the two differ. `half`'s `bf16::from_f64` drops the low 32 bits of the f64
/// before rounding, so an f32 whose discarded low bits decide a tie rounds to even where
/// `bf16::from_f32` rounds up (measured: one bf16 ulp on a few elements of a training run).
/// Calling the backend's own conversion keeps the copy bitwise Burn's cast.
pub(super) trait CopyElement: Copy + Send + Sync {
    fn from_f32(value: f32) -> Self;
}

impl CopyElement for f16 {
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        f16::from_f64(f64::from(value))
    }
}

impl CopyElement for bf16 {
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        bf16::from_f64(f64::from(value))
    }
}

/// Writes `values` into `copy`, element by element.
#[inline(always)]
pub(super) fn write_copy<T: CopyElement>(copy: &mut [T], values: &[f32]) {
    for (c, &p) in copy.iter_mut().zip(values) {
        *c = T::from_f32(p);
    }
}

/// An optional slice (a copy, a velocity) split into `parts` pieces of `per` elements (the
/// last shorter), or `parts` times nothing: one piece for each part of a pass that splits its
/// shard the same way.
pub(super) fn split_optional<T>(
    copy: Option<&mut [T]>,
    per: usize,
    parts: usize,
) -> Vec<Option<&mut [T]>> {
    match copy {
        Some(copy) => copy.chunks_mut(per).map(Some).collect(),
        None => (0..parts).map(|_| None).collect(),
    }
}
