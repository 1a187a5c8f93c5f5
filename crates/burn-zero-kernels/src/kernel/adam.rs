//! Adam and AdamW: one launch steps a flat f32 shard (parameter, gradient, both moments).
//!
//! Per element the kernel does [`crate::host::adam_step_with`]'s arithmetic: Burn's operations
//! in Burn's order, on scalars computed and rounded on the host exactly as the host path
//! computes them ([`Scalars::of`]). With `fused` (CUDA, whose compiler contracts a multiply
//! and an add wherever it may) every multiply-add is written out as `fma`, at the places
//! [`MultiplyAdd::Fused`] lists, so nothing is left to contract; without it (wgpu) each
//! operation is rounded on its own, as Burn's ops round them.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use super::{
    address_type, check_flat_f32, copy_storage_type, from_cube, into_cube, storage_type,
    vector_size, writable_in_place,
};
use crate::KernelError;
use crate::host::{AdamRule, AdamStep, MultiplyAdd};

/// One Adam/AdamW step. Inputs (read-only) are `param`, `grad`, `m_in`, `v_in`, in that
/// order; each output is a buffer of its own or, when the input's buffer may be written, that
/// buffer (an alias of input 0, 2 or 3).
///
/// Scalars (each an f32 computed on the host):
/// - Adam: `bias_1 = c = s / (1−β₁ᵗ)` with `s = √(1−β₂ᵗ)`, `epsilon = ε·s`, `decay = λ`;
///   `bias_2` unused.
/// - AdamW: `bias_1 = 1−β₁ᵗ`, `bias_2 = 1−β₂ᵗ`, `epsilon = ε`, `decay = keep = 1 − lr·λ`.
///
/// Comptime flags: `first` builds the moments from the gradient (Burn's first step; the
/// moments' inputs are not read); otherwise `moments` says whether there are moments to read
/// (without, they are zero); `adamw` picks the rule; `decay` whether λ (Adam) or `keep`
/// (AdamW) applies; `scaled` whether the gradient is multiplied by `factor` first; `copy`
/// whether the new parameter is also written, cast to `H` (f16 or bf16), into `copy_out`
/// (without, `copy_out` is an alias of the never-written gradient and `H` is `F`); `fused`
/// whether each multiply-add is one `fma` (`neg_lr` is `−lr` for the update's).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
fn adam_update<F: Float, H: Float, N: Size>(
    param: &LinearView<Vector<F, N>>,
    grad: &LinearView<Vector<F, N>>,
    m_in: &LinearView<Vector<F, N>>,
    v_in: &LinearView<Vector<F, N>>,
    param_out: &mut LinearView<Vector<F, N>, ReadWrite>,
    m_out: &mut LinearView<Vector<F, N>, ReadWrite>,
    v_out: &mut LinearView<Vector<F, N>, ReadWrite>,
    copy_out: &mut LinearView<Vector<H, N>, ReadWrite>,
    lr: InputScalar,
    neg_lr: InputScalar,
    beta_1: InputScalar,
    beta_2: InputScalar,
    one_minus_beta_1: InputScalar,
    one_minus_beta_2: InputScalar,
    bias_1: InputScalar,
    bias_2: InputScalar,
    epsilon: InputScalar,
    decay: InputScalar,
    factor: InputScalar,
    #[comptime] first: bool,
    #[comptime] moments: bool,
    #[comptime] adamw: bool,
    #[comptime] decays: bool,
    #[comptime] scaled: bool,
    #[comptime] copy: bool,
    #[comptime] fused: bool,
    #[define(F, H)] _dtypes: [StorageType; 2],
) {
    if !param_out.is_in_bounds(ABSOLUTE_POS) {
        terminate!();
    }
    let p = param[ABSOLUTE_POS];
    let mut g = grad[ABSOLUTE_POS];
    if scaled {
        g *= Vector::new(factor.get::<F>());
    }
    if decays && !adamw {
        // Burn's L2 penalty: `p·λ + g` (the sum's operands commute exactly).
        let lambda = Vector::new(decay.get::<F>());
        if fused {
            g = fma(p, lambda, g);
        } else {
            g = p * lambda + g;
        }
    }
    let f1 = Vector::new(one_minus_beta_1.get::<F>());
    let f2 = Vector::new(one_minus_beta_2.get::<F>());
    let mut m = g * f1;
    let mut v = (g * g) * f2;
    if !first {
        let mut m_old = Vector::<F, N>::from_int(0);
        let mut v_old = Vector::<F, N>::from_int(0);
        if moments {
            m_old = m_in[ABSOLUTE_POS];
            v_old = v_in[ABSOLUTE_POS];
        }
        let (b1, b2) = (
            Vector::new(beta_1.get::<F>()),
            Vector::new(beta_2.get::<F>()),
        );
        if fused {
            m = fma(m_old, b1, m);
            v = fma(v_old, b2, v);
        } else {
            m = m_old * b1 + m;
            v = v_old * b2 + v;
        }
    }
    let epsilon = Vector::new(epsilon.get::<F>());
    let (lr, neg_lr) = (lr.get::<F>(), neg_lr.get::<F>());
    let mut next = p;
    if adamw {
        let u = (m / Vector::new(bias_1.get::<F>()))
            / (Vector::sqrt(v / Vector::new(bias_2.get::<F>())) + epsilon);
        if decays {
            next = p * Vector::new(decay.get::<F>());
        }
        next = descend(next, u, lr, neg_lr, fused);
    } else {
        let u = (m * Vector::new(bias_1.get::<F>())) / (Vector::sqrt(v) + epsilon);
        next = descend(next, u, lr, neg_lr, fused);
    }
    param_out[ABSOLUTE_POS] = next;
    if copy {
        copy_out[ABSOLUTE_POS] = Vector::cast_from(next);
    }
    m_out[ABSOLUTE_POS] = m;
    v_out[ABSOLUTE_POS] = v;
}

/// `p − u·lr`: two roundings, or with `fused` one, as `u·(−lr) + p` (negating is exact).
#[cube]
pub(super) fn descend<F: Float, N: Size>(
    p: Vector<F, N>,
    u: Vector<F, N>,
    lr: F,
    neg_lr: F,
    #[comptime] fused: bool,
) -> Vector<F, N> {
    let mut next = p;
    if fused {
        next = fma(u, Vector::new(neg_lr), p);
    } else {
        next -= u * Vector::new(lr);
    }
    next
}

/// The step's scalars, computed and rounded to f32 on the host exactly as
/// [`crate::host::adam_step`] computes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scalars {
    pub lr: f32,
    pub beta_1: f32,
    pub beta_2: f32,
    pub one_minus_beta_1: f32,
    pub one_minus_beta_2: f32,
    pub bias_1: f32,
    pub bias_2: f32,
    pub epsilon: f32,
    /// λ (Adam) or `keep` (AdamW), when the rule has one.
    pub decay: Option<f32>,
    pub factor: Option<f32>,
    pub adamw: bool,
    pub first: bool,
}

impl Scalars {
    pub(crate) fn of(step: &AdamStep) -> Self {
        let (b1, b2) = (step.beta_1, step.beta_2);
        // The host path raises β to the step number at run time (`powi` on values it does not
        // know at compile time); hiding the operands keeps a caller with constant
        // hyperparameters from having the compiler fold `powi` differently.
        let t = std::hint::black_box(step.time);
        let (p1, p2) = (
            std::hint::black_box(b1).powi(t),
            std::hint::black_box(b2).powi(t),
        );
        let (decay, adamw, bias_1, bias_2, epsilon) = match step.rule {
            AdamRule::Adam { weight_decay } => {
                let s = (1.0 - p2).sqrt();
                let c = s / (1.0 - p1);
                (weight_decay, false, c, 1.0, step.epsilon * s)
            }
            AdamRule::AdamW { keep } => (keep, true, 1.0 - p1, 1.0 - p2, step.epsilon),
        };
        Self {
            lr: step.lr,
            beta_1: b1,
            beta_2: b2,
            one_minus_beta_1: 1.0 - b1,
            one_minus_beta_2: 1.0 - b2,
            bias_1,
            bias_2,
            epsilon,
            decay,
            factor: step.factor,
            adamw,
            first: step.time == 1,
        }
    }
}

/// The tensors of a step on runtime `R`: the new parameter and moments, and the parameter's
/// half-precision copy when one was asked for.
pub(crate) type Stepped<P> = (P, P, P, Option<P>);

/// Steps on runtime `R`. Lengths and dtypes are checked here; `moments` is `None` for zero
/// moments (and ignored on the first step except as buffers to write into); `copy` the dtype
/// (f16 or bf16) of a copy of the new parameter written by the same launch.
pub(super) fn adam_step<B: Backend, R: CubeRuntime>(
    step: &AdamStep,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    moments: Option<(B::FloatTensorPrimitive, B::FloatTensorPrimitive)>,
    copy: Option<DType>,
    multiply_add: MultiplyAdd,
) -> Result<Stepped<B::FloatTensorPrimitive>, KernelError> {
    let len = param.shape().num_elements();
    let mut tensors = vec![&param, &grad];
    if let Some((m, v)) = &moments {
        tensors.extend([m, v]);
    }
    check_flat_f32(&tensors, "Adam kernel")?;
    let param: CubeTensor<R> = into_cube::<B, R>(param);
    let grad: CubeTensor<R> = into_cube::<B, R>(grad);
    let moments = moments.map(|(m, v)| (into_cube::<B, R>(m), into_cube::<B, R>(v)));
    let client = param.client.clone();
    let dtype = storage_type(&client, DType::F32)?;
    let copy_dtype = copy_storage_type(&client, dtype, copy, "Adam kernel's half-precision copy")?;
    let scalars = Scalars::of(step);
    let shape = param.shape();

    let copy_out = copy
        .map(|half| empty_device_dtype(client.clone(), param.device.clone(), shape.clone(), half));
    if len == 0 {
        let (m, v) = moments.unwrap_or_else(|| (param.clone(), param.clone()));
        return Ok((
            from_cube::<B, R>(param),
            from_cube::<B, R>(m),
            from_cube::<B, R>(v),
            copy_out.map(from_cube::<B, R>),
        ));
    }

    // An output goes into its input's buffer where `writable_in_place` allows, else into a
    // new buffer.
    let writable = writable_in_place::<R>;
    let fresh = || {
        empty_device_dtype(
            client.clone(),
            param.device.clone(),
            shape.clone(),
            DType::F32,
        )
    };
    let param_out = if writable(&param) {
        None
    } else {
        Some(fresh())
    };
    let (m_out, v_out) = match &moments {
        Some((m, v)) => ((!writable(m)).then(fresh), (!writable(v)).then(fresh)),
        None => (Some(fresh()), Some(fresh())),
    };

    let contiguous = [Some(&param), Some(&grad)]
        .into_iter()
        .chain(moments.iter().flat_map(|(m, v)| [Some(m), Some(v)]))
        .flatten()
        .all(|t| t.is_contiguous());
    let widths: &[usize] = if contiguous { &[len] } else { &[1] };
    let vector = vector_size(&client, DType::F32.size(), widths);
    let units = len / vector;
    let cube_dim = CubeDim::new(&client, units);

    let mut all: Vec<&CubeTensor<R>> = vec![&param, &grad];
    if let Some((m, v)) = &moments {
        all.extend([m, v]);
    }
    all.extend(
        param_out
            .iter()
            .chain(&m_out)
            .chain(&v_out)
            .chain(&copy_out),
    );
    let address = address_type(&all);

    // Inputs 0..4: param, grad, m, v. Without moments to read, the gradient (never written)
    // stands in for them.
    let (m_in, v_in) = match &moments {
        Some((m, v)) => (m.clone(), v.clone()),
        None => (grad.clone(), grad.clone()),
    };
    let output = |out: &Option<CubeTensor<R>>, input: &CubeTensor<R>, pos: usize| match out {
        Some(out) => out.clone().into_linear_view(),
        None => input.as_linear_view_alias(pos),
    };
    let scalar = |value: f32| InputScalar::new(value, DType::F32);
    let launch_param_out = output(&param_out, &param, 0);
    let launch_m_out = output(&m_out, &m_in, 2);
    let launch_v_out = output(&v_out, &v_in, 3);
    // Without a copy, the never-written gradient (input 1) stands in for its output.
    let launch_copy_out = match &copy_out {
        Some(out) => out.clone().into_linear_view(),
        None => grad.as_linear_view_alias(1),
    };
    // SAFETY: each unit first checks that its position is inside the outputs (`is_in_bounds`), and
    // every input and output has the parameter's length (checked before the launch).
    unsafe {
        adam_update::launch_unchecked::<R>(
            &client,
            calculate_cube_count_elemwise(&client, units, cube_dim),
            cube_dim,
            address,
            vector,
            param.clone().into_linear_view(),
            grad.into_linear_view(),
            m_in.clone().into_linear_view(),
            v_in.clone().into_linear_view(),
            launch_param_out,
            launch_m_out,
            launch_v_out,
            launch_copy_out,
            scalar(scalars.lr),
            scalar(-scalars.lr),
            scalar(scalars.beta_1),
            scalar(scalars.beta_2),
            scalar(scalars.one_minus_beta_1),
            scalar(scalars.one_minus_beta_2),
            scalar(scalars.bias_1),
            scalar(scalars.bias_2),
            scalar(scalars.epsilon),
            scalar(scalars.decay.unwrap_or(1.0)),
            scalar(scalars.factor.unwrap_or(1.0)),
            scalars.first,
            moments.is_some(),
            scalars.adamw,
            scalars.decay.is_some(),
            scalars.factor.is_some(),
            copy_out.is_some(),
            multiply_add == MultiplyAdd::Fused,
            [dtype, copy_dtype],
        )
    };
    let param = param_out.unwrap_or(param);
    let m = m_out.unwrap_or(m_in);
    let v = v_out.unwrap_or(v_in);
    Ok((
        from_cube::<B, R>(param),
        from_cube::<B, R>(m),
        from_cube::<B, R>(v),
        copy_out.map(from_cube::<B, R>),
    ))
}
