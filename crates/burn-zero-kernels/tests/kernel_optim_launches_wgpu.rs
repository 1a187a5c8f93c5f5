//! Kernel launches per optimizer step on wgpu, counted at the backend boundary by
//! [`LaunchLog`]: cubecl's execution log, turned on before any wgpu client exists, with the
//! lines between two launches of a marker kernel counted.
//!
//! Target: at most one launch per optimizer step of a flat shard (Adam, AdamW, SGD), also
//! with the gradient's multiplier and a half-precision parameter's cast. Burn's
//! per-tensor Adam on the same shard, and the separate multiply and cast, are counted
//! alongside for comparison.
//!
//! Without a wgpu adapter every test says it was skipped, unless `BURN_ZERO_REQUIRE_WGPU=1`
//! (CI) makes that a failure.

use burn::backend::wgpu::{CubeBackend, CubeTensor, WgpuDevice, WgpuRuntime};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_fusion::Fusion;
use burn_zero_kernels::host::{AdamRule, AdamStep};
use burn_zero_kernels::{LaunchLog, adam_step_kernel};
use burn_zero_optim::{FlatStep, FusedAdam, FusedAdamW, FusedSgd, OnePass};
use burn_zero_testing::skip;

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
type Fused = Fusion<Plain>;

/// Whether `test` can run (a wgpu adapter), with the launch log turned on (before any wgpu
/// client exists: every test calls this first).
fn runs(test: &str) -> bool {
    LaunchLog::install();
    skip::wgpu_adapter(test)
}

/// The kernels launched on `device` while `work` runs (it must leave nothing pending: sync a
/// fused backend).
fn launches(device: &WgpuDevice, work: impl FnOnce()) -> Vec<String> {
    LaunchLog::install()
        .launches::<WgpuRuntime, _>(device, work)
        .expect("the launches are counted")
        .1
}

fn flat<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) / 25.0)
        .collect()
}

/// One step of `optimizer` on backend `B`, its launches counted (the result is synced, so a
/// fused backend's queued work is in the count).
fn counted_step<B: Backend<Device = WgpuDevice>, O: SimpleOptimizer<B>>(
    optimizer: &O,
    device: &WgpuDevice,
    param: &mut Tensor<B, 1>,
    state: &mut Option<O::State<1>>,
    grad: Tensor<B, 1>,
) -> Vec<String> {
    B::sync(device).unwrap();
    launches(device, || {
        let (p, s) = optimizer.step(1e-3, param.clone(), grad, state.take());
        *param = p;
        *state = s;
        B::sync(device).unwrap();
    })
}

/// Steps `optimizer` four times on a 4,096-element shard and returns each step's launches.
fn four_steps<B: Backend<Device = WgpuDevice>, O: SimpleOptimizer<B>>(
    optimizer: &O,
    device: &WgpuDevice,
) -> Vec<Vec<String>> {
    let n = 4096;
    let mut param = flat::<B>(&values(n, 0), device);
    let mut state = None;
    (0..4)
        .map(|t| {
            let grad = flat::<B>(&values(n, t + 1), device);
            counted_step(optimizer, device, &mut param, &mut state, grad)
        })
        .collect()
}

fn assert_one_adam_launch(what: &str, steps: &[Vec<String>]) {
    for (t, step) in steps.iter().enumerate() {
        assert_eq!(step.len(), 1, "{what}, step {}: launches {step:?}", t + 1);
        assert!(step[0].contains("AdamUpdate"), "{what}: {step:?}");
    }
}

#[test]
fn a_fused_step_of_a_flat_shard_is_one_launch() {
    if !runs("a_fused_step_of_a_flat_shard_is_one_launch") {
        return;
    }
    let device = WgpuDevice::default();
    let adam = AdamConfig::new().with_weight_decay(Some(WeightDecayConfig::new(0.01)));
    let fused_adam = FusedAdam::new(&adam).unwrap();
    let fused_adamw = FusedAdamW::new(&AdamWConfig::new()).unwrap();
    assert_one_adam_launch(
        "FusedAdam, plain wgpu",
        &four_steps::<Plain, _>(&fused_adam, &device),
    );
    assert_one_adam_launch(
        "FusedAdam, fused wgpu",
        &four_steps::<Fused, _>(&fused_adam, &device),
    );
    assert_one_adam_launch(
        "FusedAdamW, plain wgpu",
        &four_steps::<Plain, _>(&fused_adamw, &device),
    );
    assert_one_adam_launch(
        "FusedAdamW, fused wgpu",
        &four_steps::<Fused, _>(&fused_adamw, &device),
    );

    // The same count for Burn's per-tensor Adam shows what the kernel saves, and that the
    // counter sees Burn's own launches too (measured: 11 on the first step, 15 after).
    let burn = four_steps::<Plain, _>(&adam.build(), &device);
    for (t, step) in burn.iter().enumerate() {
        assert!(step.len() >= 10, "Burn's Adam, step {}: {step:?}", t + 1);
        assert!(step.iter().all(|line| !line.contains("AdamUpdate")));
    }
}

#[test]
fn the_kernel_alone_is_one_launch() {
    if !runs("the_kernel_alone_is_one_launch") {
        return;
    }
    let device = WgpuDevice::default();
    let n = 4096;
    for time in [1, 2] {
        let step = AdamStep {
            rule: AdamRule::Adam { weight_decay: None },
            lr: 1e-3,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            time,
            factor: None,
        };
        let tensor = |seed| -> CubeTensor<WgpuRuntime> {
            flat::<Plain>(&values(n, seed), &device)
                .into_primitive()
                .tensor()
        };
        let (p, g) = (tensor(0), tensor(1));
        let moments = (time > 1).then(|| (tensor(2), tensor(3)));
        Plain::sync(&device).unwrap();
        let launched = launches(&device, || {
            let stepped = adam_step_kernel::<Plain>(&step, p, g, moments);
            assert!(matches!(stepped, Some(Ok(_))));
            Plain::sync(&device).unwrap();
        });
        assert_eq!(launched.len(), 1, "step {time}: {launched:?}");
    }
}

#[test]
fn a_fused_sgd_step_is_one_launch() {
    if !runs("a_fused_sgd_step_is_one_launch") {
        return;
    }
    let device = WgpuDevice::default();
    let config = SgdConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(0.9).with_nesterov(true),
        ));
    let fused = FusedSgd::new(&config).unwrap();
    for (what, steps) in [
        (
            "FusedSgd, plain wgpu",
            four_steps::<Plain, _>(&fused, &device),
        ),
        (
            "FusedSgd, fused wgpu",
            four_steps::<Fused, _>(&fused, &device),
        ),
    ] {
        for (t, step) in steps.iter().enumerate() {
            assert_eq!(step.len(), 1, "{what}, step {}: launches {step:?}", t + 1);
            assert!(step[0].contains("SgdUpdate"), "{what}: {step:?}");
        }
    }
    let burn = four_steps::<Plain, _>(&config.build::<Plain>(), &device);
    assert!(burn.iter().skip(1).all(|step| step.len() >= 5), "{burn:?}");
}

/// A half-precision parameter's step with a gradient multiplier (unscaling, clipping): the
/// one pass (`OnePass::step_flat`) is one launch with the factor and the f16 copy inside it,
/// where the step with a separate multiply and cast is three.
#[test]
fn a_one_pass_step_with_factor_and_half_copy_is_one_launch() {
    let test = "a_one_pass_step_with_factor_and_half_copy_is_one_launch";
    if !runs(test) {
        return;
    }
    let device = WgpuDevice::default();
    if !skip::dtype_supported(test, Plain::supports_dtype(&device, DType::F16), "f16", "") {
        return;
    }
    one_pass_launches(
        &FusedAdam::new(&AdamConfig::new()).unwrap(),
        "AdamUpdate",
        &device,
    );
    let sgd = SgdConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)));
    one_pass_launches(&FusedSgd::new(&sgd).unwrap(), "SgdUpdate", &device);
}

/// Three one-pass steps of `fused` with a factor and an f16 copy, each one launch of
/// `kernel`; then the separate multiply, step and cast, three.
fn one_pass_launches<O: OnePass<Plain>>(fused: &O, kernel: &str, device: &WgpuDevice) {
    let n = 4096;
    let mut master = flat::<Plain>(&values(n, 0), device);
    let mut state = None;
    for t in 0..3 {
        let grad = flat::<Plain>(&values(n, t + 1), device);
        Plain::sync(device).unwrap();
        let launched = launches(device, || {
            let FlatStep {
                master: next,
                state: next_state,
                written,
            } = fused.step_flat(1e-3, master.clone(), grad, 0.25, state.take(), DType::F16);
            assert_eq!(written.map(|w| w.dtype()), Some(DType::F16));
            master = next;
            state = next_state;
            Plain::sync(device).unwrap();
        });
        assert_eq!(launched.len(), 1, "{kernel}, step {}: {launched:?}", t + 1);
        assert!(launched[0].contains(kernel), "{launched:?}");
    }
    // The separate passes: multiply, step, cast.
    let grad = flat::<Plain>(&values(n, 9), device);
    Plain::sync(device).unwrap();
    let separate = launches(device, || {
        let (next, _) = fused.step(1e-3, master.clone(), grad.mul_scalar(0.25), state.take());
        let _half = next.cast(DType::F16);
        Plain::sync(device).unwrap();
    });
    assert_eq!(separate.len(), 3, "{kernel}: {separate:?}");
}
