//! One SGD step over flat host memory in a single pass: weight decay, momentum (with
//! dampening and Nesterov) and the parameter update read each element once, where Burn's `Sgd`
//! makes a pass through memory per tensor operation.
//!
//! The arithmetic is Burn's, operation by operation and in the same order, each result rounded
//! to f32 (no fused multiply-add), so the result is bitwise that of Burn's `Sgd` on Flex and
//! NdArray:
//!
//! - with a gradient multiplier (unscaling, clipping) `g ← g·factor`;
//! - with L2 weight decay `g ← p·λ + g`;
//! - with momentum, the first step `v ← g`, later ones `v ← g·(1−d) + v·μ`; then Nesterov
//!   `g ← v·μ + g`, otherwise `g ← v`;
//! - `p ← p − g·lr`.
//!
//! Large shards are split over threads; each thread's loop is compiled for the x86-64 baseline
//! and for AVX2, and the wider one runs where the processor has it. [`sgd_step_copying`] also
//! writes a half-precision model's new parameter in the same pass, as the Adam pass does.

use super::half_copy::{COPY_BLOCK, CopyElement, HalfCopy, split_optional, write_copy};
use super::multiply_add::{MultiplyAdd, multiply_add};

/// Momentum's scalars, each as Burn rounds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdMomentum {
    /// μ.
    pub momentum: f32,
    /// `1 − dampening`, computed in f64 and rounded to f32 as Burn does.
    pub keep_grad: f32,
    pub nesterov: bool,
    /// Whether the velocity is built from the gradient (Burn's first step: no velocity yet).
    pub first: bool,
}

/// The scalars of one SGD step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    /// The learning rate as an f32.
    pub lr: f32,
    /// The L2 penalty λ, if any.
    pub weight_decay: Option<f32>,
    /// Momentum, if any.
    pub momentum: Option<SgdMomentum>,
    /// The gradient's multiplier (unscaling and clipping), `None` for 1.
    pub factor: Option<f32>,
}

/// Shards below this many elements run on the calling thread.
const PER_THREAD: usize = 1 << 18;

/// Steps `param` with `grad`, updating `velocity` when the step has momentum (its contents are
/// ignored on the first step, which builds it from the gradient).
///
/// # Panics
/// When the lengths differ, or when the step has momentum and no velocity is given.
pub fn sgd_step(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
    threads: usize,
) {
    sgd_step_with(step, MultiplyAdd::Rounded, param, grad, velocity, threads);
}

/// [`sgd_step`] with the given rounding of its multiply-adds: [`MultiplyAdd::Rounded`] is
/// [`sgd_step`] itself; [`MultiplyAdd::Fused`] rounds each of these once, as the CUDA kernel
/// does: `p·λ + g` (the L2 penalty), `v·μ + g·(1−d)` (the velocity after the first step, the
/// product in the addend rounded on its own), Nesterov's `v·μ + g`, and the update `p − g·lr`
/// (as `(−g)·lr + p`).
///
/// # Panics
/// As [`sgd_step`].
pub fn sgd_step_with(
    step: &SgdStep,
    multiply_add: MultiplyAdd,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
    threads: usize,
) {
    let (velocity, threads) = checked(step, param.len(), grad, velocity, threads);
    let none = None::<&mut [half::f16]>;
    match multiply_add {
        MultiplyAdd::Rounded => drive::<_, false>(step, param, grad, velocity, none, threads),
        MultiplyAdd::Fused => drive::<_, true>(step, param, grad, velocity, none, threads),
    }
}

/// [`sgd_step`], also writing the parameter's new values into `copy` in half precision in the
/// same pass (each block converted right after its update, while it is in cache), rounded as
/// Burn's cast rounds on Flex.
///
/// # Panics
/// As [`sgd_step`], and when `copy`'s length differs from the parameter's.
pub fn sgd_step_copying(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
    copy: HalfCopy<'_>,
    threads: usize,
) {
    let len = param.len();
    assert_eq!(copy.len(), len, "sgd_step: copy length");
    let (velocity, threads) = checked(step, len, grad, velocity, threads);
    match copy {
        HalfCopy::F16(copy) => drive::<_, false>(step, param, grad, velocity, Some(copy), threads),
        HalfCopy::Bf16(copy) => drive::<_, false>(step, param, grad, velocity, Some(copy), threads),
    }
}

/// Checks the lengths; returns the velocity the pass writes (none without momentum) and the
/// threads it splits over.
fn checked<'v>(
    step: &SgdStep,
    len: usize,
    grad: &[f32],
    velocity: Option<&'v mut [f32]>,
    threads: usize,
) -> (Option<&'v mut [f32]>, usize) {
    assert_eq!(grad.len(), len, "sgd_step: gradient length");
    if let Some(v) = &velocity {
        assert_eq!(v.len(), len, "sgd_step: velocity length");
    }
    assert!(
        step.momentum.is_none() || velocity.is_some(),
        "sgd_step: a step with momentum needs a velocity buffer"
    );
    let velocity = if step.momentum.is_some() {
        velocity
    } else {
        None
    };
    (velocity, threads.clamp(1, len.div_ceil(PER_THREAD).max(1)))
}

/// Splits the pass over threads.
fn drive<T: CopyElement, const FUSED: bool>(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
    copy: Option<&mut [T]>,
    threads: usize,
) {
    let len = param.len();
    if threads == 1 {
        run::<T, FUSED>(step, param, grad, velocity, copy);
        return;
    }
    let per = len.div_ceil(threads);
    let parts = len.div_ceil(per);
    let velocities: Vec<Option<&mut [f32]>> = split_optional(velocity, per, parts);
    let copies = split_optional(copy, per, parts);
    std::thread::scope(|scope| {
        let parts = param
            .chunks_mut(per)
            .zip(grad.chunks(per))
            .zip(velocities)
            .zip(copies);
        for (((param, grad), v), copy) in parts {
            scope.spawn(move || run::<T, FUSED>(step, param, grad, v, copy));
        }
    });
}

/// One thread's part, on the widest vector unit the processor has.
fn run<T: CopyElement, const FUSED: bool>(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
    copy: Option<&mut [T]>,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2 (checked just above), the only requirement of
        // `run_avx2`'s target feature; its body is safe code.
        unsafe { run_avx2::<T, FUSED>(step, param, grad, velocity, copy) };
        return;
    }
    blocks::<T, FUSED>(step, param, grad, velocity, copy);
}

/// [`blocks`] compiled for AVX2 (no `fma`: that is a target feature of its own).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn run_avx2<T: CopyElement, const FUSED: bool>(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
    copy: Option<&mut [T]>,
) {
    blocks::<T, FUSED>(step, param, grad, velocity, copy);
}

/// The whole part in one [`update`] without a copy; with one, block by block, each block's
/// copy written right after its update.
#[inline(always)]
fn blocks<T: CopyElement, const FUSED: bool>(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
    copy: Option<&mut [T]>,
) {
    let Some(copy) = copy else {
        update::<FUSED>(step, param, grad, velocity);
        return;
    };
    let len = param.len();
    let velocities = split_optional(velocity, COPY_BLOCK, len.div_ceil(COPY_BLOCK));
    let parts = param
        .chunks_mut(COPY_BLOCK)
        .zip(grad.chunks(COPY_BLOCK))
        .zip(velocities)
        .zip(copy.chunks_mut(COPY_BLOCK));
    for (((param, grad), v), copy) in parts {
        update::<FUSED>(step, param, grad, v);
        write_copy(copy, param);
    }
}

/// The pass itself, one loop per option set so that each vectorises without branches.
#[inline(always)]
fn update<const FUSED: bool>(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
) {
    let lr = step.lr;
    let scale = |g: f32| match step.factor {
        Some(factor) => g * factor,
        None => g,
    };
    let decay = |p: f32, g: f32| match step.weight_decay {
        // Burn adds `p·λ + g`; addition commutes exactly in IEEE arithmetic.
        Some(lambda) => multiply_add::<FUSED>(p, lambda, g),
        None => g,
    };
    match (step.momentum, velocity) {
        (Some(mo), Some(velocity)) => {
            for ((p, &g), v) in param.iter_mut().zip(grad).zip(velocity) {
                let g = decay(*p, scale(g));
                *v = if mo.first {
                    g
                } else {
                    multiply_add::<FUSED>(*v, mo.momentum, g * mo.keep_grad)
                };
                let g = if mo.nesterov {
                    multiply_add::<FUSED>(*v, mo.momentum, g)
                } else {
                    *v
                };
                *p = multiply_add::<FUSED>(-g, lr, *p);
            }
        }
        _ => {
            for (p, &g) in param.iter_mut().zip(grad) {
                let g = decay(*p, scale(g));
                *p = multiply_add::<FUSED>(-g, lr, *p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn momentum(first: bool, nesterov: bool) -> SgdMomentum {
        SgdMomentum {
            momentum: 0.9,
            keep_grad: (1.0 - 0.1f64) as f32,
            nesterov,
            first,
        }
    }

    /// Two steps of one element by hand, Burn's order.
    #[test]
    fn one_element_by_hand() {
        let (mut p, g, mut v) = ([1.5f32], [0.25f32], [7.0f32]);
        let mut step = SgdStep {
            lr: 0.01,
            weight_decay: Some(0.05),
            momentum: Some(momentum(true, true)),
            factor: None,
        };
        sgd_step(&step, &mut p, &g, Some(&mut v), 1);
        let g1 = 1.5f32 * 0.05 + 0.25;
        let v1 = g1;
        let p1 = 1.5f32 - (v1 * 0.9 + g1) * 0.01;
        assert_eq!((p[0], v[0]), (p1, v1));
        step.momentum = Some(momentum(false, true));
        sgd_step(&step, &mut p, &g, Some(&mut v), 1);
        let g2 = p1 * 0.05 + 0.25;
        let v2 = g2 * 0.9f32 + v1 * 0.9;
        let p2 = p1 - (v2 * 0.9 + g2) * 0.01;
        assert_eq!((p[0], v[0]), (p2, v2));
    }

    #[test]
    fn threads_split_without_changing_a_bit() {
        let n = (PER_THREAD * 3) + 17;
        let grad: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) / 31.0).collect();
        let run = |threads| {
            let mut p: Vec<f32> = (0..n).map(|i| (i % 13) as f32 / 7.0).collect();
            let mut v = vec![0.0; n];
            for t in 0..3 {
                let step = SgdStep {
                    lr: 0.01,
                    weight_decay: Some(1e-3),
                    momentum: Some(momentum(t == 0, false)),
                    factor: Some(0.5),
                };
                sgd_step(&step, &mut p, &grad, Some(&mut v), threads);
            }
            (p, v)
        };
        assert_eq!(run(1), run(4));
    }

    /// The multiplier applies to the gradient before the weight decay, rounded on its own.
    #[test]
    fn the_factor_scales_the_gradient_first() {
        let (mut p, g, mut v) = ([1.5f32], [0.3f32], [0.0f32]);
        let step = SgdStep {
            lr: 0.01,
            weight_decay: Some(0.05),
            momentum: Some(momentum(true, false)),
            factor: Some(1.0 / 3.0),
        };
        sgd_step(&step, &mut p, &g, Some(&mut v), 1);
        let g1 = 1.5f32 * 0.05 + 0.3f32 * (1.0 / 3.0f32);
        assert_eq!((p[0], v[0]), (1.5f32 - g1 * 0.01, g1));
    }

    /// The copy is the stepped parameter cast element by element, whatever the split, with
    /// and without momentum.
    #[test]
    fn the_copy_is_the_cast_of_the_step() {
        use half::{bf16, f16};
        let n = (PER_THREAD * 2) + COPY_BLOCK + 5;
        let grad: Vec<f32> = (0..n).map(|i| ((i % 89) as f32 - 44.0) / 23.0).collect();
        let start: Vec<f32> = (0..n).map(|i| (i % 17) as f32 / 9.0 - 0.7).collect();
        for mo in [None, Some(momentum(false, true))] {
            let step = SgdStep {
                lr: 0.01,
                weight_decay: Some(0.01),
                momentum: mo,
                factor: Some(0.25),
            };
            let (mut p, mut v) = (start.clone(), vec![0.2; n]);
            sgd_step(&step, &mut p, &grad, Some(&mut v), 1);
            for threads in [1, 3] {
                let (mut q, mut v2) = (start.clone(), vec![0.2; n]);
                let mut halves = vec![f16::ZERO; n];
                let copy = HalfCopy::F16(&mut halves);
                sgd_step_copying(&step, &mut q, &grad, Some(&mut v2), copy, threads);
                assert_eq!((&q, &v2), (&p, &v));
                let (mut r, mut v3) = (start.clone(), vec![0.2; n]);
                let mut brains = vec![bf16::ZERO; n];
                let copy = HalfCopy::Bf16(&mut brains);
                sgd_step_copying(&step, &mut r, &grad, Some(&mut v3), copy, threads);
                assert_eq!((&r, &v3), (&p, &v));
                for i in 0..n {
                    let wide = f64::from(p[i]);
                    assert_eq!(halves[i].to_bits(), f16::from_f64(wide).to_bits());
                    assert_eq!(brains[i].to_bits(), bf16::from_f64(wide).to_bits());
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "copy length")]
    fn a_copy_of_another_length_is_refused() {
        let (mut p, g) = ([1.0f32; 4], [0.5f32; 4]);
        let mut short = [half::f16::ZERO; 3];
        let step = SgdStep {
            lr: 0.01,
            weight_decay: None,
            momentum: None,
            factor: None,
        };
        sgd_step_copying(&step, &mut p, &g, None, HalfCopy::F16(&mut short), 1);
    }
}
