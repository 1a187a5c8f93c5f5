//! Train with burn-train's `Learner` under ZeRO.
//!
//! [`ZeroStrategy`] is a burn-train `SupervisedLearningStrategy`: the `Learner` keeps its
//! metrics, renderer, scheduler and early stopping, while each rank holds 1/N of the
//! parameters, gradients and optimizer state. Moving a Learner setup to ZeRO:
//!
//! 1. the backend `Autodiff<B>` becomes `Autodiff<Zero<B>>`;
//! 2. the optimizer becomes `ZeroOptimizer::unbound(AdamConfig::new())?` (accumulation:
//!    `.with_accumulation(k)` instead of burn-train's `grads_accumulation`);
//! 3. `SupervisedTraining::with_training_strategy(TrainingStrategy::Custom(Arc::new(
//!    ZeroStrategy::new(ranks, device, ZeroConfig::new()))))`;
//! 4. checkpoints: `ZeroStrategy::with_checkpoints(dir)` instead of `with_file_checkpointer`.
//!
//! Module map: [`strategy`] (the strategy and how ranks start), `worker` (one rank's loop),
//! [`items`] (step outputs crossing processes for the metrics),
//! `data` (each rank's block of an epoch), `events` (every rank's items into Burn's metrics,
//! in rank order), `state` (the learner's optimizer and scheduler records), [`error`].

pub mod error;
pub mod items;
pub mod strategy;

mod data;
mod events;
mod state;
mod worker;

pub use error::TrainError;
pub use items::CrossRank;
pub use strategy::{ConnectRank, ZeroStrategy};
