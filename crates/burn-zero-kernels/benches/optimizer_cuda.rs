//! The fused Adam kernel on a CUDA device (feature `cuda`), for the GPU check
//! (`scripts/gpu-check.sh`): one Adam step over one flat f32 shard of 1M, 10M and 50M
//! parameters with `FusedAdam` (one launch of burn-zero's kernel per step) against Burn's
//! per-tensor `Adam` on the same `CubeBackend<CudaRuntime>`, and against the device's copy
//! bandwidth (Burn's device copy of a tensor of the same size).
//!
//! *Traffic* is 28 bytes per parameter (read parameter, gradient and both moments, write
//! three back); the copy moves 8 bytes per element (read and write). A GPU steps 50M
//! parameters in a millisecond or so, so each round times a batch of steps with one device
//! synchronisation at the end; medians of 5 rounds after 3 warm-up steps.
//!
//! Numerics: CUDA's kernels write every multiply-add as one `fma` (NVRTC would contract them
//! anyway), so their reference is the host pass with `f32::mul_add` at the same places
//! (`host::adam_step_with`/`sgd_step_with` with `MultiplyAdd::Fused`). Adam, Adam with L2
//! decay, AdamW and SGD (momentum, dampening, Nesterov, decay) each take 1,000 steps on the
//! kernel and on the host from the same start on the same gradients, over 100,003 elements
//! (scalar loads) and 100,000 (vectors); parameter and state are compared after the last
//! step: the largest difference in units in the last place against the fused reference (0
//! expected) and, for information, against the separately rounded pass (Burn's own).
//!
//! Prints a table; `OPTIMIZER_CUDA_REPORT=path` also writes JSON there. Without a CUDA device
//! it says it was skipped (and writes `{"skipped": ...}`).

use std::time::Instant;

use burn::optim::{AdamConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_zero_kernels::host::{
    AdamRule, AdamStep, MultiplyAdd, SgdMomentum, SgdStep, adam_step_with, sgd_step_with,
};
use burn_zero_kernels::{adam_step_kernel, kernel_multiply_add, sgd_step_kernel};
use burn_zero_optim::FusedAdam;
use cubecl::cuda::{CudaDevice, CudaRuntime};

type B = CubeBackend<CudaRuntime, f32, i32, u8>;

const SIZES: [usize; 3] = [1_000_000, 10_000_000, 50_000_000];
const WARM_UP: usize = 3;
const ROUNDS: usize = 5;
const CHECK_STEPS: usize = 1000;
const CHECK_SIZES: [usize; 2] = [100_003, 100_000];
const LR: f64 = 1e-3;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn upload(values: &[f32], device: &CudaDevice) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// Median seconds per step of `optimizer` on a shard of `n`: batches of `steps` steps, one
/// synchronisation per batch.
fn time_steps<O: SimpleOptimizer<B>>(optimizer: &O, n: usize, device: &CudaDevice) -> f64 {
    let steps = (200_000_000 / n).clamp(5, 100);
    let mut param = upload(&values(n, 1), device);
    let grad = upload(&values(n, 2), device);
    let mut state = None;
    let step = |param: Tensor<B, 1>, state| optimizer.step(LR, param, grad.clone(), state);
    for _ in 0..WARM_UP {
        (param, state) = step(param, state);
    }
    B::sync(device).expect("sync");
    let mut per_step = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..steps {
            (param, state) = step(param, state);
        }
        B::sync(device).expect("sync");
        per_step.push(started.elapsed().as_secs_f64() / steps as f64);
    }
    median(per_step)
}

/// Median seconds of Burn's device copy of an `n`-element tensor.
fn time_copy(n: usize, device: &CudaDevice) -> f64 {
    let source = upload(&values(n, 3), device).into_primitive().tensor();
    let calls = (200_000_000 / n).clamp(5, 100);
    let _ = source.copy();
    B::sync(device).expect("sync");
    let mut per_call = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..calls {
            std::hint::black_box(source.copy());
        }
        B::sync(device).expect("sync");
        per_call.push(started.elapsed().as_secs_f64() / calls as f64);
    }
    median(per_call)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The largest distance in ulps between two f32 slices (bit patterns of one sign apart are
/// that many representable values apart; across signs the distance through zero).
fn max_ulps(a: &[f32], b: &[f32]) -> u32 {
    let ordered = |x: f32| {
        let bits = x.to_bits() as i64;
        if bits < 0x8000_0000 {
            bits
        } else {
            0x8000_0000 - bits
        }
    };
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            (ordered(*x) - ordered(*y))
                .unsigned_abs()
                .min(u32::MAX as u64) as u32
        })
        .max()
        .unwrap_or(0)
}

fn primitive(values: &[f32], device: &CudaDevice) -> burn_cubecl::tensor::CubeTensor<CudaRuntime> {
    upload(values, device).into_primitive().tensor()
}

fn host_values(tensor: burn_cubecl::tensor::CubeTensor<CudaRuntime>) -> Vec<f32> {
    Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(tensor))
        .into_data()
        .to_vec::<f32>()
        .expect("f32")
}

/// One optimizer's check: its name, elements, and the largest ulp distance of the kernel's
/// parameter and state from the fused and from the rounded host pass.
struct Check {
    name: String,
    elements: usize,
    ulps_fused: u32,
    ulps_rounded: u32,
}

/// `CHECK_STEPS` Adam steps of `rule` on the kernel and on the host, both roundings.
fn check_adam(name: &str, rule: impl Fn(f64) -> AdamRule, n: usize, device: &CudaDevice) -> Check {
    let start = values(n, 4);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut hosts = [MultiplyAdd::Fused, MultiplyAdd::Rounded]
        .map(|kind| (kind, start.clone(), vec![0.0f32; n], vec![0.0f32; n]));
    let mut param = primitive(&start, device);
    let mut moments = None;
    for t in 1..=CHECK_STEPS {
        let g = values(n, 100 + t as u64);
        let lr = LR * (1.0 + (t % 7) as f64 / 7.0);
        let step = AdamStep {
            rule: rule(lr),
            lr: lr as f32,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            time: t as i32,
            factor: (t % 3 == 0).then_some(0.5),
        };
        for (kind, p, m, v) in &mut hosts {
            adam_step_with(&step, *kind, p, &g, m, v, threads);
        }
        let (p, m, v) = adam_step_kernel::<B>(&step, param, primitive(&g, device), moments)
            .expect("CUDA has the kernel")
            .expect("an f32 step");
        (param, moments) = (p, Some((m, v)));
    }
    let (m, v) = moments.expect("a step was taken");
    let device = [host_values(param), host_values(m), host_values(v)];
    let ulps = |(_, p, m, v): &(MultiplyAdd, Vec<f32>, Vec<f32>, Vec<f32>)| {
        max_ulps(&device[0], p)
            .max(max_ulps(&device[1], m))
            .max(max_ulps(&device[2], v))
    };
    Check {
        name: name.to_string(),
        elements: n,
        ulps_fused: ulps(&hosts[0]),
        ulps_rounded: ulps(&hosts[1]),
    }
}

/// `CHECK_STEPS` SGD steps (momentum 0.9, dampening 0.1, Nesterov, L2 decay, a gradient
/// multiplier every third step) on the kernel and on the host, both roundings.
fn check_sgd(n: usize, device: &CudaDevice) -> Check {
    let start = values(n, 5);
    let mut hosts =
        [MultiplyAdd::Fused, MultiplyAdd::Rounded].map(|kind| (kind, start.clone(), vec![0.0; n]));
    let mut param = primitive(&start, device);
    let mut velocity = None;
    for t in 0..CHECK_STEPS {
        let g = values(n, 300 + t as u64);
        let step = SgdStep {
            lr: 1e-2,
            weight_decay: Some(1e-2),
            momentum: Some(SgdMomentum {
                momentum: 0.9,
                keep_grad: (1.0 - 0.1f64) as f32,
                nesterov: true,
                first: t == 0,
            }),
            factor: (t % 3 == 0).then_some(0.5),
        };
        for (kind, p, v) in &mut hosts {
            sgd_step_with(&step, *kind, p, &g, Some(v), 1);
        }
        let (p, v) = sgd_step_kernel::<B>(&step, param, primitive(&g, device), velocity)
            .expect("CUDA has the kernel")
            .expect("an f32 step");
        (param, velocity) = (p, v);
    }
    let device = [host_values(param), host_values(velocity.expect("momentum"))];
    let ulps = |(_, p, v): &(MultiplyAdd, Vec<f32>, Vec<f32>)| {
        max_ulps(&device[0], p).max(max_ulps(&device[1], v))
    };
    Check {
        name: "SGD, momentum 0.9, dampening 0.1, Nesterov, L2 0.01".to_string(),
        elements: n,
        ulps_fused: ulps(&hosts[0]),
        ulps_rounded: ulps(&hosts[1]),
    }
}

fn numerics(device: &CudaDevice) -> Vec<Check> {
    let mut checks = Vec::new();
    for n in CHECK_SIZES {
        checks.push(check_adam(
            "Adam",
            |_| AdamRule::Adam { weight_decay: None },
            n,
            device,
        ));
        checks.push(check_adam(
            "Adam, L2 0.01",
            |_| AdamRule::Adam {
                weight_decay: Some(0.01),
            },
            n,
            device,
        ));
        checks.push(check_adam(
            "AdamW 0.05",
            |lr| AdamRule::AdamW {
                keep: Some((1.0 - lr * 0.05) as f32),
            },
            n,
            device,
        ));
        checks.push(check_sgd(n, device));
    }
    checks
}

fn run(device: &CudaDevice) -> serde_json::Value {
    let fused = FusedAdam::new(&AdamConfig::new()).expect("Burn's default Adam fuses");
    assert!(fused.fuses::<B>(), "FusedAdam takes the kernel on CUDA");
    let burn = AdamConfig::new().build();
    let mut table = String::from(
        "| size | FusedAdam (kernel) ms | Burn Adam ms | speed-up | kernel GB/s | copy GB/s | \
         of copy |\n|---|---|---|---|---|---|---|\n",
    );
    let mut rows = Vec::new();
    for n in SIZES {
        let kernel = time_steps(&fused, n, device);
        let per_tensor = time_steps(&burn, n, device);
        let copy = time_copy(n, device);
        let kernel_gbps = 28.0 * n as f64 / kernel / 1e9;
        let copy_gbps = 8.0 * n as f64 / copy / 1e9;
        table += &format!(
            "| {}M | {:.3} | {:.3} | {:.1}× | {kernel_gbps:.0} | {copy_gbps:.0} | {:.0}% |\n",
            n / 1_000_000,
            kernel * 1e3,
            per_tensor * 1e3,
            per_tensor / kernel,
            100.0 * kernel_gbps / copy_gbps,
        );
        rows.push(serde_json::json!({
            "parameters": n,
            "fused_kernel_s": kernel,
            "burn_adam_s": per_tensor,
            "kernel_gb_per_s": kernel_gbps,
            "copy_gb_per_s": copy_gbps,
        }));
    }
    println!("\n{table}");
    let multiply_add = kernel_multiply_add::<B>().expect("CUDA has the kernels");
    let mut numbers = format!(
        "kernels against the host pass after {CHECK_STEPS} steps (the kernels' multiply-adds: \
         {multiply_add:?})\n| optimizer | elements | ulps from the fused pass | ulps from the \
         rounded pass |\n|---|---|---|---|\n"
    );
    let mut checks = Vec::new();
    for check in numerics(device) {
        numbers += &format!(
            "| {} | {} | {} | {} |\n",
            check.name, check.elements, check.ulps_fused, check.ulps_rounded
        );
        checks.push(serde_json::json!({
            "optimizer": check.name,
            "elements": check.elements,
            "steps": CHECK_STEPS,
            "max_ulps_from_fused_host": check.ulps_fused,
            "max_ulps_from_rounded_host": check.ulps_rounded,
        }));
    }
    println!("{numbers}");
    serde_json::json!({
        "dtype": "f32",
        "results": rows,
        "kernel_multiply_add": format!("{multiply_add:?}"),
        "numerics": checks,
    })
}

fn main() {
    // Says `SKIPPED: optimizer_cuda: ...` without a device.
    let value = if burn_zero_testing::skip::cuda_devices("optimizer_cuda", 1).is_some() {
        run(&CudaDevice::new(0))
    } else {
        serde_json::json!({ "skipped": "no CUDA device visible" })
    };
    if let Ok(path) = std::env::var("OPTIMIZER_CUDA_REPORT") {
        let text = serde_json::to_string_pretty(&value).expect("json");
        if let Err(error) = std::fs::write(&path, text + "\n") {
            eprintln!("could not write {path}: {error}");
            std::process::exit(1);
        }
    }
}
