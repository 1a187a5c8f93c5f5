//! The fused Adam and AdamW against Burn's own, one step at a time on flat tensors: bitwise on
//! Flex (the one-pass path) over many steps with gradients that change sign and scale, bitwise
//! where they fall back, and bad hyperparameters refused by name. The fused SGD likewise, in
//! every combination of its options, and its records read as Burn's. Each one-pass step (the
//! gradient's multiplier and a half-precision copy in the pass) against the separate passes.

use burn::backend::{Flex, NdArray};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_zero_optim::{FusedAdam, FusedAdamW, FusedConfigError, FusedSgd};

fn flat<B: Backend>(values: Vec<f32>) -> Tensor<B, 1> {
    let len = values.len();
    Tensor::from_data(TensorData::new(values, [len]), &Default::default())
}

fn bits<B: Backend>(tensor: Tensor<B, 1>) -> Vec<u32> {
    tensor
        .into_data()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Steps `fused` and `burn` side by side for `steps` steps and compares every step's values.
fn side_by_side<B: Backend, F: SimpleOptimizer<B>, O: SimpleOptimizer<B>>(
    fused: &F,
    burn: &O,
    steps: usize,
) {
    let n = 1003;
    let start: Vec<f32> = (0..n)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let (mut a, mut b) = (flat::<B>(start.clone()), flat::<B>(start));
    let (mut sa, mut sb) = (None, None);
    for step in 0..steps {
        // Gradients of changing sign and magnitude, with some zeros.
        let grad: Vec<f32> = (0..n)
            .map(|i| {
                let x = ((i * 7 + step * 13) % 29) as f32 - 14.0;
                x * 10f32.powi((step % 5) as i32 - 3)
            })
            .collect();
        let lr = 1e-3 * (1.0 + (step % 3) as f64);
        let (na, nsa) = fused.step(lr, a, flat::<B>(grad.clone()), sa);
        let (nb, nsb) = burn.step(lr, b, flat::<B>(grad), sb);
        assert_eq!(bits(na.clone()), bits(nb.clone()), "step {step}");
        (a, sa, b, sb) = (na, nsa, nb, nsb);
    }
}

#[test]
fn fused_adam_is_burns_adam_bitwise_over_a_thousand_steps() {
    let plain = AdamConfig::new();
    let decayed = AdamConfig::new().with_weight_decay(Some(WeightDecayConfig::new(0.05)));
    for config in [plain, decayed] {
        let fused = FusedAdam::new(&config).unwrap();
        assert!(fused.fuses::<Flex>() && fused.fuses::<NdArray>());
        side_by_side::<Flex, _, _>(&fused, &config.build(), 1000);
        side_by_side::<NdArray, _, _>(&fused, &config.build(), 200);
    }
}

#[test]
fn fused_adamw_is_burns_adamw_bitwise_over_a_thousand_steps() {
    for config in [
        AdamWConfig::new(),
        AdamWConfig::new().with_weight_decay(0.0),
    ] {
        let fused = FusedAdamW::new(&config).unwrap();
        side_by_side::<Flex, _, _>(&fused, &config.build(), 1000);
    }
}

#[test]
fn options_the_pass_does_not_cover_fall_back_to_burns_step() {
    let amsgrad = AdamConfig::new().with_amsgrad(true);
    let fused = FusedAdam::new(&amsgrad).unwrap();
    assert!(!fused.fuses::<Flex>());
    side_by_side::<Flex, _, _>(&fused, &amsgrad.build(), 50);
    let cautious = AdamWConfig::new().with_cautious_weight_decay(true);
    let fused = FusedAdamW::new(&cautious).unwrap();
    assert!(!fused.fuses::<Flex>());
    side_by_side::<Flex, _, _>(&fused, &cautious.build(), 50);
}

#[test]
fn bad_hyperparameters_are_refused_by_name() {
    let error = FusedAdam::new(&AdamConfig::new().with_beta_1(1.5))
        .err()
        .unwrap();
    assert!(
        matches!(
            error,
            FusedConfigError::Hyperparameter { name: "beta_1", .. }
        ),
        "{error}"
    );
    let error = FusedAdam::new(&AdamConfig::new().with_epsilon(f32::NAN))
        .err()
        .unwrap();
    assert!(error.to_string().contains("epsilon"), "{error}");
    let error = FusedAdamW::new(&AdamWConfig::new().with_weight_decay(-1.0))
        .err()
        .unwrap();
    assert!(error.to_string().contains("weight_decay"), "{error}");
    let clipped = AdamConfig::new().with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)));
    assert_eq!(
        FusedAdam::new(&clipped).err(),
        Some(FusedConfigError::GradientClipping)
    );
}

#[test]
fn a_negative_or_non_finite_learning_rate_is_refused_before_anything_changes() {
    use burn::optim::GradientsParams;
    use burn_zero_comm::launch;
    use burn_zero_core::{ZeroConfig, ZeroError, shard};
    use burn_zero_optim::ZeroOptimizer;
    use burn_zero_testing::{Train, base_model, micro_batch, param_values};

    let base = base_model(&Default::default());
    let messages = launch::<Flex, _, _, ZeroError>(1, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &ZeroConfig::new())?;
        let mut optim = ZeroOptimizer::new(&zero, AdamConfig::new().clone()).expect("fusable");
        let before = param_values(&model);
        let mut messages = Vec::new();
        let mut model = model;
        for lr in [-1e-3, f64::NAN] {
            let (tokens, targets) = micro_batch::<Train>(0, ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                optim.step(lr, model.clone(), grads)
            }));
            let Err(panic) = stepped else {
                panic!("a learning rate of {lr} was accepted")
            };
            messages.push(panic.downcast_ref::<String>().cloned().unwrap_or_default());
            // The module is as it was; renew its gradient marks for the next backward.
            model = optim.step(0.0, model, GradientsParams::new());
            assert_eq!(param_values(&model), before);
        }
        Ok(messages)
    })
    .unwrap();
    for message in &messages[0] {
        assert!(message.contains("learning rate"), "{message}");
    }
}

/// Every combination of SGD's options: no momentum, momentum with and without dampening,
/// Nesterov; with and without weight decay.
fn sgd_configs() -> Vec<SgdConfig> {
    let momenta = [
        None,
        Some(MomentumConfig::new().with_momentum(0.9)),
        Some(
            MomentumConfig::new()
                .with_momentum(0.8)
                .with_dampening(0.25),
        ),
        Some(MomentumConfig::new().with_momentum(0.9).with_nesterov(true)),
    ];
    let decays = [None, Some(WeightDecayConfig::new(0.05))];
    momenta
        .iter()
        .flat_map(|m| {
            decays.iter().map(move |d| {
                SgdConfig::new()
                    .with_momentum(m.clone())
                    .with_weight_decay(d.clone())
            })
        })
        .collect()
}

#[test]
fn fused_sgd_is_burns_sgd_bitwise_over_a_thousand_steps() {
    for config in sgd_configs() {
        let fused = FusedSgd::new(&config).unwrap();
        assert!(fused.fuses::<Flex>() && fused.fuses::<NdArray>());
        side_by_side::<Flex, _, _>(&fused, &config.build::<Flex>(), 1000);
        side_by_side::<NdArray, _, _>(&fused, &config.build::<NdArray>(), 200);
    }
}

/// A fused SGD state's record is Burn's: each reads the other's, and stepping on from either
/// stays bitwise on Burn's path.
#[test]
fn fused_sgd_records_are_burns() {
    use burn::record::{FullPrecisionSettings, Record};

    let config = SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9)));
    let fused = FusedSgd::new(&config).unwrap();
    let burn = config.build::<Flex>();
    let p = flat::<Flex>((0..64).map(|i| i as f32 / 10.0).collect());
    let g = || flat::<Flex>((0..64).map(|i| (i as f32 - 30.0) / 7.0).collect());
    let (pf, sf) = fused.step(0.01, p.clone(), g(), None);
    let (pb, sb) = burn.step(0.01, p, g(), None);
    assert_eq!(bits(pf.clone()), bits(pb.clone()));
    let device = Default::default();
    // Burn's state read as the fused one, and the other way round.
    let item = sb.unwrap().into_item::<FullPrecisionSettings>();
    let json = serde_json::to_value(&item).unwrap();
    let as_fused = burn_zero_optim::FusedSgdState::<Flex, 1>::from_item::<FullPrecisionSettings>(
        serde_json::from_value(json).unwrap(),
        &device,
    );
    let item = sf.unwrap().into_item::<FullPrecisionSettings>();
    let json = serde_json::to_value(&item).unwrap();
    let as_burn = burn::optim::SgdState::<Flex, 1>::from_item::<FullPrecisionSettings>(
        serde_json::from_value(json).unwrap(),
        &device,
    );
    let (a, _) = fused.step(0.01, pb, g(), Some(as_fused));
    let (b, _) = burn.step(0.01, pf, g(), Some(as_burn));
    assert_eq!(bits(a), bits(b));
}

/// The Burn-ops path (any other backend, or a tensor the pass does not take): a 2-D tensor on
/// Flex steps there, bitwise equal to Burn's SGD.
#[test]
fn fused_sgd_off_the_pass_is_burns_sgd() {
    let config = SgdConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(0.05)))
        .with_momentum(Some(
            MomentumConfig::new()
                .with_momentum(0.9)
                .with_dampening(0.1)
                .with_nesterov(true),
        ));
    let fused = FusedSgd::new(&config).unwrap();
    let burn = config.build::<Flex>();
    let square = |seed: usize| -> Tensor<Flex, 2> {
        let values: Vec<f32> = (0..64)
            .map(|i| ((i * 13 + seed * 7) % 31) as f32 / 9.0 - 1.5)
            .collect();
        Tensor::from_data(TensorData::new(values, [8, 8]), &Default::default())
    };
    let (mut a, mut b) = (square(0), square(0));
    let (mut sa, mut sb) = (None, None);
    for step in 0..50 {
        let (na, nsa) = fused.step(1e-2, a, square(step + 1), sa);
        let (nb, nsb) = burn.step(1e-2, b, square(step + 1), sb);
        assert_eq!(
            bits(na.clone().flatten(0, 1)),
            bits(nb.clone().flatten(0, 1)),
            "step {step}"
        );
        (a, sa, b, sb) = (na, nsa, nb, nsb);
    }
}

#[test]
fn bad_sgd_hyperparameters_are_refused_by_name() {
    let momentum = |m: f64, d: f64| {
        SgdConfig::new().with_momentum(Some(
            MomentumConfig::new().with_momentum(m).with_dampening(d),
        ))
    };
    let error = FusedSgd::new(&momentum(-0.5, 0.0)).err().unwrap();
    assert!(
        matches!(
            error,
            FusedConfigError::Hyperparameter {
                name: "momentum",
                ..
            }
        ),
        "{error}"
    );
    let error = FusedSgd::new(&momentum(0.9, f64::NAN)).err().unwrap();
    assert!(error.to_string().contains("dampening"), "{error}");
    let decayed = SgdConfig::new().with_weight_decay(Some(WeightDecayConfig::new(f32::INFINITY)));
    let error = FusedSgd::new(&decayed).err().unwrap();
    assert!(error.to_string().contains("weight_decay"), "{error}");
    let clipped = SgdConfig::new().with_gradient_clipping(Some(GradientClippingConfig::Value(1.0)));
    assert_eq!(
        FusedSgd::new(&clipped).err(),
        Some(FusedConfigError::GradientClipping)
    );
}

/// The start of the one-pass tests' parameter.
fn one_pass_start() -> Vec<f32> {
    (0..1003)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect()
}

/// The one-pass tests' gradient at `step`: large, as a loss-scaled one is.
fn one_pass_grad(step: usize) -> Vec<f32> {
    (0..1003)
        .map(|i| (((i * 7 + step * 13) % 29) as f32 - 14.0) * 1e3)
        .collect()
}

/// The one-pass tests' gradient multiplier (an unscaling).
const ONE_PASS_FACTOR: f64 = 1.0 / 3000.0;

/// Five `OnePass::step_flat` steps of `fused` on Flex for a parameter of `dtype`, against
/// `burn`'s steps on the gradient multiplied first: the masters bitwise equal after every
/// step, and the copy `fused` writes Burn's cast of Burn's master bit for bit (none for f32).
fn one_pass_against_burn<F, O>(fused: &F, burn: &O, dtype: burn::tensor::DType, what: &str)
where
    F: burn_zero_optim::OnePass<Flex>,
    O: SimpleOptimizer<Flex>,
{
    use burn::tensor::DType;
    use burn_zero_optim::FlatStep;
    let start = one_pass_start();
    let (mut a, mut b) = (flat::<Flex>(start.clone()), flat::<Flex>(start));
    let (mut sa, mut sb) = (None, None);
    for step in 0..5 {
        let grad = || flat::<Flex>(one_pass_grad(step));
        let FlatStep {
            master,
            state,
            written,
        } = fused.step_flat(1e-2, a, grad(), ONE_PASS_FACTOR, sa, dtype);
        let (nb, nsb) = burn.step(1e-2, b, grad().mul_scalar(ONE_PASS_FACTOR), sb);
        let what = format!("{what}, {dtype:?}, step {step}");
        assert_eq!(bits(master.clone()), bits(nb.clone()), "{what}");
        if dtype == DType::F32 {
            assert!(written.is_none(), "{what}: an f32 parameter needs no copy");
        } else {
            let written = written.expect("Flex writes the copy in the pass");
            assert_eq!(written.dtype(), dtype);
            let want = nb.clone().cast(dtype);
            assert_eq!(
                bits(written.cast(DType::F32)),
                bits(want.cast(DType::F32)),
                "{what}: copy"
            );
        }
        (a, sa, b, sb) = (master, state, nb, nsb);
    }
}

/// `OnePass::step_flat` on Flex writes the half-precision copy itself (`written`), and its
/// master, state and copy are bitwise Burn's step on the gradient multiplied first, and
/// Burn's cast after; on NdArray (no half-precision tensors) it leaves the cast to the caller.
#[test]
fn one_pass_writes_the_cast_and_applies_the_factor_as_burn_would() {
    use burn::optim::{AdamState, AdamWState};
    use burn::tensor::DType;
    use burn_zero_optim::{FlatStep, OnePass};
    let (start, grad, factor) = (one_pass_start(), one_pass_grad, ONE_PASS_FACTOR);
    let adam = AdamConfig::new().with_weight_decay(Some(WeightDecayConfig::new(0.01)));
    let (fused, burn) = (FusedAdam::new(&adam).unwrap(), adam.build());
    for dtype in [DType::F16, DType::BF16] {
        one_pass_against_burn(&fused, &burn, dtype, "Adam");
    }
    // AdamW likewise, and an f32 parameter needs no copy.
    let adamw = AdamWConfig::new().with_weight_decay(0.1);
    let (fused, burn) = (FusedAdamW::new(&adamw).unwrap(), adamw.build());
    let none: Option<AdamWState<Flex, 1>> = None;
    let FlatStep {
        master, written, ..
    } = fused.step_flat(
        1e-2,
        flat::<Flex>(start.clone()),
        flat(grad(1)),
        factor,
        none,
        DType::F32,
    );
    assert!(written.is_none());
    let scaled = flat::<Flex>(grad(1)).mul_scalar(factor);
    let (want, _) = burn.step(1e-2, flat::<Flex>(start.clone()), scaled, None);
    assert_eq!(bits(master), bits(want));
    // NdArray holds no f16: the copy is left to the caller.
    let none: Option<AdamState<NdArray, 1>> = None;
    let adam = FusedAdam::new(&AdamConfig::new()).unwrap();
    let step = adam.step_flat(
        1e-2,
        flat::<NdArray>(start),
        flat(grad(1)),
        1.0,
        none,
        DType::F16,
    );
    assert!(step.written.is_none());
}

/// The fused SGD's `OnePass::step_flat`, every option combination: on Flex its master, state
/// and half-precision copy are bitwise Burn's SGD on the gradient multiplied first, and
/// Burn's cast after; on NdArray (no half-precision tensors) the master is, and the cast is
/// left to the caller.
#[test]
fn sgd_one_pass_writes_the_cast_and_applies_the_factor_as_burn_would() {
    use burn::tensor::DType;
    use burn_zero_optim::OnePass;
    let (start, grad, factor) = (one_pass_start(), one_pass_grad, ONE_PASS_FACTOR);
    for (i, config) in sgd_configs().iter().enumerate() {
        let (fused, burn) = (FusedSgd::new(config).unwrap(), config.build::<Flex>());
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            one_pass_against_burn(&fused, &burn, dtype, &format!("SGD #{i}"));
        }
    }
    let config = &sgd_configs()[7];
    let (fused, burn) = (FusedSgd::new(config).unwrap(), config.build::<NdArray>());
    let step = fused.step_flat(
        1e-2,
        flat::<NdArray>(start.clone()),
        flat(grad(1)),
        factor,
        None,
        DType::F16,
    );
    assert!(step.written.is_none());
    let scaled = flat::<NdArray>(grad(1)).mul_scalar(factor);
    let (want, _) = burn.step(1e-2, flat::<NdArray>(start), scaled, None);
    assert_eq!(bits(step.master), bits(want));
}
