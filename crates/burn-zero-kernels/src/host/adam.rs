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
    let len = param.len();
    assert!(
        grad.len() == len && m.len() == len && v.len() == len,
        "adam_step: parameter, gradient and moments must have one length ({len}, {}, {}, {})",
        grad.len(),
        m.len(),
        v.len()
    );
    let threads = threads.clamp(1, len.div_ceil(PER_THREAD).max(1));
    if threads == 1 {
        run(step, param, grad, m, v);
        return;
    }
    let per = len.div_ceil(threads);
    std::thread::scope(|scope| {
        let parts = param
            .chunks_mut(per)
            .zip(grad.chunks(per))
            .zip(m.chunks_mut(per))
            .zip(v.chunks_mut(per));
        for (((param, grad), m), v) in parts {
            scope.spawn(move || run(step, param, grad, m, v));
        }
    });
}

/// One thread's part, on the widest vector unit the processor has.
fn run(step: &AdamStep, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2 (checked just above), the only requirement of
        // `run_avx2`'s target feature; its body is safe code.
        unsafe { run_avx2(step, param, grad, m, v) };
        return;
    }
    run_portable(step, param, grad, m, v);
}

/// [`update`] compiled for AVX2 (8 lanes of f32). AVX2 does not bring fused multiply-add into
/// it: `fma` is a target feature of its own, not enabled here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn run_avx2(step: &AdamStep, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
    update(step, param, grad, m, v);
}

/// [`update`] for the baseline of the build's target.
fn run_portable(step: &AdamStep, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
    update(step, param, grad, m, v);
}

/// The pass itself. Inlined into each caller, so each gets its own vector width.
#[inline(always)]
fn update(step: &AdamStep, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
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
                    // Burn adds `p·λ + g`; addition commutes exactly in IEEE arithmetic.
                    g += *p * lambda;
                }
                moments(first, g, m, v, b1, b2, f1, f2);
                let u = (*m * c) / (v.sqrt() + eps);
                *p -= u * lr;
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
                moments(first, g, m, v, b1, b2, f1, f2);
                let u = (*m / c1) / ((*v / c2).sqrt() + eps);
                let kept = match keep {
                    Some(keep) => *p * keep,
                    None => *p,
                };
                *p = kept - u * lr;
            }
        }
    }
}

/// The moments' update for one element, as Burn's adaptive momentum computes it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn moments(first: bool, g: f32, m: &mut f32, v: &mut f32, b1: f32, b2: f32, f1: f32, f2: f32) {
    if first {
        *m = g * f1;
        *v = (g * g) * f2;
    } else {
        *m = *m * b1 + g * f1;
        *v = *v * b2 + (g * g) * f2;
    }
}

#[cfg(test)]
mod tests {
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
}
