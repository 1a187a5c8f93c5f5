//! The model of the device-memory tests: four 1024 × 1024 linear layers without bias (4 MiB of
//! f32 each, so that what a placement moves shows in the device's count), and each step's
//! input made on the host from a fixed pattern, the same in every run.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

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
