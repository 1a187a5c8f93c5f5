//! The text sample a run ends with.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};

use super::RunConfig;
use crate::{Corpus, Gpt, mix};

/// Prompt of the generated sample.
pub const PROMPT: &str = "Phileas Fogg";

/// `config.sample_len` characters after [`PROMPT`], each drawn from the model's distribution at
/// `config.temperature` (greedy at 0) with randomness from the seed alone, so every rank draws
/// the same ones.
pub(super) fn generate<B: Backend>(
    model: &Gpt<B>,
    corpus: &Corpus,
    config: &RunConfig,
    device: &B::Device,
) -> String {
    let mut ids = corpus.encode(PROMPT);
    for i in 0..config.sample_len {
        let window = &ids[ids.len().saturating_sub(config.seq_len)..];
        let len = window.len();
        let tokens: Vec<i64> = window.iter().map(|&id| id as i64).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [1, len]), device);
        let logits = model.forward(tokens);
        let vocab = logits.dims()[2];
        let last = logits
            .slice([0..1, len - 1..len, 0..vocab])
            .cast(DType::F32);
        let logits = last.into_data().to_vec::<f32>().expect("f32 logits");
        let next = if config.temperature <= 0.0 {
            argmax(&logits)
        } else {
            let u = (mix(config.seed ^ 0x5A4D_504C, i as u64) >> 11) as f64 / (1u64 << 53) as f64;
            draw(&logits, config.temperature, u)
        };
        ids.push(next);
    }
    corpus.decode(&ids)
}

fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// The index where the cumulative softmax(logits / temperature) first exceeds `u` ∈ [0, 1).
fn draw(logits: &[f32], temperature: f32, u: f64) -> usize {
    let max = logits[argmax(logits)];
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| (((l - max) / temperature) as f64).exp())
        .collect();
    let mut left = u * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if left < *w {
            return i;
        }
        left -= w;
    }
    weights.len() - 1
}
