//! Parameter offload measured on the device: one rank on `CubeBackend<WgpuRuntime>` (Mesa's
//! lavapipe where there is no GPU) trains a model of four 1024 × 1024 linear layers at stage 3,
//! its optimizer on Flex (`Offload<Flex>`) in both runs, without a gather cache, with every
//! parameter shard on the device and then with every shard in host memory
//! (`offload_param_frac` 1). What the device holds is read from cubecl's own count
//! (`burn_zero_kernels::device_memory`, every stream summed), not from burn-zero's accounting:
//!
//! - between steps the offloaded run holds at least 90% of the shards' bytes (computed here
//!   from the layer shapes) less than the other;
//! - at its peak, sampled through the steps, it holds at least half the shards' bytes less (one
//!   layer's weight is on the device while an op uses it, on top of the gradients);
//! - both runs end with bitwise the same parameters.
//!
//! A binary of its own: the count is the whole device's, so no other test may allocate on it
//! meanwhile. Without a wgpu adapter the test says it was skipped, unless
//! `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

use std::time::Duration;

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, Zero, ZeroConfig, ZeroError, shard};
use burn_zero_kernels::{DeviceMemory, device_memory, peak_device_memory};
use burn_zero_optim::{Offload, ZeroOptimizer};
use burn_zero_testing::{param_values, params_bits_equal, skip};

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
type Train = Autodiff<Zero<Plain>>;

const WIDTH: usize = 1024;
const LAYERS: usize = 4;
const STEPS: usize = 3;
/// How often the device's memory is read during the steps.
const EVERY: Duration = Duration::from_millis(2);

#[derive(Module, Debug)]
struct Stack<B: burn::tensor::backend::Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: AutodiffBackend> Stack<B> {
    fn new(device: &B::Device) -> Self {
        let layers = (0..LAYERS)
            .map(|_| {
                LinearConfig::new(WIDTH, WIDTH)
                    .with_bias(false)
                    .init(device)
            })
            .collect();
        Self { layers }
    }

    fn loss(&self, input: Tensor<B, 2>) -> Tensor<B, 1> {
        let mut x = input;
        for layer in &self.layers {
            x = burn::tensor::activation::relu(layer.forward(x));
        }
        x.powi_scalar(2).mean()
    }
}

/// Step `step`'s input, made on the host from a fixed pattern: the same in every run.
fn input(step: usize, device: &WgpuDevice) -> Tensor<Train, 2> {
    let values: Vec<f32> = (0..4 * WIDTH)
        .map(|i| ((i * 7 + step * 13) % 97) as f32 / 97.0 - 0.5)
        .collect();
    Tensor::from_data(TensorData::new(values, [4, WIDTH]), device)
}

/// Device memory between steps (after the last one, synchronised), its peak over the steps,
/// and the final parameters.
fn train(base: &Stack<Train>, frac: f64) -> (DeviceMemory, DeviceMemory, Vec<Vec<f32>>) {
    let device = WgpuDevice::default();
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_chunk_size(ChunkSize::PerParameter)
        .with_max_live_gathered_bytes(0)
        .with_offload_param_frac(frac);
    let mut ranks = launch::<Plain, _, _, ZeroError>(1, std::slice::from_ref(&device), |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer =
            ZeroOptimizer::<_, _, Offload<Flex>>::offloaded(&zero, AdamConfig::new().build());
        let (model, peak) = peak_device_memory::<Plain, _>(ctx.device(), EVERY, || {
            for step in 0..STEPS {
                let input = input(step, ctx.device());
                let grads = GradientsParams::from_grads(model.loss(input).backward(), &model);
                model = optimizer.step(1e-3, model, grads);
                Plain::sync(ctx.device()).unwrap();
            }
            model
        });
        let between = device_memory::<Plain>(ctx.device()).expect("a cubecl backend");
        let params = param_values(&model);
        Ok((between, peak.expect("a cubecl backend"), params))
    })
    .unwrap();
    ranks.swap_remove(0)
}

#[test]
fn parameters_on_the_host_leave_the_device_by_the_bytes_of_their_shards() {
    if !skip::wgpu_adapter("parameters_on_the_host_leave_the_device_by_the_bytes_of_their_shards") {
        return;
    }
    let device = WgpuDevice::default();
    if device_memory::<Plain>(&device).is_none() {
        skip::skip(
            "parameters_on_the_host_leave_the_device_by_the_bytes_of_their_shards",
            "built without the wgpu kernels (--features wgpu), so there is no device-memory count",
        );
        return;
    }
    let base = Stack::<Train>::new(&device);
    // Burn initialises parameters lazily, and a clone made before would draw its own values:
    // read them once, so that both runs start from the same model.
    let _ = param_values(&base);
    let shards = (LAYERS * WIDTH * WIDTH * 4) as u64;
    let (between_device, peak_device, on_device) = train(&base, 0.0);
    let (between_host, peak_host, on_host) = train(&base, 1.0);
    println!(
        "shards {shards} B; between steps in use {} → {} B; peak in use {} → {} B",
        between_device.in_use, between_host.in_use, peak_device.in_use, peak_host.in_use
    );
    assert!(
        between_device.in_use >= between_host.in_use + shards * 9 / 10,
        "between steps: {between_device:?} on the device, {between_host:?} offloaded, {shards} B \
         of shards"
    );
    assert!(
        peak_device.in_use >= peak_host.in_use + shards / 2,
        "at the peak: {peak_device:?} on the device, {peak_host:?} offloaded, {shards} B of shards"
    );
    assert!(
        params_bits_equal(&on_host, &on_device),
        "offloading changed the trained values"
    );
}
