//! Errors of the collective layer and of the rank launcher.

use std::time::Duration;

use crate::call::CollectiveCall;

/// Why a collective failed.
///
/// Fingerprints are boxed to keep `Result<_, CommError>` small on the hot path.
///
/// Once a group has failed, every later collective on every rank of that group returns the
/// same error: a group never half-works. Create a new group to go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// Two ranks issued different collectives at the same point of their schedules.
    #[error(
        "collective schedules diverged: rank {rank} called {call}, rank {other_rank} called {other_call}"
    )]
    Mismatch {
        /// The rank that noticed the mismatch.
        rank: usize,
        /// What it called.
        call: Box<CollectiveCall>,
        /// A rank that had already called something else at that position.
        other_rank: usize,
        /// What that rank called.
        other_call: Box<CollectiveCall>,
    },
    /// Some ranks did not reach a collective within the group's timeout.
    #[error("rank {rank} waited {waited:?} in {call}; rank(s) {missing:?} never arrived")]
    Timeout {
        /// The rank that gave up waiting.
        rank: usize,
        /// The collective it waited in.
        call: Box<CollectiveCall>,
        /// How long it waited.
        waited: Duration,
        /// Ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// A rank failed (panicked or returned an error) and aborted the group.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed {
        /// The failed rank.
        rank: usize,
        /// Its panic message or error.
        reason: String,
    },
    /// A rank left the group (its work ended) while another rank still waited for it.
    #[error("rank {peer} left the group while rank {rank} waited in {call}")]
    PeerExited {
        /// The rank that left.
        peer: usize,
        /// The rank still waiting.
        rank: usize,
        /// The collective it waited in.
        call: Box<CollectiveCall>,
    },
    /// A reduce-scatter input that cannot be split evenly across ranks.
    #[error(
        "reduce_scatter input of {numel} elements is not divisible by world size {world_size} (pad it first)"
    )]
    NotDivisible {
        /// Elements passed in.
        numel: usize,
        /// The group's world size.
        world_size: usize,
    },
    /// A broadcast root outside the group.
    #[error("broadcast root {root} is not a rank of a group of {world_size}")]
    InvalidRoot {
        /// The requested root.
        root: usize,
        /// The group's world size.
        world_size: usize,
    },
    /// A tensor whose element type the engine cannot move or reduce.
    #[error(
        "unsupported dtype {dtype} for {op}: collectives take float tensors (f64, f32, f16, bf16)"
    )]
    UnsupportedDtype {
        /// The dtype, as written by [`crate::call::dtype_name`].
        dtype: String,
        /// The collective.
        op: String,
    },
    /// The backend failed while finishing this rank's pending work on its device.
    #[error("rank {rank}'s device failed to finish its work: {reason}")]
    Device {
        /// The rank.
        rank: usize,
        /// The backend's error.
        reason: String,
    },
    /// A group that cannot be built as asked.
    #[error("invalid group: {0}")]
    InvalidGroup(String),
}

/// How one rank of [`crate::launch`] ended, when it did not succeed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RankFailure {
    /// The rank's closure panicked.
    #[error("panicked: {0}")]
    Panicked(String),
    /// The rank's closure returned an error.
    #[error("returned an error: {0}")]
    Errored(String),
}

/// Why [`crate::launch`] failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LaunchError {
    /// The arguments do not describe a runnable group.
    #[error("cannot launch: {0}")]
    Invalid(String),
    /// A rank failed. `rank` is the first rank that failed on its own account; ranks that only
    /// failed because of it are listed in `others`.
    #[error("rank {rank} {failure}{}", others_suffix(.others))]
    RankFailed {
        /// The rank whose failure came first.
        rank: usize,
        /// What happened to it.
        failure: RankFailure,
        /// Every other rank that did not succeed, with what happened to it.
        others: Vec<(usize, RankFailure)>,
    },
}

fn others_suffix(others: &[(usize, RankFailure)]) -> String {
    if others.is_empty() {
        String::new()
    } else {
        let ranks: Vec<String> = others.iter().map(|(r, _)| r.to_string()).collect();
        format!(" (rank(s) {} stopped as a consequence)", ranks.join(", "))
    }
}
