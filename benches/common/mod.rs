//! What the benchmarks share: the report writer, a ~50M-parameter model and the timed
//! collectives (`collective`).

#![allow(dead_code)]

pub mod collective;
pub mod report;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// Width of the benchmark model's layers: 1024² weights are 4 MiB gradients in f32.
pub const WIDTH: usize = 1024;
/// 48 layers of 1024² + bias ≈ 50.4M parameters.
pub const LAYERS: usize = 48;

/// A stack of linear layers of about 50M parameters, cheap to run at batch 1.
#[derive(Module, Debug)]
pub struct Deep<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: Backend> Deep<B> {
    pub fn new(device: &B::Device) -> Self {
        Self {
            layers: (0..LAYERS)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
                .collect(),
        }
    }

    pub fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            x = layer.forward(x);
        }
        x
    }
}

/// Prints a markdown report and writes it to `target/bench-reports/<name>.md`.
pub fn publish(name: &str, report: &str) {
    report::publish(name, report, None);
}
