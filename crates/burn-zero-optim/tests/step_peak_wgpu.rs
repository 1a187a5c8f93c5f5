//! What an optimizer step adds on the device, measured outside the library: one rank on
//! `CubeBackend<WgpuRuntime>` (Mesa's lavapipe where there is no GPU) trains the four
//! 1024 × 1024 layers of the device-memory tests at stage 3, parameter shards on the device and
//! the optimizer on Flex (`Offload<Flex>`), so that what the device holds during a step is the
//! parameters, old and new. The optimizer is Burn's Adam behind a wrapper that reads cubecl's
//! own count of the device's bytes in use (`burn_zero_kernels::device_memory`) each time it is
//! called, once per parameter or per chunk, in the order the step reaches them.
//!
//! While the step goes from one parameter (or chunk) to the next, the device holds each
//! parameter's old values until its new ones replace it in the module, and no longer: at any
//! call, at most one layer more than the model's parameters, where stepping every chunk before
//! writing any back (or keeping every old value until the step ends) would hold the parameters
//! twice by the last call. Both layouts are measured (one parameter per chunk, and chunks of
//! one layer), and both train the same bits as each other.
//!
//! A binary of its own: the count is the whole device's, so no other test may allocate on it
//! meanwhile. Without a wgpu adapter the test says it was skipped, unless
//! `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

use std::sync::{Arc, Mutex};

use burn::backend::wgpu::WgpuDevice;
use burn::optim::{Adam, AdamConfig, GradientsParams, LearningRate, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Device, Tensor};
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, Placement, ZeroConfig, ZeroError, shard};
use burn_zero_kernels::device_memory;
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{param_values, params_bits_equal};

#[path = "common/stack.rs"]
mod stack;

use stack::{LAYERS, Plain, Stack, Train, WIDTH, can_measure, input};

/// Steps: the first makes the optimizer's state; the later ones are measured.
const STEPS: usize = 3;

/// Burn's Adam, reading the device's bytes in use at each call (it steps on the host here).
#[derive(Clone)]
struct Watching {
    adam: Adam,
    readings: Arc<Mutex<Vec<u64>>>,
}

impl<B: Backend> SimpleOptimizer<B> for Watching {
    type State<const D: usize> = <Adam as SimpleOptimizer<B>>::State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let memory = device_memory::<Plain>(&WgpuDevice::default()).expect("a cubecl backend");
        self.readings.lock().unwrap().push(memory.in_use);
        self.adam.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        <Adam as SimpleOptimizer<B>>::to_device(state, device)
    }
}

/// Trains `base` with `chunk_size`: each measured step's readings, and the final parameters.
fn train(base: &Stack<Train>, chunk_size: ChunkSize) -> (Vec<Vec<u64>>, Vec<Vec<f32>>) {
    let device = WgpuDevice::default();
    // No gather cache and the reduction after backward: the device holds the parameters, and
    // the gradients until they move to the host for the step.
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_chunk_size(chunk_size)
        .with_max_live_gathered_bytes(0)
        .with_overlap_comm(false)
        .with_placement(Placement::fractions(0.0, 1.0));
    let mut ranks = launch::<Plain, _, _, ZeroError>(1, std::slice::from_ref(&device), |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let readings = Arc::new(Mutex::new(Vec::new()));
        let watching = Watching {
            adam: AdamConfig::new().build(),
            readings: readings.clone(),
        };
        // Every chunk's optimizer state on the host: the device side steps nothing.
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(watching))?;
        let mut steps = Vec::new();
        for step in 0..STEPS {
            let input = input::<Train>(step, ctx.device());
            let grads = GradientsParams::from_grads(model.loss(input).backward(), &model);
            Plain::sync(ctx.device()).unwrap();
            readings.lock().unwrap().clear();
            model = optimizer.step(1e-3, model, grads);
            if step > 0 {
                steps.push(std::mem::take(&mut *readings.lock().unwrap()));
            }
        }
        Ok((steps, param_values(&model)))
    })
    .unwrap();
    ranks.swap_remove(0)
}

#[test]
fn a_step_holds_one_parameter_twice_at_most() {
    let test = "a_step_holds_one_parameter_twice_at_most";
    if !can_measure(test) {
        return;
    }
    let device = WgpuDevice::default();
    let layer = (WIDTH * WIDTH * 4) as u64;
    let base = Stack::<Train>::drawn(&device);

    let mut finals = Vec::new();
    for chunk_size in [ChunkSize::PerParameter, ChunkSize::Elements(WIDTH * WIDTH)] {
        let (steps, params) = train(&base, chunk_size);
        println!("{chunk_size:?}: bytes in use at each call of the optimizer, by step: {steps:?}");
        for readings in &steps {
            assert_eq!(
                readings.len(),
                LAYERS,
                "{chunk_size:?}: one call per layer: {readings:?}"
            );
            let first = readings[0];
            let most = readings.iter().copied().max().unwrap();
            assert!(
                most - first < layer,
                "{chunk_size:?}: the step went from {first} to {most} B in use on the device, \
                 more than one layer ({layer} B) above its start: {readings:?}"
            );
        }
        finals.push(params);
    }
    assert!(
        params_bits_equal(&finals[0], &finals[1]),
        "one parameter per chunk and one layer per chunk train the same bits"
    );
}
