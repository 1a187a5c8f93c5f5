//! The GPT as burn-train trains it: [`TextGpt`] (a training and a validation step whose output
//! Burn's loss and accuracy metrics read), a dataset of [`windows`] of the text, and
//! [`WindowBatcher`], which turns window starts into token batches.

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};

use crate::{Corpus, Gpt};

/// The GPT wrapped for burn-train: each position's next symbol is one classified item.
#[derive(Module, Debug)]
pub struct TextGpt<B: Backend> {
    /// The model.
    pub gpt: Gpt<B>,
}

/// Windows of the text and the same windows shifted by one symbol.
#[derive(Debug, Clone)]
pub struct TextBatch<B: Backend> {
    /// `[batch, seq]` symbol ids.
    pub inputs: Tensor<B, 2, Int>,
    /// `[batch, seq]` the symbol after each input.
    pub targets: Tensor<B, 2, Int>,
}

impl<B: Backend> TextGpt<B> {
    /// Logits of every position as a classification of its next symbol, and the mean
    /// cross-entropy — computed as [`Gpt::loss`] computes it, so that both agree bit for bit.
    pub fn classify(&self, batch: TextBatch<B>) -> ClassificationOutput<B> {
        let [rows, seq] = batch.inputs.dims();
        let device = batch.inputs.device();
        let logits = self.gpt.forward(batch.inputs).cast(DType::F32);
        let vocab = logits.dims()[2];
        let logits = logits.reshape([rows * seq, vocab]);
        let targets = batch.targets.reshape([rows * seq]);
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

impl<B: AutodiffBackend> TrainStep for TextGpt<B> {
    type Input = TextBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: TextBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let output = self.classify(batch);
        let grads = output.loss.backward();
        TrainOutput::new(self, grads, output)
    }
}

impl<B: Backend> InferenceStep for TextGpt<B> {
    type Input = TextBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: TextBatch<B>) -> ClassificationOutput<B> {
        self.classify(batch)
    }
}

/// The starts of the non-overlapping windows of `seq` symbols (plus the one target after
/// each) in `range` of the text's symbols, as a dataset.
pub fn windows(corpus: &Corpus, range: std::ops::Range<usize>, seq: usize) -> InMemDataset<usize> {
    let end = range.end.min(corpus.len());
    let starts = (range.start..end.saturating_sub(seq))
        .step_by(seq.max(1))
        .collect();
    InMemDataset::new(starts)
}

/// Turns window starts into a [`TextBatch`].
#[derive(Debug, Clone)]
pub struct WindowBatcher {
    ids: Arc<Vec<usize>>,
    seq: usize,
}

impl WindowBatcher {
    /// Batches windows of `seq` symbols of `corpus`.
    pub fn new(corpus: &Corpus, seq: usize) -> Self {
        Self {
            ids: Arc::new(corpus.ids().to_vec()),
            seq,
        }
    }

    /// The batch of the windows starting at `starts`.
    pub fn tensors<B: Backend>(&self, starts: &[usize], device: &B::Device) -> TextBatch<B> {
        let (rows, seq) = (starts.len(), self.seq);
        let mut inputs = Vec::with_capacity(rows * seq);
        let mut targets = Vec::with_capacity(rows * seq);
        for &at in starts {
            inputs.extend(self.ids[at..at + seq].iter().map(|&id| id as i64));
            targets.extend(self.ids[at + 1..at + seq + 1].iter().map(|&id| id as i64));
        }
        TextBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [rows, seq]), device),
            targets: Tensor::from_data(TensorData::new(targets, [rows, seq]), device),
        }
    }
}

impl<B: Backend> Batcher<B, usize, TextBatch<B>> for WindowBatcher {
    fn batch(&self, starts: Vec<usize>, device: &B::Device) -> TextBatch<B> {
        self.tensors(&starts, device)
    }
}
