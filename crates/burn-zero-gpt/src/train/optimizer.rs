//! A rank's optimizer: Burn's Adam with its state whole on the device, or split by chunk with a
//! fraction of it on the host (`offload_optim_frac`), and how each saves and resumes.
//!
//! Both save the same sharded checkpoint format (per parameter, whatever side stepped it), so a
//! run resumes from a checkpoint of the other kind, or of another fraction.

use std::path::Path;

use burn::backend::Flex;
use burn::optim::{Adam, AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn_zero_checkpoint::{Loaded, SaveOptions, load, load_record, save_record};
use burn_zero_core::ZeroState;
use burn_zero_optim::{LossScalerConfig, Offload, SplitZeroOptimizer, ZeroOptimizer};

use super::{RankError, RunConfig, Train};
use crate::Gpt;

/// The optimizer of one rank.
pub(super) enum RankOptimizer<B: Backend> {
    /// Masters and Adam's moments on the device.
    Device(Box<ZeroOptimizer<Adam, B>>),
    /// A fraction of the chunks' masters and moments on the host (Flex), stepped there.
    Split(Box<SplitZeroOptimizer<Adam, B, Flex>>),
}

impl<B: Backend> RankOptimizer<B> {
    /// The optimizer `config` asks for, stepping the module `state` belongs to.
    pub(super) fn new(state: &ZeroState<B>, config: &RunConfig) -> Result<Self, RankError> {
        let adam = AdamConfig::new().build();
        let scaled = config.precision == burn::tensor::DType::F16;
        if config.offload_optim_frac == 0.0 {
            let mut optimizer =
                ZeroOptimizer::new(state, adam).with_accumulation(config.accumulation);
            if scaled {
                optimizer = optimizer.with_loss_scaler(LossScalerConfig::new());
            }
            return Ok(Self::Device(Box::new(optimizer)));
        }
        let mut optimizer = SplitZeroOptimizer::new(state, adam, config.offload_optim_frac)
            .map_err(|error| RankError::Optimizer(error.to_string()))?
            .with_accumulation(config.accumulation);
        if scaled {
            optimizer = optimizer.with_loss_scaler(LossScalerConfig::new());
        }
        Ok(Self::Split(Box::new(optimizer)))
    }

    /// One optimizer call (a micro-step under accumulation).
    pub(super) fn step(
        &mut self,
        lr: f64,
        model: Gpt<Train<B>>,
        grads: GradientsParams,
    ) -> Gpt<Train<B>> {
        match self {
            Self::Device(optimizer) => Optimizer::step(optimizer.as_mut(), lr, model, grads),
            Self::Split(optimizer) => Optimizer::step(optimizer.as_mut(), lr, model, grads),
        }
    }

    /// The factor the loss is multiplied by before backward (1 without a loss scaler).
    pub(super) fn loss_scale(&self) -> f64 {
        match self {
            Self::Device(optimizer) => optimizer.loss_scale(),
            Self::Split(optimizer) => optimizer.loss_scale(),
        }
    }

    /// Steps the loss scaler skipped.
    pub(super) fn skipped_steps(&self) -> usize {
        match self {
            Self::Device(optimizer) => optimizer.skipped_steps(),
            Self::Split(optimizer) => optimizer.skipped_steps(),
        }
    }

    /// Chunks whose state steps on the host (none for the device optimizer).
    pub(super) fn host_chunks(&self) -> usize {
        match self {
            Self::Device(_) => 0,
            Self::Split(optimizer) => optimizer.host_chunks().len(),
        }
    }

    /// Saves `model` and this optimizer as the sharded checkpoint of step `step` under `dir`.
    pub(super) fn save(
        &self,
        dir: &Path,
        step: u64,
        model: &Gpt<Train<B>>,
        state: &ZeroState<B>,
    ) -> Result<(), RankError> {
        let options = SaveOptions::default();
        match self {
            Self::Device(optimizer) => {
                burn_zero_checkpoint::save(dir, step, model, optimizer.as_ref(), &options)?;
            }
            Self::Split(optimizer) => {
                save_record::<Train<B>, B, _, Adam, Offload<Flex>>(
                    dir,
                    step,
                    model,
                    state,
                    optimizer.record(),
                    &options,
                )?;
            }
        }
        Ok(())
    }

    /// `model` and this optimizer with the state of the latest checkpoint under `dir`.
    pub(super) fn load(
        self,
        dir: &Path,
        model: Gpt<Train<B>>,
        state: &ZeroState<B>,
    ) -> Result<(Self, Gpt<Train<B>>, Loaded), RankError> {
        Ok(match self {
            Self::Device(optimizer) => {
                let (model, optimizer, loaded) = load(dir, model, *optimizer)?;
                (Self::Device(Box::new(optimizer)), model, loaded)
            }
            Self::Split(optimizer) => {
                let (model, record, loaded) =
                    load_record::<Train<B>, B, _, Adam, Offload<Flex>>(dir, model, state)?;
                (
                    Self::Split(Box::new(optimizer.restore(record))),
                    model,
                    loaded,
                )
            }
        })
    }
}
