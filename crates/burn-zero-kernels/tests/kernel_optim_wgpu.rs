//! The Adam/AdamW kernel (`adam_step_kernel`) against the host step
//! (`burn_zero_kernels::host::adam_step`, Burn's operations in Burn's order, each rounded to
//! f32) on `CubeBackend<WgpuRuntime>` and under Burn's fusion layer (`burn::backend::Wgpu`),
//! on Mesa lavapipe where there is no GPU: 1,000 steps of parameter and both moments compared
//! bit for bit after every step, on gradients of changing sign and magnitude (from subnormal
//! squares to 10⁷), with exact zeros of both signs. The same through the fused optimizer
//! (`FusedAdam`, `FusedAdamW`), against its host path on Flex and against Burn's own `Adam` and
//! `AdamW` on the same wgpu backend. The SGD kernel (`sgd_step_kernel`, through `FusedSgd`)
//! likewise, in every combination of weight decay, momentum, dampening and Nesterov.
//!
//! The launch's half-precision copy of the new parameter (`adam_step_kernel_copying`,
//! `sgd_step_kernel_copying`) against Burn's cast on the same device, where the adapter stores
//! the half type.
//!
//! CUDA's variant of the kernels (every multiply-add one `fma`), run here against the host
//! pass with the adapter's own `fma` rounding: lavapipe rounds `fma` twice, so on it the
//! variant must give Burn's bits (300 Adam steps, 150 SGD steps in every option combination);
//! on an adapter whose `fma` is fused, the bits of the host pass with `f32::mul_add`.
//!
//! Measured on lavapipe: bitwise everywhere, so the assertions are bitwise (the compiler keeps
//! every rounding: no contraction into fused multiply-adds, correctly rounded division and
//! square root). Without a wgpu adapter every test says it was skipped, unless
//! `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

use burn::backend::Flex;
use burn::backend::wgpu::{CubeBackend, CubeTensor, WgpuDevice, WgpuRuntime};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_fusion::Fusion;
use burn_zero_kernels::host::{
    AdamRule, AdamStep, MultiplyAdd, SgdMomentum, SgdStep, adam_step, adam_step_with, sgd_step,
    sgd_step_with,
};
use burn_zero_kernels::{
    KernelError, adam_step_kernel, adam_step_kernel_copying, adam_step_kernel_with,
    kernel_available, kernel_multiply_add, sgd_step_kernel, sgd_step_kernel_copying,
    sgd_step_kernel_with,
};
use burn_zero_optim::{FusedAdam, FusedAdamW, FusedSgd};
use burn_zero_testing::skip;

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
type Fused = Fusion<Plain>;

fn runs(test: &str) -> bool {
    skip::wgpu_adapter(test)
}

/// xorshift64*: uniform in [0, 1).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Step `t`'s gradient: random signs, magnitudes over 32 decades (10⁻²⁸ to 10⁴, scaled by a
/// factor from 10⁻³ to 10³ that changes from step to step: squares from zero through the
/// subnormals to 10¹⁴), about one in twenty exactly zero (half of them -0.0).
fn gradient(rng: &mut Rng, n: usize, t: usize) -> Vec<f32> {
    let scale = 10f64.powi((t % 7) as i32 - 3);
    (0..n)
        .map(|_| {
            let pick = rng.next();
            if pick < 0.025 {
                0.0
            } else if pick < 0.05 {
                -0.0
            } else {
                let magnitude = 10f64.powf(rng.next() * 32.0 - 28.0) * scale;
                let sign = if rng.next() < 0.5 { -1.0 } else { 1.0 };
                (sign * magnitude) as f32
            }
        })
        .collect()
}

fn upload<B: Backend>(values: &[f32], device: &B::Device) -> B::FloatTensorPrimitive {
    Tensor::<B, 1>::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
        .into_primitive()
        .tensor()
}

fn download<B: Backend>(tensor: B::FloatTensorPrimitive) -> Vec<f32> {
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(tensor))
        .into_data()
        .to_vec::<f32>()
        .unwrap()
}

/// A configuration: the rule for a step's learning rate, the hyperparameters, the factor.
#[derive(Debug, Clone, Copy)]
struct Config {
    name: &'static str,
    adamw: bool,
    weight_decay: Option<f32>,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    /// Multiply the gradient by this on every step (loss scaling, clipping).
    factor: Option<f32>,
}

impl Config {
    fn step(&self, t: usize) -> AdamStep {
        // A learning rate that changes every step (a schedule), rounded as Burn rounds it.
        let lr = 1e-3 * (1.0 + (t % 11) as f64 / 3.0);
        let rule = if self.adamw {
            let decay = lr * self.weight_decay.map_or(0.0, f64::from);
            AdamRule::AdamW {
                keep: (decay != 0.0).then_some((1.0 - decay) as f32),
            }
        } else {
            AdamRule::Adam {
                weight_decay: self.weight_decay,
            }
        };
        AdamStep {
            rule,
            lr: lr as f32,
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            time: t as i32,
            factor: self.factor,
        }
    }
}

const CONFIGS: [Config; 4] = [
    Config {
        name: "adam",
        adamw: false,
        weight_decay: None,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-5,
        factor: None,
    },
    Config {
        name: "adam, L2 0.01, factor 0.37",
        adamw: false,
        weight_decay: Some(0.01),
        beta_1: 0.85,
        beta_2: 0.995,
        epsilon: 1e-8,
        factor: Some(0.37),
    },
    Config {
        name: "adamw 0.05",
        adamw: true,
        weight_decay: Some(0.05),
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-5,
        factor: None,
    },
    Config {
        name: "adamw, no decay, factor 1/1024",
        adamw: true,
        weight_decay: None,
        beta_1: 0.8,
        beta_2: 0.95,
        epsilon: 1e-6,
        factor: Some(1.0 / 1024.0),
    },
];

/// Runs `steps` steps of `config` over `n` elements on the kernel (its variant for `kernel`'s
/// rounding) and on the host (with `host`'s), comparing parameter and moments after every
/// step; returns the first step where they differ.
fn first_difference<B: Backend<Device = WgpuDevice>>(
    config: &Config,
    (kernel, host): (MultiplyAdd, MultiplyAdd),
    n: usize,
    steps: usize,
    seed: u64,
) -> Option<(usize, &'static str)> {
    let device = WgpuDevice::default();
    let mut rng = Rng::new(seed);
    let start: Vec<f32> = (0..n)
        .map(|i| {
            if i % 17 == 0 {
                0.0
            } else {
                ((rng.next() * 4.0 - 2.0) as f32) * 10f32.powi((i % 5) as i32 - 2)
            }
        })
        .collect();
    let (mut p, mut m, mut v) = (start.clone(), vec![0.0f32; n], vec![0.0f32; n]);
    let mut param = upload::<B>(&start, &device);
    let mut moments = None;
    for t in 1..=steps {
        let g = gradient(&mut rng, n, t);
        let step = config.step(t);
        adam_step_with(&step, host, &mut p, &g, &mut m, &mut v, 1);
        let grad = upload::<B>(&g, &device);
        let (np, nm, nv) = adam_step_kernel_with::<B>(&step, kernel, param, grad, moments)
            .expect("wgpu has the kernel")
            .expect("an f32 step");
        for (what, device, host) in [("param", &np, &p), ("m", &nm, &m), ("v", &nv, &v)] {
            let device = download::<B>(device.clone());
            let same = device
                .iter()
                .zip(host)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                return Some((t, what));
            }
        }
        (param, moments) = (np, Some((nm, nv)));
    }
    None
}

#[test]
fn kernel_adam_is_the_host_step_bit_for_bit_over_a_thousand_steps() {
    if !runs("kernel_adam_is_the_host_step_bit_for_bit_over_a_thousand_steps") {
        return;
    }
    let mut failures = Vec::new();
    for config in &CONFIGS {
        // 1,031 elements: one at a time; 2,048: in vectors of four.
        for n in [1031, 2048] {
            let rounded = (MultiplyAdd::Rounded, MultiplyAdd::Rounded);
            if let Some((t, what)) =
                first_difference::<Plain>(config, rounded, n, 1000, 0xADA3 + n as u64)
            {
                failures.push(format!(
                    "{}, {n} elements: {what} differs at step {t}",
                    config.name
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn fused_kernel_adam_is_the_host_step_bit_for_bit() {
    if !runs("fused_kernel_adam_is_the_host_step_bit_for_bit") {
        return;
    }
    let mut failures = Vec::new();
    for config in &CONFIGS {
        let rounded = (MultiplyAdd::Rounded, MultiplyAdd::Rounded);
        if let Some((t, what)) = first_difference::<Fused>(config, rounded, 1031, 1000, 0xF05E) {
            failures.push(format!("{}: {what} differs at step {t}", config.name));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The rounding the adapter's `fma` computes (Vulkan does not promise a fused one; lavapipe
/// rounds twice), told by the fused-variant Adam kernel itself on elements some of whose
/// updates differ between the two roundings. Panics when the kernel's result is neither host
/// reference's.
fn adapters_fma() -> MultiplyAdd {
    let device = WgpuDevice::default();
    let step = AdamStep {
        rule: AdamRule::Adam { weight_decay: None },
        lr: 0.1,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-3,
        time: 1,
        factor: None,
    };
    // First steps from parameters and gradients spread over an octave: the update `p − u·lr`
    // keeps the low bits of `u·lr` in some of them only when fused.
    let start: Vec<f32> = (0..256).map(|i| 1.0 + i as f32 / 256.0).collect();
    let grad: Vec<f32> = (0..256).map(|i| 0.5 + i as f32 / 97.0).collect();
    let host = |multiply_add| {
        let (mut p, mut m, mut v) = (start.clone(), vec![0.0; 256], vec![0.0; 256]);
        adam_step_with(&step, multiply_add, &mut p, &grad, &mut m, &mut v, 1);
        p.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    let (rounded, fused) = (host(MultiplyAdd::Rounded), host(MultiplyAdd::Fused));
    assert_ne!(
        rounded, fused,
        "the probe must tell the two roundings apart"
    );
    let param = upload::<Plain>(&start, &device);
    let grad = upload::<Plain>(&grad, &device);
    let (p, _, _) = adam_step_kernel_with::<Plain>(&step, MultiplyAdd::Fused, param, grad, None)
        .expect("wgpu has the kernel")
        .expect("an f32 step");
    let kernel: Vec<u32> = download::<Plain>(p).iter().map(|x| x.to_bits()).collect();
    match (kernel == fused, kernel == rounded) {
        (true, _) => MultiplyAdd::Fused,
        (_, true) => MultiplyAdd::Rounded,
        _ => panic!("the fused-variant kernel matches neither host rounding"),
    }
}

/// CUDA's variant of the kernel (every multiply-add written as `fma`), run on wgpu against
/// the host pass with the adapter's `fma` rounding: on an adapter whose `fma` is fused, the
/// host pass with `f32::mul_add` at the same places, which checks that kernel and reference
/// place their fused operations alike; on lavapipe, whose `fma` rounds twice, Burn's rounding,
/// which checks the variant's data flow (where each fused operand comes from is then checked
/// on a GPU only). The default kernel on wgpu stays the separately rounded one.
#[test]
fn cudas_fused_multiply_add_kernel_is_the_host_step_bit_for_bit() {
    if !runs("cudas_fused_multiply_add_kernel_is_the_host_step_bit_for_bit") {
        return;
    }
    assert_eq!(kernel_multiply_add::<Plain>(), Some(MultiplyAdd::Rounded));
    assert_eq!(kernel_multiply_add::<Fused>(), Some(MultiplyAdd::Rounded));
    let host = adapters_fma();
    println!("the adapter's fma: {host:?}");
    let mut failures = Vec::new();
    for config in &CONFIGS {
        for (n, seed) in [(1031, 0xF3A), (2048, 0xF3B)] {
            let sides = (MultiplyAdd::Fused, host);
            if let Some((t, what)) = first_difference::<Plain>(config, sides, n, 300, seed) {
                failures.push(format!("{}, {n}: {what} differs at step {t}", config.name));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The same for SGD, every combination of weight decay, momentum, dampening and Nesterov;
/// the fused host reference parts from the rounded one within the run.
#[test]
fn cudas_fused_multiply_add_sgd_kernel_is_the_host_step_bit_for_bit() {
    if !runs("cudas_fused_multiply_add_sgd_kernel_is_the_host_step_bit_for_bit") {
        return;
    }
    let host = adapters_fma();
    let device = WgpuDevice::default();
    let n = 1031;
    let mut failures = Vec::new();
    let mut told_apart = false;
    let momenta = [
        None,
        Some((0.9f32, 1.0f32, false)),
        Some((0.8, 0.75, false)),
        Some((0.9, 1.0, true)),
    ];
    for decay in [None, Some(0.05f32)] {
        for momentum in momenta {
            let mut rng = Rng::new(0x56D + n as u64);
            let start = start(n, 0x56E);
            let (mut p, mut v) = (start.clone(), vec![0.0f32; n]);
            let (mut other_p, mut other_v) = (start.clone(), vec![0.0f32; n]);
            let mut param = upload::<Plain>(&start, &device);
            let mut velocity = None;
            for t in 0..150 {
                let g = gradient(&mut rng, n, t + 1);
                let step = SgdStep {
                    lr: 1e-2 * (1.0 + (t % 5) as f32 / 4.0),
                    weight_decay: decay,
                    momentum: momentum.map(|(momentum, keep_grad, nesterov)| SgdMomentum {
                        momentum,
                        keep_grad,
                        nesterov,
                        first: t == 0,
                    }),
                    factor: (t % 3 == 2).then_some(0.375),
                };
                let v_now = momentum.map(|_| v.as_mut_slice());
                sgd_step_with(&step, host, &mut p, &g, v_now, 1);
                let other = match host {
                    MultiplyAdd::Fused => MultiplyAdd::Rounded,
                    MultiplyAdd::Rounded => MultiplyAdd::Fused,
                };
                let v_other = momentum.map(|_| other_v.as_mut_slice());
                sgd_step_with(&step, other, &mut other_p, &g, v_other, 1);
                let grad = upload::<Plain>(&g, &device);
                let fused = MultiplyAdd::Fused;
                let (np, nv) = sgd_step_kernel_with::<Plain>(&step, fused, param, grad, velocity)
                    .expect("wgpu has the kernel")
                    .expect("an f32 step");
                let same = |device: &[f32], host: &[f32]| {
                    device
                        .iter()
                        .zip(host)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                };
                let mut differs = !same(&download::<Plain>(np.clone()), &p);
                if let Some(nv) = &nv {
                    differs |= !same(&download::<Plain>(nv.clone()), &v);
                }
                if differs {
                    failures.push(format!("decay {decay:?}, momentum {momentum:?}: step {t}"));
                    break;
                }
                told_apart |= !same(&p, &other_p);
                (param, velocity) = (np, nv);
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(told_apart, "the fused and rounded references never parted");
}

/// The initial parameter of the optimizer tests.
fn start(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.next() * 6.0 - 3.0) as f32).collect()
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

fn flat<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// Steps optimizer `a` on backend `A` and `b` on `B` side by side for `steps` steps (same
/// start, gradients and learning rates) and compares the parameters after every step; returns
/// the first step where they differ.
fn side_by_side<A, B, OA, OB>(
    a: &OA,
    b: &OB,
    device_a: &A::Device,
    device_b: &B::Device,
    steps: usize,
    seed: u64,
) -> Option<usize>
where
    A: Backend,
    B: Backend,
    OA: SimpleOptimizer<A>,
    OB: SimpleOptimizer<B>,
{
    let n = 1536;
    let start = start(n, seed);
    let mut rng = Rng::new(seed ^ 0x5EED);
    let (mut pa, mut pb) = (flat::<A>(&start, device_a), flat::<B>(&start, device_b));
    let (mut sa, mut sb) = (None, None);
    for t in 1..=steps {
        let g = gradient(&mut rng, n, t);
        let lr = 1e-3 * (1.0 + (t % 11) as f64 / 3.0);
        let (na, nsa) = a.step(lr, pa, flat::<A>(&g, device_a), sa);
        let (nb, nsb) = b.step(lr, pb, flat::<B>(&g, device_b), sb);
        if bits(na.clone()) != bits(nb.clone()) {
            return Some(t);
        }
        (pa, sa, pb, sb) = (na, nsa, nb, nsb);
    }
    None
}

fn adam_configs() -> [AdamConfig; 2] {
    [
        AdamConfig::new(),
        AdamConfig::new()
            .with_beta_1(0.8)
            .with_beta_2(0.99)
            .with_epsilon(1e-7)
            .with_weight_decay(Some(WeightDecayConfig::new(0.02))),
    ]
}

fn adamw_configs() -> [AdamWConfig; 2] {
    [
        AdamWConfig::new().with_weight_decay(0.05),
        AdamWConfig::new().with_weight_decay(0.0).with_beta_2(0.98),
    ]
}

/// `FusedAdam`/`FusedAdamW` on wgpu (the kernel) against the same on Flex (the host pass) and
/// against Burn's `Adam`/`AdamW` on the same wgpu backend, 1,000 steps.
fn fused_optimizers_against_host_and_burn<B: Backend<Device = WgpuDevice>>(steps: usize) {
    let device = WgpuDevice::default();
    let host = Default::default();
    let mut failures = Vec::new();
    for (i, config) in adam_configs().iter().enumerate() {
        let fused = FusedAdam::new(config).unwrap();
        assert!(
            fused.fuses::<B>(),
            "FusedAdam takes the kernel on {}",
            B::name(&device)
        );
        let seed = 0xC0FFEE + i as u64;
        if let Some(t) = side_by_side::<B, Flex, _, _>(&fused, &fused, &device, &host, steps, seed)
        {
            failures.push(format!("Adam #{i}: kernel vs host pass, step {t}"));
        }
        let burn = config.build();
        if let Some(t) = side_by_side::<B, B, _, _>(&fused, &burn, &device, &device, steps, seed) {
            failures.push(format!("Adam #{i}: kernel vs Burn's Adam, step {t}"));
        }
    }
    for (i, config) in adamw_configs().iter().enumerate() {
        let fused = FusedAdamW::new(config).unwrap();
        assert!(
            fused.fuses::<B>(),
            "FusedAdamW takes the kernel on {}",
            B::name(&device)
        );
        let seed = 0xBEEF + i as u64;
        if let Some(t) = side_by_side::<B, Flex, _, _>(&fused, &fused, &device, &host, steps, seed)
        {
            failures.push(format!("AdamW #{i}: kernel vs host pass, step {t}"));
        }
        let burn = config.build();
        if let Some(t) = side_by_side::<B, B, _, _>(&fused, &burn, &device, &device, steps, seed) {
            failures.push(format!("AdamW #{i}: kernel vs Burn's AdamW, step {t}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn fused_optimizers_on_plain_wgpu_are_the_host_pass_and_burns_bit_for_bit() {
    if !runs("fused_optimizers_on_plain_wgpu_are_the_host_pass_and_burns_bit_for_bit") {
        return;
    }
    fused_optimizers_against_host_and_burn::<Plain>(1000);
}

#[test]
fn fused_optimizers_on_fused_wgpu_are_the_host_pass_and_burns_bit_for_bit() {
    if !runs("fused_optimizers_on_fused_wgpu_are_the_host_pass_and_burns_bit_for_bit") {
        return;
    }
    assert!(kernel_available::<Fused>());
    fused_optimizers_against_host_and_burn::<Fused>(1000);
}

/// The options the kernel does not cover keep Burn's step on wgpu (bitwise Burn's).
#[test]
fn uncovered_options_fall_back_to_burns_step_on_wgpu() {
    if !runs("uncovered_options_fall_back_to_burns_step_on_wgpu") {
        return;
    }
    let device = WgpuDevice::default();
    let amsgrad = AdamConfig::new().with_amsgrad(true);
    let fused = FusedAdam::new(&amsgrad).unwrap();
    assert!(!fused.fuses::<Plain>());
    let burn = amsgrad.build();
    assert_eq!(
        side_by_side::<Plain, Plain, _, _>(&fused, &burn, &device, &device, 20, 7),
        None
    );
    let cautious = AdamWConfig::new().with_cautious_weight_decay(true);
    let fused = FusedAdamW::new(&cautious).unwrap();
    assert!(!fused.fuses::<Plain>());
    let burn = cautious.build();
    assert_eq!(
        side_by_side::<Plain, Plain, _, _>(&fused, &burn, &device, &device, 20, 8),
        None
    );
}

fn step_at(time: i32) -> AdamStep {
    AdamStep {
        rule: AdamRule::Adam {
            weight_decay: Some(0.01),
        },
        lr: 1e-2,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-5,
        time,
        factor: None,
    }
}

/// The identity of the memory a plain tensor's buffer lives in, as cubecl names it. Only the
/// id: the location printed beside it is filled in by the device thread once the buffer is
/// allocated, so it may read as unallocated before a kernel and allocated after it.
fn buffer(tensor: &CubeTensor<WgpuRuntime>) -> String {
    let debug = format!("{:?}", tensor.handle.memory);
    let start = debug
        .find("ManagedMemoryId")
        .expect("cubecl's handle names its ManagedMemoryId");
    let end = start
        + debug[start..]
            .find('}')
            .expect("the id closes with a brace");
    debug[start..=end].to_string()
}

/// Unshared buffers made on this thread are updated where they are; a shared parameter or
/// moment is left as it was and the result goes into a new buffer, as does one made on
/// another thread.
#[test]
fn kernel_writes_in_place_only_what_nothing_else_holds() {
    if !runs("kernel_writes_in_place_only_what_nothing_else_holds") {
        return;
    }
    let device = WgpuDevice::default();
    let n = 1000;
    let (p0, g) = (start(n, 1), start(n, 2));
    let (m0, v0): (Vec<f32>, Vec<f32>) = (start(n, 3), start(n, 4).iter().map(|x| x * x).collect());
    let prim = |values: &[f32]| upload::<Plain>(values, &device);

    // Unshared: the outputs are the inputs' buffers.
    let (p, m, v) = (prim(&p0), prim(&m0), prim(&v0));
    let before = [buffer(&p), buffer(&m), buffer(&v)];
    let (np, nm, nv) = adam_step_kernel::<Plain>(&step_at(3), p, prim(&g), Some((m, v)))
        .unwrap()
        .unwrap();
    assert_eq!([buffer(&np), buffer(&nm), buffer(&nv)], before);
    let (mut hp, mut hm, mut hv) = (p0.clone(), m0.clone(), v0.clone());
    adam_step(&step_at(3), &mut hp, &g, &mut hm, &mut hv, 1);
    for (device, host) in [(np, &hp), (nm, &hm), (nv, &hv)] {
        let device: Vec<u32> = download::<Plain>(device)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let host: Vec<u32> = host.iter().map(|x| x.to_bits()).collect();
        assert_eq!(device, host);
    }

    // Shared: the inputs keep their values.
    let (p, m, v) = (prim(&p0), prim(&m0), prim(&v0));
    let (kept_p, kept_m, kept_v) = (p.clone(), m.clone(), v.clone());
    let (np, nm, nv) = adam_step_kernel::<Plain>(&step_at(3), p, prim(&g), Some((m, v)))
        .unwrap()
        .unwrap();
    assert_ne!(buffer(&np), buffer(&kept_p));
    assert_ne!(buffer(&nm), buffer(&kept_m));
    assert_ne!(buffer(&nv), buffer(&kept_v));
    assert_eq!(download::<Plain>(kept_p), p0);
    assert_eq!(download::<Plain>(kept_m), m0);
    assert_eq!(download::<Plain>(kept_v), v0);
    assert_eq!(download::<Plain>(np), hp);

    // Unshared but made on another thread's stream, which would not wait for this thread's
    // writes: new buffers, the same values.
    let (p, m, v) = std::thread::scope(|scope| {
        scope
            .spawn(|| (prim(&p0), prim(&m0), prim(&v0)))
            .join()
            .expect("the uploading thread")
    });
    let before = [buffer(&p), buffer(&m), buffer(&v)];
    let (np, nm, nv) = adam_step_kernel::<Plain>(&step_at(3), p, prim(&g), Some((m, v)))
        .unwrap()
        .unwrap();
    for (after, before) in [buffer(&np), buffer(&nm), buffer(&nv)].iter().zip(&before) {
        assert_ne!(after, before);
    }
    assert_eq!(download::<Plain>(np), hp);
    assert_eq!(download::<Plain>(nm), hm);
    assert_eq!(download::<Plain>(nv), hv);
}

/// A gradient in another layout (a transposed view) is read element by element, in its
/// logical order; `None` moments after the first step are zeros.
#[test]
fn strided_gradient_and_zero_moments() {
    if !runs("strided_gradient_and_zero_moments") {
        return;
    }
    let device = WgpuDevice::default();
    let (rows, cols) = (33, 32);
    let p0 = start(rows * cols, 5);
    let stored = start(rows * cols, 6);
    // `stored` is [cols, rows]; its transpose is the [rows, cols] gradient.
    let grad =
        Tensor::<Plain, 2>::from_data(TensorData::new(stored.clone(), [cols, rows]), &device)
            .transpose();
    let logical: Vec<f32> = (0..rows * cols)
        .map(|k| stored[(k % cols) * rows + k / cols])
        .collect();
    let param = Tensor::<Plain, 2>::from_data(TensorData::new(p0.clone(), [rows, cols]), &device);
    let (np, nm, nv) = adam_step_kernel::<Plain>(
        &step_at(4),
        param.into_primitive().tensor(),
        grad.into_primitive().tensor(),
        None,
    )
    .unwrap()
    .unwrap();
    let (mut hp, mut hm, mut hv) = (p0, vec![0.0; rows * cols], vec![0.0; rows * cols]);
    adam_step(&step_at(4), &mut hp, &logical, &mut hm, &mut hv, 1);
    let read = |t| -> Vec<u32> {
        Tensor::<Plain, 2>::from_primitive(TensorPrimitive::Float(t))
            .into_data()
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    };
    let host = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
    assert_eq!(read(np), host(&hp));
    assert_eq!(read(nm), host(&hm));
    assert_eq!(read(nv), host(&hv));
}

#[test]
fn wrong_dtype_and_lengths_are_refused_by_name() {
    if !runs("wrong_dtype_and_lengths_are_refused_by_name") {
        return;
    }
    let device = WgpuDevice::default();
    let p = || upload::<Plain>(&start(64, 1), &device);
    // `from_data` stores floats in the backend's default dtype, so the f16 copy is a cast.
    let half = Tensor::<Plain, 1>::from_data(TensorData::new(start(64, 2), [64]), &device)
        .cast(DType::F16);
    assert_eq!(half.dtype(), DType::F16, "the test needs an f16 gradient");
    let half = half.into_primitive().tensor();
    let error = adam_step_kernel::<Plain>(&step_at(1), p(), half, None)
        .unwrap()
        .unwrap_err();
    assert_eq!(
        error,
        KernelError::UnsupportedDType {
            dtype: DType::F16,
            path: "Adam kernel"
        }
    );
    let short = upload::<Plain>(&start(63, 3), &device);
    let error = adam_step_kernel::<Plain>(&step_at(1), p(), short, None)
        .unwrap()
        .unwrap_err();
    assert_eq!(
        error,
        KernelError::GradientSize {
            expected: 64,
            actual: 63
        }
    );
    let long = upload::<Plain>(&start(65, 4), &device);
    let error = adam_step_kernel::<Plain>(&step_at(2), p(), p(), Some((p(), long)))
        .unwrap()
        .unwrap_err();
    assert_eq!(
        error,
        KernelError::GradientSize {
            expected: 64,
            actual: 65
        }
    );
}

/// Every combination of SGD's options.
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

/// `FusedSgd` on `B` (the kernel) against its host pass on Flex and against Burn's SGD on
/// `B`, every option combination, `steps` steps each.
fn fused_sgd_against_host_and_burn<B: Backend<Device = WgpuDevice>>(steps: usize) {
    let device = WgpuDevice::default();
    let host = Default::default();
    let mut failures = Vec::new();
    for (i, config) in sgd_configs().iter().enumerate() {
        let fused = FusedSgd::new(config).unwrap();
        assert!(fused.fuses::<B>(), "FusedSgd takes the kernel");
        let seed = 0x5_6D + i as u64;
        if let Some(t) = side_by_side::<B, Flex, _, _>(&fused, &fused, &device, &host, steps, seed)
        {
            failures.push(format!("SGD #{i}: kernel vs host pass, step {t}"));
        }
        let burn = config.build::<B>();
        if let Some(t) = side_by_side::<B, B, _, _>(&fused, &burn, &device, &device, steps, seed) {
            failures.push(format!("SGD #{i}: kernel vs Burn's SGD, step {t}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn fused_sgd_on_plain_wgpu_is_the_host_pass_and_burns_bit_for_bit() {
    if !runs("fused_sgd_on_plain_wgpu_is_the_host_pass_and_burns_bit_for_bit") {
        return;
    }
    fused_sgd_against_host_and_burn::<Plain>(300);
}

#[test]
fn fused_sgd_on_fused_wgpu_is_the_host_pass_and_burns_bit_for_bit() {
    if !runs("fused_sgd_on_fused_wgpu_is_the_host_pass_and_burns_bit_for_bit") {
        return;
    }
    fused_sgd_against_host_and_burn::<Fused>(300);
}

#[test]
fn sgd_kernel_refuses_wrong_dtype_and_lengths_by_name() {
    if !runs("sgd_kernel_refuses_wrong_dtype_and_lengths_by_name") {
        return;
    }
    let device = WgpuDevice::default();
    let step = SgdStep {
        lr: 1e-2,
        weight_decay: None,
        momentum: Some(SgdMomentum {
            momentum: 0.9,
            keep_grad: 1.0,
            nesterov: false,
            first: false,
        }),
        factor: None,
    };
    let p = || upload::<Plain>(&start(64, 1), &device);
    let half = Tensor::<Plain, 1>::from_data(TensorData::new(start(64, 2), [64]), &device)
        .cast(DType::F16);
    let half = half.into_primitive().tensor();
    let error = sgd_step_kernel::<Plain>(&step, p(), half, None)
        .unwrap()
        .unwrap_err();
    assert_eq!(
        error,
        KernelError::UnsupportedDType {
            dtype: DType::F16,
            path: "SGD kernel"
        }
    );
    let long = upload::<Plain>(&start(65, 4), &device);
    let error = sgd_step_kernel::<Plain>(&step, p(), p(), Some(long))
        .unwrap()
        .unwrap_err();
    assert_eq!(
        error,
        KernelError::GradientSize {
            expected: 64,
            actual: 65
        }
    );
}

/// The launch's half-precision copy of the new parameter is Burn's cast of that parameter on
/// the same device, bit for bit, over steps with a gradient multiplier; the parameter and
/// moments stay the host pass's. Each copy dtype the adapter stores (lavapipe: f16, not bf16).
#[test]
fn kernel_half_copy_is_burns_cast_bit_for_bit() {
    let test = "kernel_half_copy_is_burns_cast_bit_for_bit";
    if !runs(test) {
        return;
    }
    let device = WgpuDevice::default();
    let mut checked = 0;
    for dtype in [DType::F16, DType::BF16] {
        if !Plain::supports_dtype(&device, dtype) {
            continue;
        }
        checked += 1;
        let n = 1031;
        let mut rng = Rng::new(0xC0B1);
        let (mut hp, mut hm, mut hv) = (start(n, 5), vec![0.0f32; n], vec![0.0f32; n]);
        let (mut p, mut moments) = (upload::<Plain>(&hp, &device), None);
        for t in 1..=20 {
            let g = gradient(&mut rng, n, t);
            let step = AdamStep {
                factor: Some(0.37),
                ..step_at(t as i32)
            };
            let (np, nm, nv, copy) = adam_step_kernel_copying::<Plain>(
                &step,
                p,
                upload::<Plain>(&g, &device),
                moments,
                Some(dtype),
            )
            .unwrap()
            .unwrap();
            adam_step(&step, &mut hp, &g, &mut hm, &mut hv, 1);
            // The copy is Burn's cast of the launch's parameter on the same device.
            let cast = |t: Tensor<Plain, 1>| -> Vec<u32> {
                t.into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .unwrap()
                    .into_iter()
                    .map(f32::to_bits)
                    .collect()
            };
            let copy = Tensor::<Plain, 1>::from_primitive(TensorPrimitive::Float(
                copy.expect("a copy was asked for"),
            ));
            assert_eq!(copy.dtype(), dtype);
            let burns = Tensor::<Plain, 1>::from_primitive(TensorPrimitive::Float(np.clone()));
            assert_eq!(
                cast(copy),
                cast(burns.cast(dtype)),
                "{dtype:?} copy at step {t}"
            );
            let (np2, nm2, nv2) = (np.clone(), nm.clone(), nv.clone());
            for (device, host, what) in [(np2, &hp, "parameter"), (nm2, &hm, "m"), (nv2, &hv, "v")]
            {
                let device: Vec<u32> = download::<Plain>(device)
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                let host: Vec<u32> = host.iter().map(|x| x.to_bits()).collect();
                assert_eq!(device, host, "{dtype:?} step {t}: {what}");
            }
            p = np;
            moments = Some((nm, nv));
        }
    }
    if checked == 0 {
        skip::dtype_supported(test, false, "f16 or bf16 storage", "");
    }
}

/// A copy in a dtype other than f16 and bf16 is refused by name, before anything is launched.
#[test]
fn kernel_copy_in_another_dtype_is_refused() {
    if !runs("kernel_copy_in_another_dtype_is_refused") {
        return;
    }
    let device = WgpuDevice::default();
    let p = upload::<Plain>(&[1.0, 2.0], &device);
    let g = upload::<Plain>(&[0.5, 0.5], &device);
    let refused = adam_step_kernel_copying::<Plain>(&step_at(1), p, g, None, Some(DType::F64))
        .unwrap()
        .err();
    assert!(
        matches!(
            refused,
            Some(KernelError::UnsupportedDType {
                dtype: DType::F64,
                ..
            })
        ),
        "{refused:?}"
    );
    let p = upload::<Plain>(&[1.0, 2.0], &device);
    let g = upload::<Plain>(&[0.5, 0.5], &device);
    let step = SgdStep {
        lr: 1e-2,
        weight_decay: None,
        momentum: None,
        factor: None,
    };
    let refused = sgd_step_kernel_copying::<Plain>(&step, p, g, None, Some(DType::I32))
        .unwrap()
        .err();
    assert_eq!(
        refused,
        Some(KernelError::UnsupportedDType {
            dtype: DType::I32,
            path: "SGD kernel's half-precision copy",
        })
    );
}

/// The SGD launch's half-precision copy likewise: Burn's cast of the launch's parameter on the
/// same device, bit for bit, over steps with a gradient multiplier, with and without momentum;
/// the parameter and velocity stay the host pass's.
#[test]
fn sgd_kernel_half_copy_is_burns_cast_bit_for_bit() {
    let test = "sgd_kernel_half_copy_is_burns_cast_bit_for_bit";
    if !runs(test) {
        return;
    }
    let device = WgpuDevice::default();
    let mut checked = 0;
    let to_bits = |values: &[f32]| -> Vec<u32> { values.iter().map(|x| x.to_bits()).collect() };
    for dtype in [DType::F16, DType::BF16] {
        if !Plain::supports_dtype(&device, dtype) {
            continue;
        }
        checked += 1;
        for nesterov in [None, Some(true)] {
            let n = 1031;
            let mut rng = Rng::new(0x5C0B1);
            let (mut hp, mut hv) = (start(n, 6), vec![0.0f32; n]);
            let (mut p, mut velocity) = (upload::<Plain>(&hp, &device), None);
            for t in 0..20 {
                let g = gradient(&mut rng, n, t + 1);
                let step = SgdStep {
                    lr: 1e-2,
                    weight_decay: Some(0.05),
                    momentum: nesterov.map(|nesterov| SgdMomentum {
                        momentum: 0.9,
                        keep_grad: 0.75,
                        nesterov,
                        first: t == 0,
                    }),
                    factor: Some(0.37),
                };
                let (np, nv, copy) = sgd_step_kernel_copying::<Plain>(
                    &step,
                    p,
                    upload::<Plain>(&g, &device),
                    velocity,
                    Some(dtype),
                )
                .unwrap()
                .unwrap();
                sgd_step(&step, &mut hp, &g, Some(&mut hv), 1);
                let what = format!("{dtype:?}, momentum {nesterov:?}, step {t}");
                let copy = Tensor::<Plain, 1>::from_primitive(TensorPrimitive::Float(
                    copy.expect("a copy was asked for"),
                ));
                assert_eq!(copy.dtype(), dtype);
                let burns = Tensor::<Plain, 1>::from_primitive(TensorPrimitive::Float(np.clone()));
                let cast = |t: Tensor<Plain, 1>| {
                    to_bits(&t.into_data().convert::<f32>().to_vec::<f32>().unwrap())
                };
                assert_eq!(cast(copy), cast(burns.cast(dtype)), "{what}: copy");
                assert_eq!(
                    to_bits(&download::<Plain>(np.clone())),
                    to_bits(&hp),
                    "{what}: parameter"
                );
                assert_eq!(nv.is_some(), nesterov.is_some(), "{what}: velocity");
                if let Some(nv) = &nv {
                    assert_eq!(
                        to_bits(&download::<Plain>(nv.clone())),
                        to_bits(&hv),
                        "{what}: velocity"
                    );
                }
                (p, velocity) = (np, nv);
            }
        }
    }
    if checked == 0 {
        skip::dtype_supported(test, false, "f16 or bf16 storage", "");
    }
}
