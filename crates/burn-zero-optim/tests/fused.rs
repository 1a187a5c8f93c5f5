//! The fused Adam and AdamW against Burn's own, one step at a time on flat tensors: bitwise on
//! Flex (the one-pass path) over many steps with gradients that change sign and scale, bitwise
//! where they fall back, and bad hyperparameters refused by name.

use burn::backend::{Flex, NdArray};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{AdamConfig, AdamWConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_zero_optim::{FusedAdam, FusedAdamW, FusedConfigError};

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
        let mut optim = ZeroOptimizer::adam(&zero, &AdamConfig::new()).expect("fusable");
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
