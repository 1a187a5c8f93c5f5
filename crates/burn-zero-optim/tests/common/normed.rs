//! The model of the bucket-order tests: `LAYERS` linear layers of `WIDTH`², each followed by a
//! LayerNorm. burn-autodiff runs backward level by level of node depth, so a LayerNorm's scale
//! and shift, which enter the graph through a shallow broadcast, get their gradients only when
//! backward ends, while the weights' gradients come one layer at a time before: what decides
//! whether a gradient bucket can be reduced while backward still runs.

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

pub const WIDTH: usize = 256;
pub const LAYERS: usize = 16;
/// Bytes of one weight's full f32 gradient.
pub const WEIGHT_BYTES: usize = WIDTH * WIDTH * 4;

#[derive(Module, Debug)]
pub struct Layer<B: Backend> {
    linear: Linear<B>,
    norm: LayerNorm<B>,
}

/// `LAYERS` × (linear `WIDTH`², LayerNorm).
#[derive(Module, Debug)]
pub struct NormedStack<B: Backend> {
    layers: Vec<Layer<B>>,
}

impl<B: Backend> NormedStack<B> {
    pub fn new(device: &B::Device) -> Self {
        Self {
            layers: (0..LAYERS)
                .map(|_| Layer {
                    linear: LinearConfig::new(WIDTH, WIDTH).init(device),
                    norm: LayerNormConfig::new(WIDTH).init(device),
                })
                .collect(),
        }
    }

    /// The mean square of the output for `input`.
    pub fn loss(&self, input: Tensor<B, 2>) -> Tensor<B, 1> {
        let mut x = input;
        for layer in &self.layers {
            x = layer.norm.forward(layer.linear.forward(x));
        }
        x.powf_scalar(2.0).mean()
    }
}

/// Four rows of `WIDTH` from a fixed pattern, different for each `step` and `rank`.
pub fn input<B: Backend>(step: usize, rank: usize, device: &B::Device) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..4 * WIDTH)
        .map(|i| ((i * 7 + step * 13 + rank * 5) % 17) as f32 / 17.0 - 0.5)
        .collect();
    Tensor::from_data(TensorData::new(values, [4, WIDTH]), device)
}
