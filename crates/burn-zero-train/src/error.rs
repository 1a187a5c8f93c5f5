//! Why a rank of a [`crate::ZeroStrategy`] run stopped.

use burn_zero_checkpoint::CheckpointError;
use burn_zero_comm::{CommError, LaunchError};
use burn_zero_core::ZeroError;

/// What stopped a rank, or the run before any rank started.
///
/// burn-train's `fit` has no error channel, so the strategy turns the first of these into a
/// panic whose message names the rank and this cause.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The strategy or the training setup cannot work as configured.
    #[error("invalid setup: {0}")]
    Invalid(String),
    /// Sharding the model failed (the ranks' models differ, the configuration is invalid, …).
    #[error(transparent)]
    Zero(#[from] ZeroError),
    /// A collective of the training loop failed (another rank failed, a timeout, …).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Saving or resuming a sharded checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The optimizer or scheduler state could not be taken from the learner or put back.
    #[error("learner state: {0}")]
    State(String),
    /// Starting the ranks failed, or a rank failed (the message names it and why).
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// This process's rank of a multi-process job failed.
    #[error("rank {rank} stopped: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// Why it stopped.
        source: Box<TrainError>,
    },
}
