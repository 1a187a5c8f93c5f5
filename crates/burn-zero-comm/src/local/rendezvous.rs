//! The meeting point of a [`super::LocalGroup`]: ranks deposit a payload with the fingerprint of
//! their call and leave with every rank's payload, or with the error that ended the group.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use burn_zero_launch::sync::lock;

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

/// How often a duplicated group looks at its parent's failure while it waits.
const PARENT_POLL: Duration = Duration::from_millis(20);

/// Shared state of one group: open rounds, the error that ended the group (if any), and which
/// ranks have left. A duplicated group keeps its parent: each ends when the other fails.
pub(crate) struct Rendezvous<P> {
    world_size: usize,
    /// Each rank's rank in the group everything was split from, which errors name: a split
    /// group renumbers its ranks, but a user reads ranks as the job numbers them.
    origins: Vec<usize>,
    timeout: Duration,
    state: Mutex<State<P>>,
    changed: Condvar,
    parent: Option<Arc<Rendezvous<P>>>,
    /// Groups being duplicated from this one, by the sequence number of the `duplicate` call:
    /// the first rank to arrive creates the child, the others take it.
    children: Mutex<HashMap<u64, Arc<Rendezvous<P>>>>,
    /// Groups being split from this one, by the sequence number of the `split` call.
    splits: Mutex<HashMap<u64, Split<P>>>,
    /// The first rank (numbered as in the group everything was split from) that reported a
    /// failure of its own, with its reason; kept by that root group only.
    cause: Mutex<Option<(usize, String)>>,
}

/// One `split` call in progress: every rank's color, and the group of each color, created by
/// the first of its ranks to ask.
struct Split<P> {
    colors: Vec<Option<usize>>,
    children: HashMap<usize, Arc<Rendezvous<P>>>,
}

impl<P: Clone> Rendezvous<P> {
    pub fn new(world_size: usize, timeout: Duration) -> Self {
        Self::with_parent((0..world_size).collect(), timeout, None)
    }

    /// The group over the same ranks as `parent`, with its own sequence of rounds, made by the
    /// `duplicate` call number `seq`: created by the first rank to ask.
    pub fn child(parent: &Arc<Self>, seq: u64) -> Arc<Self> {
        lock(&parent.children)
            .entry(seq)
            .or_insert_with(|| {
                Arc::new(Self::with_parent(
                    parent.origins.clone(),
                    parent.timeout,
                    Some(parent.clone()),
                ))
            })
            .clone()
    }

    /// Drops the parent's record of child `seq` once every rank has taken it.
    pub fn forget_child(&self, seq: u64) {
        lock(&self.children).remove(&seq);
    }

    /// Records `rank`'s color for the `split` call number `seq`, before the call's first
    /// exchange (after which every rank's color is recorded).
    pub fn note_color(&self, seq: u64, rank: usize, color: usize) {
        let mut splits = lock(&self.splits);
        let split = splits.entry(seq).or_insert_with(|| Split {
            colors: vec![None; self.world_size],
            children: HashMap::new(),
        });
        split.colors[rank] = Some(color);
    }

    /// The group of `rank`'s color made by the `split` call number `seq`, and `rank`'s rank in
    /// it (its place among the ranks of that color, in this group's order). Called once every
    /// rank's color is recorded.
    pub fn split_child(parent: &Arc<Self>, seq: u64, rank: usize) -> (Arc<Self>, usize) {
        let mut splits = lock(&parent.splits);
        let split = splits
            .get_mut(&seq)
            .unwrap_or_else(|| unreachable!("every rank recorded its color before the exchange"));
        let color = split.colors[rank]
            .unwrap_or_else(|| unreachable!("every rank recorded its color before the exchange"));
        let members: Vec<usize> = (0..parent.world_size)
            .filter(|&r| split.colors[r] == Some(color))
            .collect();
        let position = members
            .iter()
            .position(|&r| r == rank)
            .unwrap_or_else(|| unreachable!("a rank is a member of its own color"));
        let child = split
            .children
            .entry(color)
            .or_insert_with(|| {
                let origins = members.iter().map(|&r| parent.origins[r]).collect();
                Arc::new(Self::with_parent(
                    origins,
                    parent.timeout,
                    Some(parent.clone()),
                ))
            })
            .clone();
        (child, position)
    }

    /// Drops the parent's record of the `split` call number `seq` once every rank has taken
    /// its group.
    pub fn forget_split(&self, seq: u64) {
        lock(&self.splits).remove(&seq);
    }

    fn with_parent(origins: Vec<usize>, timeout: Duration, parent: Option<Arc<Self>>) -> Self {
        let world_size = origins.len();
        Self {
            world_size,
            origins,
            timeout,
            state: Mutex::new(State {
                rounds: HashMap::new(),
                failure: None,
                departed: vec![false; world_size],
            }),
            changed: Condvar::new(),
            parent,
            children: Mutex::new(HashMap::new()),
            splits: Mutex::new(HashMap::new()),
            cause: Mutex::new(None),
        }
    }

    /// Records that `rank` (of this group) failed on its own account, unless a rank of the
    /// job did so before.
    pub fn report(&self, rank: usize, reason: &str) {
        self.report_origin(self.origins[rank], reason);
    }

    fn report_origin(&self, origin: usize, reason: &str) {
        match &self.parent {
            Some(parent) => parent.report_origin(origin, reason),
            None => {
                lock(&self.cause).get_or_insert_with(|| (origin, reason.to_string()));
            }
        }
    }

    /// The first rank of the job that reported a failure of its own, with its reason.
    pub fn cause(&self) -> Option<(usize, String)> {
        match &self.parent {
            Some(parent) => parent.cause(),
            None => lock(&self.cause).clone(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<P>> {
        // Nothing panics while holding the lock, but never let a poisoned mutex hide the
        // group's real failure.
        lock(&self.state)
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// `rank`'s rank in the group everything was split from (itself outside split groups).
    pub fn origin(&self, rank: usize) -> usize {
        self.origins[rank]
    }

    /// Ends the group with `error` unless it already ended; wakes every waiting rank.
    pub fn fail(&self, error: CommError) -> CommError {
        let state = self.lock();
        self.end(state, error)
    }

    /// Records `error` as the group's failure unless one is recorded, releases the lock, wakes
    /// the waiting ranks and ends the parent group too. Returns the recorded failure.
    fn end(&self, mut state: MutexGuard<'_, State<P>>, error: CommError) -> CommError {
        let first = state.failure.get_or_insert(error).clone();
        drop(state);
        self.changed.notify_all();
        if let Some(parent) = &self.parent {
            parent.fail(first.clone());
        }
        first
    }

    /// The failure of this group or, for a duplicate, of the group it came from. Locks the
    /// parent while holding this group's lock: parents never lock their children, so the order
    /// is fixed.
    fn failure_in(&self, state: &State<P>) -> Option<CommError> {
        state
            .failure
            .clone()
            .or_else(|| self.parent.as_ref().and_then(|parent| parent.failure()))
    }

    /// Records that `rank` will issue no more collectives.
    pub fn depart(&self, rank: usize) {
        self.lock().departed[rank] = true;
        self.changed.notify_all();
    }

    /// The error that ended the group (or the group it was duplicated from), if any.
    pub fn failure(&self) -> Option<CommError> {
        let state = self.lock();
        self.failure_in(&state)
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
        let state = self.lock();
        let state = self.deposit(state, key, rank, call, payload)?;
        let state = self.await_round(state, key, rank, call, start, deadline)?;
        Ok(self.collect(state, key))
    }

    /// Puts `rank`'s call and payload into round `key`, opening the round if this rank is the
    /// first to reach it. Fails instead when the group has already failed, or when the call
    /// does not match the one of a rank that arrived before (which ends the group, so that
    /// every rank hears of the mismatch). The last rank to arrive wakes the others.
    fn deposit<'a>(
        &'a self,
        mut state: MutexGuard<'a, State<P>>,
        key: RoundKey,
        rank: usize,
        call: &CollectiveCall,
        payload: P,
    ) -> Result<MutexGuard<'a, State<P>>, CommError> {
        let world_size = self.world_size;
        if let Some(failure) = self.failure_in(&state) {
            return Err(failure);
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
                rank: self.origin(rank),
                call: Box::new(call.clone()),
                other_rank: self.origin(other_rank),
                other_call: Box::new(other_call.clone()),
            };
            let failure = self.end(state, error);
            tracing::error!(rank, %failure, "collective mismatch");
            return Err(failure);
        }
        round.calls[rank] = Some(call.clone());
        round.payloads[rank] = Some(payload);
        round.arrived += 1;
        if round.arrived == world_size {
            self.changed.notify_all();
        }
        Ok(state)
    }

    /// Waits until every rank has deposited into round `key`. Until then the group's failure
    /// ends the wait, and so do a missing rank that departed or the deadline, which end the
    /// group too ([`Rendezvous::abandoned`]). A duplicated group wakes every [`PARENT_POLL`]
    /// to look at its parent's failure, which does not wake it.
    fn await_round<'a>(
        &'a self,
        mut state: MutexGuard<'a, State<P>>,
        key: RoundKey,
        rank: usize,
        call: &CollectiveCall,
        start: Instant,
        deadline: Instant,
    ) -> Result<MutexGuard<'a, State<P>>, CommError> {
        loop {
            // A round every rank reached completes even if the group fails meanwhile: the
            // others may already have returned from it.
            let round = state
                .rounds
                .get(&key)
                .unwrap_or_else(|| unreachable!("a round lives until every rank collected it"));
            if round.arrived == self.world_size {
                return Ok(state);
            }
            if let Some(failure) = self.failure_in(&state) {
                return Err(failure);
            }
            let abandoned = self.abandoned(round, &state.departed, rank, call, start, deadline);
            if let Some(error) = abandoned {
                let failure = self.end(state, error);
                tracing::error!(rank, %failure, "collective abandoned");
                return Err(failure);
            }
            let mut wait = deadline.saturating_duration_since(Instant::now());
            if self.parent.is_some() {
                wait = wait.min(PARENT_POLL);
            }
            state = self
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Why `rank`, waiting for the ranks missing from `round`, gives up on it: a missing rank
    /// has departed (it will never arrive), or the deadline has passed (the error names every
    /// missing rank). `None` while it should wait on.
    fn abandoned(
        &self,
        round: &Round<P>,
        departed: &[bool],
        rank: usize,
        call: &CollectiveCall,
        start: Instant,
        deadline: Instant,
    ) -> Option<CommError> {
        let missing: Vec<usize> = (0..self.world_size)
            .filter(|&r| round.calls[r].is_none())
            .collect();
        if let Some(&peer) = missing.iter().find(|&&r| departed[r]) {
            Some(CommError::PeerExited {
                peer: self.origin(peer),
                rank: self.origin(rank),
                call: Box::new(call.clone()),
            })
        } else if Instant::now() >= deadline {
            Some(CommError::Timeout {
                rank: self.origin(rank),
                call: Box::new(call.clone()),
                waited: start.elapsed(),
                missing: missing.iter().map(|&r| self.origin(r)).collect(),
            })
        } else {
            None
        }
    }

    /// Takes a copy of every rank's payload of the completed round `key`, in rank order; the
    /// last rank to collect removes the round.
    fn collect(&self, mut state: MutexGuard<'_, State<P>>, key: RoundKey) -> Vec<P> {
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
        if round.collected == self.world_size {
            state.rounds.remove(&key);
        }
        payloads
    }
}
