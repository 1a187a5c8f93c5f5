//! The meeting point of a [`super::LocalGroup`]: ranks deposit a payload with the fingerprint of
//! their call and leave with every rank's payload, or with the error that ended the group.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::call::CollectiveCall;
use crate::error::CommError;

/// Identifies one exchange: the call's sequence number and, for collectives that exchange more
/// than once (all-reduce), the phase within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct RoundKey {
    pub seq: u64,
    pub phase: u8,
}

struct Round<P> {
    calls: Vec<Option<CollectiveCall>>,
    payloads: Vec<Option<P>>,
    arrived: usize,
    collected: usize,
}

struct State<P> {
    rounds: HashMap<RoundKey, Round<P>>,
    failure: Option<CommError>,
    departed: Vec<bool>,
}

/// Shared state of one group: open rounds, the error that ended the group (if any), and which
/// ranks have left.
pub(crate) struct Rendezvous<P> {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State<P>>,
    changed: Condvar,
}

impl<P: Clone> Rendezvous<P> {
    pub fn new(world_size: usize, timeout: Duration) -> Self {
        Self {
            world_size,
            timeout,
            state: Mutex::new(State {
                rounds: HashMap::new(),
                failure: None,
                departed: vec![false; world_size],
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<P>> {
        // Nothing panics while holding the lock, but never let a poisoned mutex hide the
        // group's real failure.
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Ends the group with `error` unless it already ended; wakes every waiting rank.
    pub fn fail(&self, error: CommError) -> CommError {
        let mut state = self.lock();
        let first = state.failure.get_or_insert(error).clone();
        drop(state);
        self.changed.notify_all();
        first
    }

    /// Records that `rank` will issue no more collectives.
    pub fn depart(&self, rank: usize) {
        self.lock().departed[rank] = true;
        self.changed.notify_all();
    }

    /// The error that ended the group, if any.
    pub fn failure(&self) -> Option<CommError> {
        self.lock().failure.clone()
    }

    /// Deposits `payload` for `call` and returns every rank's payload in rank order, once all
    /// ranks have deposited a matching call.
    pub fn exchange(
        &self,
        rank: usize,
        call: &CollectiveCall,
        phase: u8,
        payload: P,
    ) -> Result<Vec<P>, CommError> {
        let key = RoundKey {
            seq: call.seq,
            phase,
        };
        let start = Instant::now();
        let deadline = start + self.timeout;
        let world_size = self.world_size;

        let mut state = self.lock();
        if let Some(failure) = &state.failure {
            return Err(failure.clone());
        }
        let round = state.rounds.entry(key).or_insert_with(|| Round {
            calls: vec![None; world_size],
            payloads: vec![None; world_size],
            arrived: 0,
            collected: 0,
        });
        let earlier = round
            .calls
            .iter()
            .enumerate()
            .find_map(|(r, c)| c.as_ref().map(|c| (r, c)));
        if let Some((other_rank, other_call)) = earlier
            && !other_call.matches(call)
        {
            let error = CommError::Mismatch {
                rank,
                call: Box::new(call.clone()),
                other_rank,
                other_call: Box::new(other_call.clone()),
            };
            let failure = state.failure.get_or_insert(error).clone();
            drop(state);
            self.changed.notify_all();
            tracing::error!(rank, %failure, "collective mismatch");
            return Err(failure);
        }
        round.calls[rank] = Some(call.clone());
        round.payloads[rank] = Some(payload);
        round.arrived += 1;
        if round.arrived == world_size {
            self.changed.notify_all();
        }

        loop {
            if let Some(failure) = &state.failure {
                return Err(failure.clone());
            }
            let round = state
                .rounds
                .get(&key)
                .unwrap_or_else(|| unreachable!("a round lives until every rank collected it"));
            if round.arrived == world_size {
                break;
            }
            let missing: Vec<usize> = (0..world_size)
                .filter(|&r| round.calls[r].is_none())
                .collect();
            let error = if let Some(&peer) = missing.iter().find(|&&r| state.departed[r]) {
                Some(CommError::PeerExited {
                    peer,
                    rank,
                    call: Box::new(call.clone()),
                })
            } else if Instant::now() >= deadline {
                Some(CommError::Timeout {
                    rank,
                    call: Box::new(call.clone()),
                    waited: start.elapsed(),
                    missing,
                })
            } else {
                None
            };
            if let Some(error) = error {
                let failure = state.failure.get_or_insert(error).clone();
                drop(state);
                self.changed.notify_all();
                tracing::error!(rank, %failure, "collective abandoned");
                return Err(failure);
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            state = self
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(|poison| poison.into_inner())
                .0;
        }

        let round = state
            .rounds
            .get_mut(&key)
            .unwrap_or_else(|| unreachable!("a round lives until every rank collected it"));
        let payloads = round
            .payloads
            .iter()
            .map(|p| {
                p.clone()
                    .unwrap_or_else(|| unreachable!("all ranks arrived"))
            })
            .collect();
        round.collected += 1;
        if round.collected == world_size {
            state.rounds.remove(&key);
        }
        Ok(payloads)
    }
}
