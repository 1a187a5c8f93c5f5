//! The store's decisions, without any I/O: which ranks reached which collective with which
//! fingerprint, who aborted, who left, and which rank's failure came first. The server feeds it what it reads and sends what it
//! answers; keeping the rules here makes them testable on their own.

use std::collections::BTreeMap;

use super::error::ControlFailure;
use super::first_cause::FirstCause;

/// What the store tells the ranks after an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing to say yet (some ranks have not reached the collective).
    Wait,
    /// Every rank reached collective `seq` with the same fingerprint.
    Passed(u64),
    /// The job failed; every rank is told.
    Failed(ControlFailure),
    /// Rank `rank` left after `issued` collectives; every rank is told.
    Left { rank: usize, issued: u64 },
}

/// The first rank to reach a collective, and who else has.
#[derive(Debug)]
struct Pending {
    rank: usize,
    fingerprint: Vec<u8>,
    arrived: Vec<bool>,
    count: usize,
}

/// The job as the store sees it.
#[derive(Debug)]
pub(crate) struct Board {
    world_size: usize,
    pending: BTreeMap<u64, Pending>,
    failure: Option<ControlFailure>,
    /// The first rank that failed on its own account: the first report, or else the first
    /// failure of the job. Kept apart from `failure` because a report does not end the job.
    cause: Option<FirstCause>,
    left: Vec<bool>,
}

impl Board {
    pub fn new(world_size: usize) -> Self {
        Board {
            world_size,
            pending: BTreeMap::new(),
            failure: None,
            cause: None,
            left: vec![false; world_size],
        }
    }

    /// The failure that ended the job, if any.
    pub fn failure(&self) -> Option<&ControlFailure> {
        self.failure.as_ref()
    }

    /// The job's first cause of failure, if any rank has failed or reported a failure.
    pub fn cause(&self) -> Option<&FirstCause> {
        self.cause.as_ref()
    }

    /// Whether every rank has left in good order.
    pub fn all_left(&self) -> bool {
        self.left.iter().all(|&left| left)
    }

    /// Rank `rank` is about to issue collective `seq` with `fingerprint`.
    pub fn check(&mut self, rank: usize, seq: u64, fingerprint: Vec<u8>) -> Verdict {
        if self.failure.is_some() {
            return Verdict::Wait; // Everyone was told already.
        }
        let world_size = self.world_size;
        let entry = self.pending.entry(seq).or_insert_with(|| Pending {
            rank,
            fingerprint: fingerprint.clone(),
            arrived: vec![false; world_size],
            count: 0,
        });
        if entry.fingerprint != fingerprint {
            let failure = ControlFailure::Diverged {
                seq,
                rank,
                fingerprint,
                other_rank: entry.rank,
                other_fingerprint: entry.fingerprint.clone(),
            };
            return self.fail(failure);
        }
        if !entry.arrived[rank] {
            entry.arrived[rank] = true;
            entry.count += 1;
        }
        if entry.count == world_size {
            self.pending.remove(&seq);
            Verdict::Passed(seq)
        } else {
            Verdict::Wait
        }
    }

    /// Rank `rank` failed (or asked every rank to stop) with `reason`.
    pub fn abort(&mut self, rank: usize, reason: String) -> Verdict {
        self.fail(ControlFailure::Aborted { rank, reason })
    }

    /// Rank `rank` failed on its own account with `reason` and is about to tell the others
    /// through a collective (they will stop because of it). Recorded as the job's cause
    /// unless a rank came first; the job goes on.
    pub fn report(&mut self, rank: usize, reason: String) -> Verdict {
        self.cause.get_or_insert(FirstCause { rank, reason });
        Verdict::Wait
    }

    /// Rank `rank` finished after `issued` collectives and closed its connection in order.
    pub fn leave(&mut self, rank: usize, issued: u64) -> Verdict {
        self.left[rank] = true;
        Verdict::Left { rank, issued }
    }

    /// Rank `rank`'s connection broke without a goodbye: its process died or the network
    /// failed.
    pub fn lost(&mut self, rank: usize) -> Verdict {
        if self.left[rank] {
            return Verdict::Wait;
        }
        self.fail(ControlFailure::Lost { rank })
    }

    fn fail(&mut self, failure: ControlFailure) -> Verdict {
        if self.failure.is_some() {
            return Verdict::Wait;
        }
        // A failure that ends the job is also a report, by the rank it names, unless one came
        // before it.
        self.cause.get_or_insert_with(|| failure_cause(&failure));
        self.failure = Some(failure.clone());
        self.pending.clear();
        Verdict::Failed(failure)
    }
}

/// The rank a failure that ended the job is blamed on, and why.
fn failure_cause(failure: &ControlFailure) -> FirstCause {
    let rank = match failure {
        ControlFailure::Aborted { rank, reason } => {
            return FirstCause {
                rank: *rank,
                reason: reason.clone(),
            };
        }
        // The rank whose fingerprint disagreed with the first one seen; the reason names both.
        ControlFailure::Diverged { rank, .. } | ControlFailure::Lost { rank } => *rank,
        // Only a rank hears of this one, never the store.
        ControlFailure::StoreGone { .. } => 0,
    };
    FirstCause {
        rank,
        reason: failure.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collective_passes_once_every_rank_reached_it_alike() {
        let mut board = Board::new(3);
        assert_eq!(board.check(2, 1, b"ag".to_vec()), Verdict::Wait);
        assert_eq!(board.check(0, 1, b"ag".to_vec()), Verdict::Wait);
        // A rank that repeats itself is counted once.
        assert_eq!(board.check(0, 1, b"ag".to_vec()), Verdict::Wait);
        assert_eq!(board.check(1, 1, b"ag".to_vec()), Verdict::Passed(1));
        assert!(board.pending.is_empty());
    }

    #[test]
    fn divergence_names_both_ranks_and_ends_the_job() {
        let mut board = Board::new(2);
        assert_eq!(board.check(1, 7, b"rs".to_vec()), Verdict::Wait);
        let verdict = board.check(0, 7, b"ag".to_vec());
        assert_eq!(
            verdict,
            Verdict::Failed(ControlFailure::Diverged {
                seq: 7,
                rank: 0,
                fingerprint: b"ag".to_vec(),
                other_rank: 1,
                other_fingerprint: b"rs".to_vec(),
            })
        );
        // The first failure is the one everybody hears of.
        assert_eq!(board.abort(1, "late".into()), Verdict::Wait);
        assert_eq!(board.check(1, 8, b"x".to_vec()), Verdict::Wait);
    }

    #[test]
    fn a_lost_connection_fails_the_job_unless_the_rank_said_goodbye() {
        let mut board = Board::new(2);
        assert_eq!(board.leave(1, 4), Verdict::Left { rank: 1, issued: 4 });
        assert_eq!(board.lost(1), Verdict::Wait);
        assert!(!board.all_left());
        assert_eq!(
            board.lost(0),
            Verdict::Failed(ControlFailure::Lost { rank: 0 })
        );
    }

    #[test]
    fn the_first_report_is_the_cause_and_the_job_goes_on() {
        let mut board = Board::new(3);
        assert_eq!(board.cause(), None);
        assert_eq!(board.report(2, "disk full".into()), Verdict::Wait);
        // Later reports and the abort that follows are consequences.
        assert_eq!(
            board.report(0, "save failed on rank 2".into()),
            Verdict::Wait
        );
        assert_eq!(board.failure(), None);
        assert_eq!(board.check(1, 1, b"ag".to_vec()), Verdict::Wait);
        assert!(matches!(
            board.abort(1, "stopped".into()),
            Verdict::Failed(ControlFailure::Aborted { rank: 1, .. })
        ));
        assert_eq!(
            board.cause(),
            Some(&FirstCause {
                rank: 2,
                reason: "disk full".into()
            })
        );
    }

    #[test]
    fn an_abort_or_a_lost_rank_without_a_report_is_the_cause() {
        let mut board = Board::new(2);
        board.abort(1, "out of memory".into());
        assert_eq!(
            board.cause(),
            Some(&FirstCause {
                rank: 1,
                reason: "out of memory".into()
            })
        );
        let mut board = Board::new(2);
        board.lost(1);
        board.report(0, "late".into());
        let cause = board.cause().unwrap();
        assert_eq!(cause.rank, 1);
        assert!(
            cause.reason.contains("without a goodbye"),
            "{}",
            cause.reason
        );
    }
}
