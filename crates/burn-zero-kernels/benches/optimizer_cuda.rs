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
//! Numerics: the kernel and `burn_zero_kernels::host::adam_step` take 20 steps from the same
//! start on the same gradients, and the parameters are compared: bitwise equal, or the largest
//! difference in units in the last place (NVRTC may contract a multiply and an add into one
//! fused operation where Mesa's lavapipe, where the tests run, does not).
//!
//! Prints a table; `OPTIMIZER_CUDA_REPORT=path` also writes JSON there. Without a CUDA device
//! it says it was skipped (and writes `{"skipped": ...}`).

use std::time::Instant;

use burn::optim::{AdamConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_zero_kernels::host::{AdamRule, AdamStep, adam_step};
use burn_zero_optim::FusedAdam;
use cubecl::cuda::{CudaDevice, CudaRuntime};

type B = CubeBackend<CudaRuntime, f32, i32, u8>;

const SIZES: [usize; 3] = [1_000_000, 10_000_000, 50_000_000];
const WARM_UP: usize = 3;
const ROUNDS: usize = 5;
const CHECK_STEPS: usize = 20;
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

/// `CHECK_STEPS` steps of the kernel (through `FusedAdam`) and of the host pass from the same
/// start: (bitwise equal, largest difference in ulps).
fn against_host(fused: &FusedAdam, n: usize, device: &CudaDevice) -> (bool, u32) {
    let start = values(n, 4);
    let mut host = start.clone();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut param = upload(&start, device);
    let mut state = None;
    for t in 1..=CHECK_STEPS {
        let g = values(n, 100 + t as u64);
        (param, state) = fused.step(LR, param, upload(&g, device), state);
        let step = AdamStep {
            rule: AdamRule::Adam { weight_decay: None },
            lr: LR as f32,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            time: t as i32,
            factor: None,
        };
        adam_step(&step, &mut host, &g, &mut m, &mut v, 1);
    }
    let device_values = param.into_data().to_vec::<f32>().expect("f32");
    let ulps = device_values
        .iter()
        .zip(&host)
        .map(|(a, b)| (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32)
        .max()
        .unwrap_or(0);
    (ulps == 0, ulps)
}

fn run(device: &CudaDevice) -> serde_json::Value {
    let fused = FusedAdam::new(&AdamConfig::new()).expect("Burn's default Adam fuses");
    assert!(fused.fuses::<B>(), "FusedAdam takes the kernel on CUDA");
    let burn = AdamConfig::new().build();
    let mut table = String::from(
        "| size | FusedAdam (kernel) ms | Burn Adam ms | speed-up | kernel GB/s | copy GB/s | \
         of copy | kernel vs host pass |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut rows = Vec::new();
    for n in SIZES {
        let kernel = time_steps(&fused, n, device);
        let per_tensor = time_steps(&burn, n, device);
        let copy = time_copy(n, device);
        let kernel_gbps = 28.0 * n as f64 / kernel / 1e9;
        let copy_gbps = 8.0 * n as f64 / copy / 1e9;
        let (bitwise, ulps) = against_host(&fused, n.min(1_000_000), device);
        table += &format!(
            "| {}M | {:.3} | {:.3} | {:.1}× | {kernel_gbps:.0} | {copy_gbps:.0} | {:.0}% | {} |\n",
            n / 1_000_000,
            kernel * 1e3,
            per_tensor * 1e3,
            per_tensor / kernel,
            100.0 * kernel_gbps / copy_gbps,
            if bitwise {
                "bitwise".to_string()
            } else {
                format!("≤ {ulps} ulp")
            }
        );
        rows.push(serde_json::json!({
            "parameters": n,
            "fused_kernel_s": kernel,
            "burn_adam_s": per_tensor,
            "kernel_gb_per_s": kernel_gbps,
            "copy_gb_per_s": copy_gbps,
            "kernel_bitwise_with_host": bitwise,
            "kernel_max_ulps_from_host": ulps,
        }));
    }
    println!("\n{table}");
    serde_json::json!({ "dtype": "f32", "results": rows })
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
