//! SGD: one launch steps a flat f32 shard (parameter, gradient and, with momentum, velocity).
//!
//! Per element the kernel does [`crate::host::sgd_step_with`]'s arithmetic: Burn's operations
//! in Burn's order, with the scalars the host path uses; each multiply-add one `fma` with
//! `fused` (CUDA), each operation rounded on its own without (wgpu), as in the Adam kernel.
//! Like the Adam kernel it takes the gradient's multiplier and writes a half-precision
//! parameter's copy in the same launch.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use super::adam::descend;
use super::{
    address_type, check_flat_f32, copy_storage_type, from_cube, into_cube, storage_type,
    vector_size, writable_in_place,
};
use crate::KernelError;
use crate::host::{MultiplyAdd, SgdStep};

/// One SGD step. Inputs (read-only) are `param`, `grad`, `v_in`; each output is a buffer of
/// its own or, when the input's buffer may be written, that buffer (an alias of input 0 or 2).
/// Without momentum `v_out` is never written.
///
/// Comptime flags: `scaled` whether the gradient is multiplied by `factor` first; `decays`
/// whether the L2 penalty `decay` applies; `momentum` whether there is a velocity; `first`
/// builds it from the gradient (Burn's first step; `v_in` is not read); `nesterov` the
/// Nesterov update; `copy` whether the new parameter is also written, cast to `H` (f16 or
/// bf16), into `copy_out` (without, `copy_out` is an alias of the never-written gradient and
/// `H` is `F`).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
fn sgd_update<F: Float, H: Float, N: Size>(
    param: &LinearView<Vector<F, N>>,
    grad: &LinearView<Vector<F, N>>,
    v_in: &LinearView<Vector<F, N>>,
    param_out: &mut LinearView<Vector<F, N>, ReadWrite>,
    v_out: &mut LinearView<Vector<F, N>, ReadWrite>,
    copy_out: &mut LinearView<Vector<H, N>, ReadWrite>,
    lr: InputScalar,
    neg_lr: InputScalar,
    decay: InputScalar,
    mu: InputScalar,
    keep_grad: InputScalar,
    factor: InputScalar,
    #[comptime] scaled: bool,
    #[comptime] decays: bool,
    #[comptime] momentum: bool,
    #[comptime] first: bool,
    #[comptime] nesterov: bool,
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
    if decays {
        // Burn's L2 penalty: `p·λ + g` (the sum's operands commute exactly).
        let lambda = Vector::new(decay.get::<F>());
        if fused {
            g = fma(p, lambda, g);
        } else {
            g = p * lambda + g;
        }
    }
    if momentum {
        let mu = Vector::new(mu.get::<F>());
        let mut v = g;
        if !first {
            // Burn's `g·(1−d) + v·μ`; fused, the velocity's product is the one kept exact.
            let kept = g * Vector::new(keep_grad.get::<F>());
            if fused {
                v = fma(v_in[ABSOLUTE_POS], mu, kept);
            } else {
                v = kept + v_in[ABSOLUTE_POS] * mu;
            }
        }
        v_out[ABSOLUTE_POS] = v;
        if nesterov {
            if fused {
                g = fma(v, mu, g);
            } else {
                g = v * mu + g;
            }
        } else {
            g = v;
        }
    }
    let next = descend(p, g, lr.get::<F>(), neg_lr.get::<F>(), fused);
    param_out[ABSOLUTE_POS] = next;
    if copy {
        copy_out[ABSOLUTE_POS] = Vector::cast_from(next);
    }
}

/// The tensors of a step on runtime `R`: the new parameter, with momentum the velocity, and
/// the parameter's half-precision copy when one was asked for.
pub(crate) type Stepped<P> = (P, Option<P>, Option<P>);

/// Steps on runtime `R`. Lengths and dtypes are checked here. `velocity` is read when the
/// step has momentum and is not the first (it may then still be given, as a buffer to write);
/// `copy` the dtype (f16 or bf16) of a copy of the new parameter written by the same launch.
pub(super) fn sgd_step<B: Backend, R: CubeRuntime>(
    step: &SgdStep,
    param: B::FloatTensorPrimitive,
    grad: B::FloatTensorPrimitive,
    velocity: Option<B::FloatTensorPrimitive>,
    copy: Option<DType>,
    multiply_add: MultiplyAdd,
) -> Result<Stepped<B::FloatTensorPrimitive>, KernelError> {
    let len = param.shape().num_elements();
    let velocity = if step.momentum.is_some() {
        velocity
    } else {
        None
    };
    let mut tensors = vec![&param, &grad];
    tensors.extend(velocity.as_ref());
    check_flat_f32(&tensors, "SGD kernel")?;
    let param: CubeTensor<R> = into_cube::<B, R>(param);
    let grad: CubeTensor<R> = into_cube::<B, R>(grad);
    let velocity = velocity.map(into_cube::<B, R>);
    let client = param.client.clone();
    let dtype = storage_type(&client, DType::F32)?;
    let copy_dtype = copy_storage_type(&client, dtype, copy, "SGD kernel's half-precision copy")?;
    let shape = param.shape();
    let momentum = step.momentum;
    // Burn's first momentum step builds the velocity from the gradient; without a velocity
    // to read, a later step would too.
    let first = momentum.is_some_and(|m| m.first) || velocity.is_none();

    let copy_out = copy
        .map(|half| empty_device_dtype(client.clone(), param.device.clone(), shape.clone(), half));
    if len == 0 {
        let velocity = momentum.map(|_| velocity.unwrap_or_else(|| param.clone()));
        return Ok((
            from_cube::<B, R>(param),
            velocity.map(from_cube::<B, R>),
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
    let param_out = (!writable(&param)).then(fresh);
    let v_out = match (&momentum, &velocity) {
        (Some(_), Some(v)) => (!writable(v)).then(fresh),
        (Some(_), None) => Some(fresh()),
        (None, _) => None,
    };

    let contiguous = [&param, &grad]
        .into_iter()
        .chain(velocity.iter())
        .all(|t| t.is_contiguous());
    let widths: &[usize] = if contiguous { &[len] } else { &[1] };
    let vector = vector_size(&client, DType::F32.size(), widths);
    let units = len / vector;
    let cube_dim = CubeDim::new(&client, units);

    let mut all: Vec<&CubeTensor<R>> = vec![&param, &grad];
    all.extend(
        velocity
            .iter()
            .chain(&param_out)
            .chain(&v_out)
            .chain(&copy_out),
    );
    let address = address_type(&all);

    // Input 2 is the velocity; without one to read, the gradient (never written) stands in.
    let v_in = velocity.clone().unwrap_or_else(|| grad.clone());
    let launch_param_out = match &param_out {
        Some(out) => out.clone().into_linear_view(),
        None => param.as_linear_view_alias(0),
    };
    // Without momentum nothing is written to `v_out`: it aliases the gradient's binding.
    let launch_v_out = match (&v_out, &momentum) {
        (Some(out), _) => out.clone().into_linear_view(),
        (None, Some(_)) => v_in.as_linear_view_alias(2),
        (None, None) => grad.as_linear_view_alias(1),
    };
    // Without a copy, the never-written gradient (input 1) stands in for its output.
    let launch_copy_out = match &copy_out {
        Some(out) => out.clone().into_linear_view(),
        None => grad.as_linear_view_alias(1),
    };
    let scalar = |value: f32| InputScalar::new(value, DType::F32);
    // SAFETY: each unit first checks that its position is inside the outputs (`is_in_bounds`), and
    // every input and output has the parameter's length (checked before the launch).
    unsafe {
        sgd_update::launch_unchecked::<R>(
            &client,
            calculate_cube_count_elemwise(&client, units, cube_dim),
            cube_dim,
            address,
            vector,
            param.clone().into_linear_view(),
            grad.into_linear_view(),
            v_in.clone().into_linear_view(),
            launch_param_out,
            launch_v_out,
            launch_copy_out,
            scalar(step.lr),
            scalar(-step.lr),
            scalar(step.weight_decay.unwrap_or(0.0)),
            scalar(momentum.map_or(0.0, |m| m.momentum)),
            scalar(momentum.map_or(1.0, |m| m.keep_grad)),
            scalar(step.factor.unwrap_or(1.0)),
            step.factor.is_some(),
            step.weight_decay.is_some(),
            momentum.is_some(),
            first,
            momentum.is_some_and(|m| m.nesterov),
            copy_out.is_some(),
            multiply_add == MultiplyAdd::Fused,
            [dtype, copy_dtype],
        )
    };
    let param = param_out.unwrap_or(param);
    let velocity = momentum.map(|_| v_out.unwrap_or(v_in));
    Ok((
        from_cube::<B, R>(param),
        velocity.map(from_cube::<B, R>),
        copy_out.map(from_cube::<B, R>),
    ))
}
