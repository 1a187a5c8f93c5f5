//! One SGD step over flat host memory in a single pass: weight decay, momentum (with
//! dampening and Nesterov) and the parameter update read each element once, where Burn's `Sgd`
//! makes a pass through memory per tensor operation.
//!
//! The arithmetic is Burn's, operation by operation and in the same order, each result rounded
//! to f32 (no fused multiply-add), so the result is bitwise that of Burn's `Sgd` on Flex and
//! NdArray:
//!
//! - with L2 weight decay `g ← p·λ + g`;
//! - with momentum, the first step `v ← g`, later ones `v ← g·(1−d) + v·μ`; then Nesterov
//!   `g ← v·μ + g`, otherwise `g ← v`;
//! - `p ← p − g·lr`.
//!
//! Large shards are split over threads; each thread's loop is compiled for the x86-64 baseline
//! and for AVX2, and the wider one runs where the processor has it.

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
}

use super::multiply_add::{MultiplyAdd, multiply_add};

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
    let len = param.len();
    assert_eq!(grad.len(), len, "sgd_step: gradient length");
    let mut velocity = velocity;
    if let Some(v) = &velocity {
        assert_eq!(v.len(), len, "sgd_step: velocity length");
    }
    assert!(
        step.momentum.is_none() || velocity.is_some(),
        "sgd_step: a step with momentum needs a velocity buffer"
    );
    if step.momentum.is_none() {
        velocity = None;
    }
    let threads = threads.clamp(1, len.div_ceil(PER_THREAD).max(1));
    match multiply_add {
        MultiplyAdd::Rounded => drive::<false>(step, param, grad, velocity, threads),
        MultiplyAdd::Fused => drive::<true>(step, param, grad, velocity, threads),
    }
}

/// Splits the pass over threads.
fn drive<const FUSED: bool>(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
    threads: usize,
) {
    let len = param.len();
    if threads == 1 {
        run::<FUSED>(step, param, grad, velocity);
        return;
    }
    let per = len.div_ceil(threads);
    std::thread::scope(|scope| match velocity {
        Some(velocity) => {
            let parts = param
                .chunks_mut(per)
                .zip(grad.chunks(per))
                .zip(velocity.chunks_mut(per));
            for ((param, grad), v) in parts {
                scope.spawn(move || run::<FUSED>(step, param, grad, Some(v)));
            }
        }
        None => {
            for (param, grad) in param.chunks_mut(per).zip(grad.chunks(per)) {
                scope.spawn(move || run::<FUSED>(step, param, grad, None));
            }
        }
    });
}

/// One thread's part, on the widest vector unit the processor has.
fn run<const FUSED: bool>(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2 (checked just above), the only requirement of
        // `run_avx2`'s target feature; its body is safe code.
        unsafe { run_avx2::<FUSED>(step, param, grad, velocity) };
        return;
    }
    update::<FUSED>(step, param, grad, velocity);
}

/// [`update`] compiled for AVX2 (no `fma`: that is a target feature of its own).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn run_avx2<const FUSED: bool>(
    step: &SgdStep,
    param: &mut [f32],
    grad: &[f32],
    velocity: Option<&mut [f32]>,
) {
    update::<FUSED>(step, param, grad, velocity);
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
    let decay = |p: f32, g: f32| match step.weight_decay {
        // Burn adds `p·λ + g`; addition commutes exactly in IEEE arithmetic.
        Some(lambda) => multiply_add::<FUSED>(p, lambda, g),
        None => g,
    };
    match (step.momentum, velocity) {
        (Some(mo), Some(velocity)) => {
            for ((p, &g), v) in param.iter_mut().zip(grad).zip(velocity) {
                let g = decay(*p, g);
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
                let g = decay(*p, g);
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
                };
                sgd_step(&step, &mut p, &grad, Some(&mut v), threads);
            }
            (p, v)
        };
        assert_eq!(run(1), run(4));
    }
}
