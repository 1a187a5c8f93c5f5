//! `JobControl`: the collective layer's side of the job-lifetime control connection
//! ([`burn_zero_launch::control`]).
//!
//! An engine whose ranks live in several processes (NCCL) cannot see the other ranks'
//! schedules or failures by itself: a rank that died leaves the others blocked inside a
//! collective until their timeout, and a rank that issues a different collective can make the
//! library read or write past a buffer. `JobControl` closes both gaps through the store rank 0
//! keeps for the whole job:
//!
//! - [`JobControl::check`] compares this rank's next call with every other rank's call at the
//!   same position before any data moves, and turns a divergence into
//!   [`CommError::Mismatch`] naming both ranks' calls;
//! - [`JobControl::on_failure`] runs a hook (abort the communicators) the moment any rank of
//!   the job fails, on every node; [`JobControl::abort`] is how a rank says it failed;
//! - [`JobControl::report`] records, without stopping the job, that this rank failed on its
//!   own account and is about to tell the others through a collective. The store keeps the
//!   job's first report or abort as its cause ([`JobControl::first_failure`]) and writes it
//!   where `zero-run` reads it, so the job's failure is reported as that rank's, not as
//!   whichever rank's process exited first.
//!
//! Everything here is engine-agnostic and runs on CPU: the process tests drive it without
//! NCCL.

use std::sync::Arc;
use std::time::Duration;

use burn_zero_launch::{ControlClient, ControlError, ControlFailure};

use crate::call::{CollectiveCall, CollectiveOp};
use crate::error::CommError;

/// A rank's handle on the job's control connection.
pub struct JobControl {
    client: Arc<ControlClient>,
    check_schedule: bool,
    timeout: Duration,
}

impl std::fmt::Debug for JobControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobControl")
            .field("rank", &self.client.rank())
            .field("world_size", &self.client.world_size())
            .field("store", &self.client.endpoint())
            .field("check_schedule", &self.check_schedule)
            .finish()
    }
}

impl JobControl {
    /// Wraps a connection. With `check_schedule`, [`JobControl::check`] compares every call
    /// with the other ranks' (one round trip to the store per collective); without, it does
    /// nothing and only aborts travel. `timeout` bounds the wait for the other ranks.
    pub fn new(client: ControlClient, check_schedule: bool, timeout: Duration) -> Self {
        JobControl {
            client: Arc::new(client),
            check_schedule,
            timeout,
        }
    }

    /// The same connection with schedule checks off (aborts still travel): for a second
    /// group of the rank, whose collectives are counted apart.
    pub fn without_checks(&self) -> Self {
        JobControl {
            client: self.client.clone(),
            check_schedule: false,
            timeout: self.timeout,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.client.rank()
    }

    /// Whether calls are compared across ranks.
    pub fn checks_schedule(&self) -> bool {
        self.check_schedule
    }

    /// The job's failure, as this rank's collectives report it, if the job has failed.
    pub fn failure(&self) -> Option<CommError> {
        self.client
            .failure()
            .map(|failure| failure_error(self.rank(), &failure))
    }

    /// Waits until every rank has reached `call`'s position with the same call. Returns the
    /// job's failure, a [`CommError::Mismatch`] naming both calls, a
    /// [`CommError::PeerExited`] for a rank that finished before this position, or a
    /// [`CommError::Timeout`].
    pub fn check(&self, call: &CollectiveCall) -> Result<(), CommError> {
        if !self.check_schedule {
            return match self.failure() {
                Some(error) => Err(error),
                None => Ok(()),
            };
        }
        let rank = self.rank();
        self.client
            .check(call.seq, &call.fingerprint(), self.timeout)
            .map_err(|error| match error {
                ControlError::Failed(failure) => failure_error(rank, &failure),
                ControlError::PeerLeft { peer, .. } => CommError::PeerExited {
                    peer,
                    rank,
                    call: Box::new(call.clone()),
                },
                ControlError::Timeout { waited, .. } => CommError::Timeout {
                    rank,
                    call: Box::new(call.clone()),
                    waited,
                    missing: Vec::new(),
                },
                other => CommError::Rendezvous(other.to_string()),
            })
    }

    /// Runs `hook` with the job's failure, as this rank's collectives report it, the moment
    /// any rank fails (at once if one has).
    pub fn on_failure(&self, hook: impl Fn(&CommError) + Send + Sync + 'static) {
        let rank = self.rank();
        self.client
            .on_failure(move |failure| hook(&failure_error(rank, failure)));
    }

    /// Tells every rank that this one failed, with `reason`.
    pub fn abort(&self, reason: &str) {
        self.client.abort(reason);
    }

    /// Records with the job's control store that this rank failed on its own account, with
    /// `reason`, without stopping the job (see
    /// [`crate::Communicator::report_failure`]). Returns once the store has recorded it, a
    /// round trip, so that no rank can learn of the failure through the collective that
    /// follows before the store has.
    pub fn report(&self, reason: &str) {
        self.client.report(reason);
    }

    /// The job's first cause as the store recorded it: the first rank of any process that
    /// reported a failure or aborted (or, when none did, whose connection broke or whose
    /// schedule diverged), with its reason. Read from what the store already sent this rank:
    /// nothing travels.
    pub fn first_failure(&self) -> Option<(usize, String)> {
        self.client.cause().map(|cause| (cause.rank, cause.reason))
    }

    /// Tells the other ranks that this one is done after `issued` collectives.
    pub fn leave(&self, issued: u64) {
        self.client.leave(issued);
    }
}

/// How a rank's collectives report the job's failure.
pub fn failure_error(rank: usize, failure: &ControlFailure) -> CommError {
    match failure {
        ControlFailure::Aborted {
            rank: failed,
            reason,
        } => CommError::PeerFailed {
            rank: *failed,
            reason: reason.clone(),
        },
        ControlFailure::Diverged {
            seq,
            rank: here,
            fingerprint,
            other_rank,
            other_fingerprint,
        } => {
            let read = |bytes: &[u8]| {
                CollectiveCall::from_fingerprint(*seq, bytes).unwrap_or(CollectiveCall {
                    seq: *seq,
                    op: CollectiveOp::Barrier,
                    dtype: None,
                    numel: 0,
                })
            };
            // Told from this rank's side when it is one of the two.
            let (rank, call, other_rank, other_call) = if *other_rank == rank {
                (
                    *other_rank,
                    read(other_fingerprint),
                    *here,
                    read(fingerprint),
                )
            } else {
                (
                    *here,
                    read(fingerprint),
                    *other_rank,
                    read(other_fingerprint),
                )
            };
            CommError::Mismatch {
                rank,
                call: Box::new(call),
                other_rank,
                other_call: Box::new(other_call),
            }
        }
        ControlFailure::Lost { rank: lost } => CommError::PeerFailed {
            rank: *lost,
            reason: failure.to_string(),
        },
        ControlFailure::StoreGone { .. } => CommError::PeerFailed {
            rank: 0,
            reason: failure.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::DType;

    use super::*;

    #[test]
    fn a_divergence_reads_as_both_ranks_calls() {
        let mine = CollectiveCall {
            seq: 3,
            op: CollectiveOp::AllGather,
            dtype: Some(DType::F32),
            numel: 4096,
        };
        let theirs = CollectiveCall {
            op: CollectiveOp::ReduceScatter(crate::ReduceOp::Sum),
            numel: 8192,
            ..mine.clone()
        };
        let failure = ControlFailure::Diverged {
            seq: 3,
            rank: 1,
            fingerprint: theirs.fingerprint(),
            other_rank: 0,
            other_fingerprint: mine.fingerprint(),
        };
        let error = failure_error(0, &failure);
        assert_eq!(
            error.to_string(),
            "collective schedules diverged: rank 0 called all_gather of 4096 f32 as its 3rd \
             collective, rank 1 called reduce_scatter(sum) of 8192 f32 as its 3rd collective"
        );
        // A third rank tells it in the store's order.
        assert!(
            failure_error(2, &failure)
                .to_string()
                .starts_with("collective schedules diverged: rank 1 called reduce_scatter")
        );
    }

    #[test]
    fn a_lost_rank_is_a_failed_peer() {
        let error = failure_error(0, &ControlFailure::Lost { rank: 3 });
        match error {
            CommError::PeerFailed { rank: 3, reason } => {
                assert!(reason.contains("without a goodbye"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
}
