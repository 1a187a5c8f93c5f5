//! A failure injected on purpose into one rank at one step, for the tests of how a job of
//! several processes stops (the example's hidden `--fail-at RANK:STEP:HOW`).

use std::str::FromStr;

/// How the rank fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The rank's thread panics.
    Panic,
    /// The rank's process is killed with SIGKILL, as the kernel's out-of-memory killer or a
    /// scheduler would kill it: nothing of it runs afterwards.
    Kill,
}

/// Rank `rank` fails in the middle of step `step` (after its first backward, before its
/// optimizer step), as `how` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub step: usize,
    pub how: FaultKind,
}

impl Fault {
    /// Fails now when this is the rank and step.
    pub(super) fn strike(&self, rank: usize, step: usize) {
        if rank != self.rank || step != self.step {
            return;
        }
        match self.how {
            FaultKind::Panic => panic!("rank {rank} fails at step {step} on purpose (--fail-at)"),
            FaultKind::Kill => {
                let pid = std::process::id().to_string();
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid])
                    .status();
                // SIGKILL cannot be caught; should `kill` be missing, abort without cleanup.
                std::process::abort();
            }
        }
    }
}

impl FromStr for Fault {
    type Err = String;

    /// `RANK:STEP:panic` or `RANK:STEP:kill`.
    fn from_str(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split(':').collect();
        let number = |part: &str| part.parse::<usize>().ok();
        match parts.as_slice() {
            [rank, step, how] => {
                let how = match *how {
                    "panic" => FaultKind::Panic,
                    "kill" => FaultKind::Kill,
                    other => return Err(format!("{other:?} is not panic or kill")),
                };
                match (number(rank), number(step)) {
                    (Some(rank), Some(step)) => Ok(Fault { rank, step, how }),
                    _ => Err(format!("{text:?}: RANK and STEP are numbers")),
                }
            }
            _ => Err(format!("{text:?} is not RANK:STEP:panic or RANK:STEP:kill")),
        }
    }
}
