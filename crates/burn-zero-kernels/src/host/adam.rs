//! One Adam or AdamW step over flat host memory in a single pass: each element's gradient,
//! moments and parameter are read once and written once, instead of a dozen passes (one per
//! tensor operation) through memory.
//!
//! The arithmetic is Burn's own, operation by operation and in the same order, each result
//! rounded to f32 (Rust never contracts `a * b + c` into a fused multiply-add by itself), so
//! the result is bitwise that of Burn's `Adam`/`AdamW` on Flex and NdArray, whose element-wise
//! ops round every operation to f32 as well:
//!
//! - Adam: `g ← g·factor`; with L2 weight decay `g ← p·λ + g`; the first step
//!   `m ← g·(1−β₁)`, `v ← (g·g)·(1−β₂)`, later ones `m ← m·β₁ + g·(1−β₁)`,
//!   `v ← v·β₂ + (g·g)·(1−β₂)`; then `p ← p − ((m·c) / (√v + ε·s))·lr` with `s = √(1−β₂ᵗ)`,
//!   `c = s / (1−β₁ᵗ)`.
//! - AdamW (decoupled decay): the same moments; `p ← p·(1 − lr·λ) − ((m / (1−β₁ᵗ)) /
//!   (√(v / (1−β₂ᵗ)) + ε))·lr`.
//!
//! Large shards are split over threads; each thread's loop is compiled twice, for the x86-64
//! baseline and for AVX2, and the wider one runs where the processor has it.
//!
//! A half-precision model's parameters are the master's values cast after the step;
//! [`adam_step_copying`] writes that cast in the same pass, block by block while the updated
//! values are in cache, instead of reading the whole master again.

use super::half_copy::{COPY_BLOCK, CopyElement, HalfCopy, split_optional, write_copy};
use super::multiply_add::{MultiplyAdd, multiply_add};

/// Which update rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AdamRule {
    /// Burn's `Adam`, with optional L2 weight decay `penalty` added to the gradient.
    Adam {
        /// The L2 penalty λ (`g ← p·λ + g`), if any.
        weight_decay: Option<f32>,
    },
    /// Burn's `AdamW`: the parameter is scaled by `keep = 1 − lr·λ` (rounded to f32 from f64,
    /// as Burn does) before the update, unless λ·lr is 0.
    AdamW {
        /// `1 − lr·λ` as Burn rounds it, or `None` when `lr·λ` is 0.
        keep: Option<f32>,
    },
}

/// The scalars of one step, each as Burn computes and rounds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub rule: AdamRule,
    /// The learning rate as an f32 (Burn's scalar ops round theirs to the element type).
    pub lr: f32,
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    /// The step number after this step (1 for the first).
    pub time: i32,
    /// The gradient's multiplier (unscaling and clipping), `None` for 1.
    pub factor: Option<f32>,
}

impl AdamStep {
    /// Whether this is the first step, which builds the moments from the gradient.
    fn first(&self) -> bool {
        self.time == 1
    }
}

/// Shards below this many elements run on the calling thread: a thread costs more than the
/// pass over a few hundred KiB.
const PER_THREAD: usize = 1 << 18;

/// Steps `param` with `grad`, updating the moments `m` and `v` (their contents are ignored on
/// the first step, whose moments come from the gradient). All four have the same length.
///
/// # Panics
/// When the lengths differ.
pub fn adam_step(
    step: &AdamStep,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    threads: usize,
) {
    adam_step_with(step, MultiplyAdd::Rounded, param, grad, m, v, threads);
}

/// [`adam_step`] with the given rounding of its multiply-adds: [`MultiplyAdd::Rounded`] is
/// [`adam_step`] itself; [`MultiplyAdd::Fused`] rounds each of these once, as the CUDA kernel
/// does: `p·λ + g` (Adam's L2 penalty), `m·β₁ + g·(1−β₁)` and `v·β₂ + (g·g)·(1−β₂)` (the
/// moments after the first step; the product in the addend is rounded on its own), and the
/// update `p − u·lr`, or `p·keep − u·lr` for AdamW (as `(−u)·lr + p`, the kept parameter
/// rounded on its own). Everything else is rounded as in [`adam_step`].
///
/// # Panics
/// When the lengths differ.
pub fn adam_step_with(
    step: &AdamStep,
    multiply_add: MultiplyAdd,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    threads: usize,
) {
    match multiply_add {
        MultiplyAdd::Rounded => drive::<half::f16, false>(step, param, grad, m, v, None, threads),
        MultiplyAdd::Fused => drive::<half::f16, true>(step, param, grad, m, v, None, threads),
    }
}

/// [`adam_step`], also writing the parameter's new values into `copy` in half precision in
/// the same pass (each element converted right after its update, while it is in cache).
///
/// # Panics
/// When the lengths differ.
pub fn adam_step_copying(
    step: &AdamStep,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    copy: HalfCopy<'_>,
    threads: usize,
) {
    match copy {
        HalfCopy::F16(copy) => drive::<_, false>(step, param, grad, m, v, Some(copy), threads),
        HalfCopy::Bf16(copy) => drive::<_, false>(step, param, grad, m, v, Some(copy), threads),
    }
}

/// Checks the lengths and splits the pass over threads.
fn drive<T: CopyElement, const FUSED: bool>(
    step: &AdamStep,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [T]>,
    threads: usize,
) {
    let len = param.len();
    let copy_len = copy.as_ref().map_or(len, |c| c.len());
    assert!(
        grad.len() == len && m.len() == len && v.len() == len && copy_len == len,
        "adam_step: parameter, gradient, moments and copy must have one length ({len}, {}, {}, \
         {}, {copy_len})",
        grad.len(),
        m.len(),
        v.len()
    );
    let threads = threads.clamp(1, len.div_ceil(PER_THREAD).max(1));
    if threads == 1 {
        run::<T, FUSED>(step, param, grad, m, v, copy);
        return;
    }
    let per = len.div_ceil(threads);
    let copies = split_optional(copy, per, len.div_ceil(per));
    std::thread::scope(|scope| {
        let parts = param
            .chunks_mut(per)
            .zip(grad.chunks(per))
            .zip(m.chunks_mut(per))
            .zip(v.chunks_mut(per))
            .zip(copies);
        for ((((param, grad), m), v), copy) in parts {
            scope.spawn(move || run::<T, FUSED>(step, param, grad, m, v, copy));
        }
    });
}

/// One thread's part, on the widest vector unit the processor has.
fn run<T: CopyElement, const FUSED: bool>(
    step: &AdamStep,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [T]>,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2 (checked just above), the only requirement of
        // `run_avx2`'s target feature; its body is safe code.
        unsafe { run_avx2::<T, FUSED>(step, param, grad, m, v, copy) };
        return;
    }
    run_portable::<T, FUSED>(step, param, grad, m, v, copy);
}

/// [`blocks`] compiled for AVX2 (8 lanes of f32). AVX2 does not bring fused multiply-add
/// into it: `fma` is a target feature of its own, not enabled here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn run_avx2<T: CopyElement, const FUSED: bool>(
    step: &AdamStep,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [T]>,
) {
    blocks::<T, FUSED>(step, param, grad, m, v, copy);
}

/// [`blocks`] for the baseline of the build's target.
fn run_portable<T: CopyElement, const FUSED: bool>(
    step: &AdamStep,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [T]>,
) {
    blocks::<T, FUSED>(step, param, grad, m, v, copy);
}

/// The whole part in one [`update`] without a copy; with one, block by block, each block's
/// copy written right after its update.
#[inline(always)]
fn blocks<T: CopyElement, const FUSED: bool>(
    step: &AdamStep,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<&mut [T]>,
) {
    let Some(copy) = copy else {
        update::<FUSED>(step, param, grad, m, v);
        return;
    };
    let parts = param
        .chunks_mut(COPY_BLOCK)
        .zip(grad.chunks(COPY_BLOCK))
        .zip(m.chunks_mut(COPY_BLOCK))
        .zip(v.chunks_mut(COPY_BLOCK))
        .zip(copy.chunks_mut(COPY_BLOCK));
    for ((((param, grad), m), v), copy) in parts {
        update::<FUSED>(step, param, grad, m, v);
        write_copy(copy, param);
    }
}

/// The pass itself. Inlined into each caller, so each gets its own vector width.
#[inline(always)]
fn update<const FUSED: bool>(
    step: &AdamStep,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let (b1, b2, lr) = (step.beta_1, step.beta_2, step.lr);
    let (f1, f2) = (1.0 - b1, 1.0 - b2);
    let t = step.time;
    let first = step.first();
    let factor = step.factor;
    match step.rule {
        AdamRule::Adam { weight_decay } => {
            let s = (1.0 - b2.powi(t)).sqrt();
            let c = s / (1.0 - b1.powi(t));
            let eps = step.epsilon * s;
            for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(m).zip(v) {
                let mut g = match factor {
                    Some(factor) => g * factor,
                    None => g,
                };
                if let Some(lambda) = weight_decay {
                    // Burn adds `p·λ + g`.
                    g = multiply_add::<FUSED>(*p, lambda, g);
                }
                moments::<FUSED>(first, g, m, v, b1, b2, f1, f2);
                let u = (*m * c) / (v.sqrt() + eps);
                // `p − u·lr`: negating is exact, so rounded separately this is Burn's sum.
                *p = multiply_add::<FUSED>(-u, lr, *p);
            }
        }
        AdamRule::AdamW { keep } => {
            let c1 = 1.0 - b1.powi(t);
            let c2 = 1.0 - b2.powi(t);
            let eps = step.epsilon;
            for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(m).zip(v) {
                let g = match factor {
                    Some(factor) => g * factor,
                    None => g,
                };
                moments::<FUSED>(first, g, m, v, b1, b2, f1, f2);
                let u = (*m / c1) / ((*v / c2).sqrt() + eps);
                let kept = match keep {
                    Some(keep) => *p * keep,
                    None => *p,
                };
                *p = multiply_add::<FUSED>(-u, lr, kept);
            }
        }
    }
}

/// The moments' update for one element, as Burn's adaptive momentum computes it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn moments<const FUSED: bool>(
    first: bool,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    b1: f32,
    b2: f32,
    f1: f32,
    f2: f32,
) {
    if first {
        *m = g * f1;
        *v = (g * g) * f2;
    } else {
        *m = multiply_add::<FUSED>(*m, b1, g * f1);
        *v = multiply_add::<FUSED>(*v, b2, (g * g) * f2);
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    fn step(rule: AdamRule, time: i32, factor: Option<f32>) -> AdamStep {
        AdamStep {
            rule,
            lr: 0.01,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            time,
            factor,
        }
    }

    /// One element by hand, Burn's order.
    #[test]
    fn one_element_by_hand() {
        let (mut p, g, mut m, mut v) = ([1.5f32], [0.25f32], [0.0f32], [0.0f32]);
        adam_step(
            &step(AdamRule::Adam { weight_decay: None }, 1, None),
            &mut p,
            &g,
            &mut m,
            &mut v,
            1,
        );
        let m1 = 0.25f32 * (1.0 - 0.9f32);
        let v1 = (0.25f32 * 0.25f32) * (1.0 - 0.999f32);
        let s = (1.0 - 0.999f32.powi(1)).sqrt();
        let c = s / (1.0 - 0.9f32.powi(1));
        let want = 1.5f32 - ((m1 * c) / (v1.sqrt() + 1e-5f32 * s)) * 0.01f32;
        assert_eq!((m[0], v[0], p[0]), (m1, v1, want));
    }

    /// A later AdamW step and an L2 Adam step of one element by hand, with the multiply-adds
    /// fused where the CUDA kernel fuses them.
    #[test]
    fn fused_multiply_adds_by_hand() {
        let (p0, g, m0, v0) = (1.5f32, 0.25f32, 0.125f32, 0.0625f32);
        let (lr, b1, b2, eps) = (0.01f32, 0.9f32, 0.999f32, 1e-5f32);
        let (f1, f2) = (1.0 - b1, 1.0 - b2);
        let m1 = m0.mul_add(b1, g * f1);
        let v1 = v0.mul_add(b2, (g * g) * f2);

        let keep = 0.999f32;
        let w = step(AdamRule::AdamW { keep: Some(keep) }, 2, None);
        let (mut p, mut m, mut v) = ([p0], [m0], [v0]);
        adam_step_with(&w, MultiplyAdd::Fused, &mut p, &[g], &mut m, &mut v, 1);
        let u = (m1 / (1.0 - b1.powi(2))) / ((v1 / (1.0 - b2.powi(2))).sqrt() + eps);
        assert_eq!((m[0], v[0], p[0]), (m1, v1, (-u).mul_add(lr, p0 * keep)));

        let l2 = step(
            AdamRule::Adam {
                weight_decay: Some(0.5),
            },
            2,
            None,
        );
        let (mut p, mut m, mut v) = ([p0], [m0], [v0]);
        adam_step_with(&l2, MultiplyAdd::Fused, &mut p, &[g], &mut m, &mut v, 1);
        let g = p0.mul_add(0.5, g);
        let (m1, v1) = (m0.mul_add(b1, g * f1), v0.mul_add(b2, (g * g) * f2));
        let s = (1.0 - b2.powi(2)).sqrt();
        let u = (m1 * (s / (1.0 - b1.powi(2)))) / (v1.sqrt() + eps * s);
        assert_eq!((m[0], v[0], p[0]), (m1, v1, (-u).mul_add(lr, p0)));
    }

    #[test]
    fn threads_split_without_changing_a_bit() {
        let n = (PER_THREAD * 3) + 17;
        let grad: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) / 31.0).collect();
        let run = |threads| {
            let mut p: Vec<f32> = (0..n).map(|i| (i % 13) as f32 / 7.0).collect();
            let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
            for t in 1..=3 {
                let s = step(
                    AdamRule::AdamW {
                        keep: Some(0.999_99),
                    },
                    t,
                    Some(0.5),
                );
                adam_step(&s, &mut p, &grad, &mut m, &mut v, threads);
            }
            (p, m, v)
        };
        assert_eq!(run(1), run(4));
    }

    /// The copy is the stepped parameter cast element by element, whatever the split.
    #[test]
    fn the_copy_is_the_cast_of_the_step() {
        let n = (PER_THREAD * 2) + COPY_BLOCK + 5;
        let grad: Vec<f32> = (0..n).map(|i| ((i % 89) as f32 - 44.0) / 23.0).collect();
        let start: Vec<f32> = (0..n).map(|i| (i % 17) as f32 / 9.0 - 0.7).collect();
        let s = step(
            AdamRule::Adam {
                weight_decay: Some(0.01),
            },
            2,
            Some(0.25),
        );
        let (mut p, mut m, mut v) = (start.clone(), vec![0.1; n], vec![0.2; n]);
        adam_step(&s, &mut p, &grad, &mut m, &mut v, 1);
        for threads in [1, 3] {
            let (mut q, mut m2, mut v2) = (start.clone(), vec![0.1; n], vec![0.2; n]);
            let (mut halves, mut brains) = (vec![f16::ZERO; n], vec![bf16::ZERO; n]);
            let copy = HalfCopy::F16(&mut halves);
            adam_step_copying(&s, &mut q, &grad, &mut m2, &mut v2, copy, threads);
            assert_eq!((&q, &m2, &v2), (&p, &m, &v));
            let (mut r, mut m3, mut v3) = (start.clone(), vec![0.1; n], vec![0.2; n]);
            let copy = HalfCopy::Bf16(&mut brains);
            adam_step_copying(&s, &mut r, &grad, &mut m3, &mut v3, copy, threads);
            assert_eq!(r, p);
            for i in 0..n {
                let wide = f64::from(p[i]);
                assert_eq!(halves[i].to_bits(), f16::from_f64(wide).to_bits());
                assert_eq!(brains[i].to_bits(), bf16::from_f64(wide).to_bits());
            }
        }
    }

    #[test]
    #[should_panic(expected = "one length")]
    fn a_copy_of_another_length_is_refused() {
        let (mut p, g, mut m, mut v) = ([1.0f32; 4], [0.5f32; 4], [0.0f32; 4], [0.0f32; 4]);
        let mut short = [f16::ZERO; 3];
        let s = step(AdamRule::Adam { weight_decay: None }, 1, None);
        adam_step_copying(&s, &mut p, &g, &mut m, &mut v, HalfCopy::F16(&mut short), 1);
    }
}
