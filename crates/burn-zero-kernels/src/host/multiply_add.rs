//! How a multiply feeding an add is rounded: the one arithmetic choice on which the optimizer
//! kernels of different backends part.
//!
//! Burn's element-wise ops round every multiply and every add to f32 on their own, and so do
//! the host passes and the wgpu kernels. CUDA's compiler (NVRTC) contracts `a * b + c` into
//! one fused multiply-add, rounded once, wherever it may, and cubecl gives no way to forbid it.
//! The CUDA kernels therefore write every such place out as `fma` themselves, which leaves the
//! compiler nothing to contract, and [`MultiplyAdd::Fused`] is the host pass with
//! `f32::mul_add` at exactly those places: the reference a CUDA kernel is equal to bit for bit.

/// The rounding of each `a·b + c` in an optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MultiplyAdd {
    /// The product rounded to f32, then the sum rounded: Burn's own ops, the host passes on
    /// Flex and NdArray, the wgpu kernels.
    #[default]
    Rounded,
    /// One fused multiply-add, rounded once: the CUDA kernels, whose places are listed with
    /// each step's arithmetic.
    Fused,
}

/// `a·b + c`, rounded once when `FUSED`, else twice. The optimizer passes are generic over
/// `FUSED`, so each loop is compiled with one rounding and nothing is decided per element.
#[inline(always)]
pub(crate) fn multiply_add<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED { a.mul_add(b, c) } else { a * b + c }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A product whose low bits the separate rounding drops and the fused one keeps.
    #[test]
    fn the_two_roundings_differ_where_the_product_is_inexact() {
        let a = 1.0 + f32::EPSILON;
        let (b, c) = (1.0 - f32::EPSILON, -1.0);
        // a·b = 1 − ε², which rounds to 1: the separate sum is 0, the fused one −ε².
        assert_eq!(multiply_add::<false>(a, b, c), 0.0);
        assert_eq!(
            multiply_add::<true>(a, b, c),
            -(f32::EPSILON * f32::EPSILON)
        );
    }
}
