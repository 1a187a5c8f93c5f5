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
    #[error("rank {rank} waited {waited:?} in {call}{}", missing_suffix(.missing))]
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
    #[error("unsupported dtype {dtype} for {op}: this engine's collectives take {supported}")]
    UnsupportedDtype {
        /// The dtype, as written by [`crate::call::dtype_name`].
        dtype: String,
        /// The collective.
        op: String,
        /// The dtypes the engine takes, e.g. `f32, f16, bf16`.
        supported: &'static str,
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
    /// The communication library reported an error; the communicator was aborted.
    #[error("rank {rank}: NCCL failed in {during}: {code}{}", detail_suffix(.detail))]
    Nccl {
        /// The rank that saw the error.
        rank: usize,
        /// What it was doing (a collective's fingerprint, or the setup step).
        during: String,
        /// NCCL's result code, e.g. `ncclRemoteError`.
        code: String,
        /// NCCL's own message (`ncclGetLastError`), when it has one.
        detail: String,
    },
    /// NCCL refused to put several ranks of one communicator on one GPU ("Duplicate GPU
    /// detected"); `remedy` says what allows it with the NCCL that is loaded.
    #[error("rank {rank}: NCCL {version} refused several ranks on one GPU ({detail}): {remedy}")]
    GpuShared {
        /// The rank that saw the refusal.
        rank: usize,
        /// The loaded NCCL's version, e.g. `2.27.3`.
        version: String,
        /// NCCL's own message.
        detail: String,
        /// What to do about it.
        remedy: String,
    },
    /// A collective did not complete within the group's timeout. The communicator was aborted,
    /// so this rank does not wait forever; the usual causes are a rank that failed or stalled,
    /// or ranks that issued different collectives.
    #[error(
        "rank {rank} waited {waited:?} in {during} and aborted the communicator: a peer failed, \
         stalled, or issued a different collective"
    )]
    Stalled {
        /// The rank that gave up.
        rank: usize,
        /// The collective (or setup step) it waited in.
        during: String,
        /// How long it waited.
        waited: Duration,
    },
    /// An MPI call failed (MPI's error code and its text).
    #[error("rank {rank}: MPI failed in {during}: {detail}")]
    Mpi {
        /// The rank that saw it.
        rank: usize,
        /// What the rank was doing.
        during: String,
        /// MPI's error and its text.
        detail: String,
    },
    /// A library or device the engine needs is missing on this machine, or the engine lacks
    /// a collective (an all-to-all).
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// A CUDA library cannot be loaded under any of the names tried.
    #[error("engine unavailable: {0}")]
    MissingLibrary(#[from] crate::libraries::MissingLibrary),
    /// A device index past the devices this process can see.
    #[error(
        "rank {rank}: {device} does not exist: {visible} device(s) visible to this process \
         (check CUDA_VISIBLE_DEVICES and the rank's LOCAL_RANK)"
    )]
    NoSuchDevice {
        /// The rank that asked for it.
        rank: usize,
        /// The device asked for.
        device: String,
        /// How many devices are visible.
        visible: usize,
    },
    /// The ranks could not meet to set the group up (launcher environment or rendezvous).
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
}

fn detail_suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(" ({detail})")
    }
}

/// How one rank of [`crate::launch()`] ended, when it did not succeed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RankFailure {
    /// The rank's closure panicked.
    #[error("panicked: {0}")]
    Panicked(String),
    /// The rank's closure returned an error.
    #[error("returned an error: {0}")]
    Errored(String),
}

/// Why [`crate::launch()`] failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LaunchError {
    /// The arguments do not describe a runnable group.
    #[error("cannot launch: {0}")]
    Invalid(String),
    /// A rank failed. `rank` is the first rank that failed on its own account (the first to
    /// abort the group or report its failure to it, see
    /// [`crate::Communicator::report_failure`]); ranks that only failed because of it are
    /// listed in `others`.
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

/// `; rank(s) [..] never arrived`, or, when the engine cannot tell which ranks are missing
/// (MPI), that not every rank arrived.
fn missing_suffix(missing: &[usize]) -> String {
    if missing.is_empty() {
        "; not every rank arrived".into()
    } else {
        format!("; rank(s) {missing:?} never arrived")
    }
}
