//! The model of the device-memory tests: four 1024 × 1024 linear layers without bias (4 MiB of
//! f32 each, so that what a placement moves shows in the device's count), and each step's
//! input made on the host from a fixed pattern, the same in every run; and the device they
//! measure, with what they need of it.

use burn::backend::Autodiff;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_zero_core::Zero;
use burn_zero_kernels::device_memory;
use burn_zero_testing::{param_values, skip};

/// The measured backend: cubecl over wgpu, without Burn's fusion layer.
pub type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
/// What the tests train on it.
pub type Train = Autodiff<Zero<Plain>>;

pub const WIDTH: usize = 1024;
pub const LAYERS: usize = 4;

#[derive(Module, Debug)]
pub struct Stack<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: AutodiffBackend> Stack<B> {
    pub fn new(device: &B::Device) -> Self {
        let layers = (0..LAYERS)
            .map(|_| {
                LinearConfig::new(WIDTH, WIDTH)
                    .with_bias(false)
                    .init(device)
            })
            .collect();
        Self { layers }
    }

    /// The model with its values drawn now. Burn initialises parameters lazily, and a clone
    /// made before would draw its own values: read once, every run starts from the same model.
    pub fn drawn(device: &B::Device) -> Self {
        let model = Self::new(device);
        let _ = param_values(&model);
        model
    }

    pub fn loss(&self, input: Tensor<B, 2>) -> Tensor<B, 1> {
        let mut x = input;
        for layer in &self.layers {
            x = burn::tensor::activation::relu(layer.forward(x));
        }
        x.powi_scalar(2).mean()
    }
}

/// Step `step`'s input: four rows of `WIDTH`.
pub fn input<B: Backend>(step: usize, device: &B::Device) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..4 * WIDTH)
        .map(|i| ((i * 7 + step * 13) % 97) as f32 / 97.0 - 0.5)
        .collect();
    Tensor::from_data(TensorData::new(values, [4, WIDTH]), device)
}

/// Whether device-memory test `test` can run: a wgpu adapter, and cubecl's count of the
/// device's memory (built with the `wgpu` feature). Otherwise it says why it is skipped.
pub fn can_measure(test: &str) -> bool {
    if !skip::wgpu_adapter(test) {
        return false;
    }
    if device_memory::<Plain>(&WgpuDevice::default()).is_none() {
        skip::skip(
            test,
            "built without the wgpu kernels (--features wgpu), so there is no device-memory count",
        );
        return false;
    }
    true
}
