//! `launch`: one thread per rank, each with a [`RankContext`]; a failed rank fails the group
//! instead of leaving the others hanging.

use std::any::Any;
use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use burn::tensor::backend::Backend;
use burn_zero_launch::sync::{into_inner, lock};

use crate::communicator::Communicator;
use crate::error::{LaunchError, RankFailure};
use crate::local::{GroupOptions, LocalGroup};
use crate::ordered::OrderedComm;

/// What a rank's closure receives: who it is, where it computes, and how it talks to the others.
///
/// The context owns the rank's one issuing thread ([`OrderedComm`]): every collective made
/// through [`Self::comm`] — by the training loop, by every module sharded with this context,
/// by their gradient-reduction threads and prefetches — runs on that thread, in the order the
/// calling threads take their positions. Two modules sharded separately and used in one
/// backward pass therefore keep one order of collectives on every rank, which NCCL requires.
/// The thread starts with the first collective and ends when the context and everything
/// sharded with it are gone.
pub struct RankContext<B: Backend> {
    rank: usize,
    world_size: usize,
    device: B::Device,
    /// The engine underneath, outside the rank's order.
    engine: Arc<dyn Communicator<B>>,
    ordered: OrderedComm<B>,
    /// `ordered` as a trait object.
    comm: Arc<dyn Communicator<B>>,
}

impl<B: Backend> RankContext<B> {
    /// Builds a context from its parts (for engines other than the launcher's own). The
    /// context puts `comm` behind the rank's issuing thread; give each rank one context and
    /// share it (by reference) rather than building a second one on the same communicator.
    pub fn new(device: B::Device, comm: Arc<dyn Communicator<B>>) -> Self {
        let ordered = OrderedComm::new(comm.clone());
        Self {
            rank: comm.rank(),
            world_size: comm.world_size(),
            device,
            comm: Arc::new(ordered.clone()),
            ordered,
            engine: comm,
        }
    }

    /// This rank's index, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The communicator of this rank's group, behind the rank's issuing thread.
    pub fn comm(&self) -> &Arc<dyn Communicator<B>> {
        &self.comm
    }

    /// The same communicator with its ordering handle, for code that reserves positions in
    /// the rank's order ahead of its calls (gradient buckets, prefetches).
    pub fn ordered(&self) -> &OrderedComm<B> {
        &self.ordered
    }

    /// The engine itself, outside the rank's order: a collective issued here from a second
    /// thread can interleave differently on different ranks. For engine-specific work and for
    /// tests of the ordering itself.
    pub fn engine(&self) -> &Arc<dyn Communicator<B>> {
        &self.engine
    }
}

/// Settings of [`launch_with`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchOptions {
    /// Options of the [`LocalGroup`] that connects the ranks.
    pub group: GroupOptions,
}

impl LaunchOptions {
    /// Options with the given collective timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            group: GroupOptions { timeout },
        }
    }
}

/// Runs `rank_fn` once per rank, each on its own thread, connected by a [`LocalGroup`], and
/// returns the ranks' results in rank order.
///
/// `devices` holds one device for all ranks or one per rank. When a rank panics or returns an
/// error, the group is aborted at once, so every other rank's collectives fail instead of
/// waiting; the result then names the first rank that failed and why.
pub fn launch<B, F, T, E>(
    world_size: usize,
    devices: &[B::Device],
    rank_fn: F,
) -> Result<Vec<T>, LaunchError>
where
    B: Backend,
    F: Fn(RankContext<B>) -> Result<T, E> + Sync,
    T: Send,
    E: Display,
{
    launch_with(world_size, devices, &LaunchOptions::default(), rank_fn)
}

/// [`launch`] with explicit options (the collective timeout).
pub fn launch_with<B, F, T, E>(
    world_size: usize,
    devices: &[B::Device],
    options: &LaunchOptions,
    rank_fn: F,
) -> Result<Vec<T>, LaunchError>
where
    B: Backend,
    F: Fn(RankContext<B>) -> Result<T, E> + Sync,
    T: Send,
    E: Display,
{
    if devices.len() != 1 && devices.len() != world_size {
        return Err(LaunchError::Invalid(format!(
            "{} devices given for {world_size} ranks: give one device for all ranks or one per rank",
            devices.len()
        )));
    }
    let ranks = LocalGroup::<B>::with_options(world_size, options.group.clone())
        .map_err(|e| LaunchError::Invalid(e.to_string()))?;
    run_ranks(ranks, devices, LocalGroup::leave, rank_fn)
}

/// Runs `rank_fn` once per communicator, each on its own thread, with `devices[rank]` (or the
/// single device given). `leave` runs after a rank succeeded; a rank that panics or returns an
/// error aborts its communicator, so the other ranks fail instead of waiting. Shared by every
/// engine's launcher.
pub(crate) fn run_ranks<B, C, F, T, E>(
    ranks: Vec<C>,
    devices: &[B::Device],
    leave: impl Fn(&C) + Sync,
    rank_fn: F,
) -> Result<Vec<T>, LaunchError>
where
    B: Backend,
    C: Communicator<B> + 'static,
    F: Fn(RankContext<B>) -> Result<T, E> + Sync,
    T: Send,
    E: Display,
{
    let world_size = ranks.len();
    if devices.len() != 1 && devices.len() != world_size {
        return Err(LaunchError::Invalid(format!(
            "{} devices given for {world_size} ranks: give one device for all ranks or one per rank",
            devices.len()
        )));
    }
    // Failures in the order they happened: the first is the cause, the rest its consequences.
    let failures: Mutex<Vec<(usize, RankFailure)>> = Mutex::new(Vec::new());
    let record = |rank: usize, failure: RankFailure, comm: &C| {
        tracing::error!(rank, %failure, "rank failed");
        let reason = failure.to_string();
        lock(&failures).push((rank, failure));
        comm.abort(&reason);
    };

    // One handle kept to ask the group, at the end, which rank failed first on its own account.
    let mut witness: Option<Arc<C>> = None;
    let results: Vec<Option<T>> = thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world_size);
        for (rank, comm) in ranks.into_iter().enumerate() {
            let comm = Arc::new(comm);
            witness.get_or_insert_with(|| comm.clone());
            let device = devices[rank % devices.len()].clone();
            let (rank_fn, record, leave) = (&rank_fn, &record, &leave);
            let spawned = thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(scope, move || {
                    let ctx = RankContext::new(device, comm.clone() as Arc<dyn Communicator<B>>);
                    match catch_unwind(AssertUnwindSafe(|| rank_fn(ctx))) {
                        Ok(Ok(value)) => {
                            leave(&comm);
                            Some(value)
                        }
                        Ok(Err(error)) => {
                            record(rank, RankFailure::Errored(error.to_string()), &comm);
                            None
                        }
                        Err(payload) => {
                            record(rank, RankFailure::Panicked(panic_message(&*payload)), &comm);
                            None
                        }
                    }
                });
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(error) => {
                    // The ranks already running must not wait for this one.
                    let failure = RankFailure::Errored(format!("could not start thread: {error}"));
                    lock(&failures).push((rank, failure));
                    break;
                }
            }
        }
        handles
            .into_iter()
            .map(|handle| handle.join().unwrap_or(None))
            .collect()
    });

    let mut failures = into_inner(failures);
    if failures.is_empty() && results.len() == world_size {
        return Ok(results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| unreachable!("no rank failed")))
            .collect());
    }
    if failures.is_empty() {
        return Err(LaunchError::Invalid(
            "not every rank could be started".into(),
        ));
    }
    // The cause: the first rank that reported a failure of its own to the group (before the
    // others could learn of it), whichever rank's closure happened to return first.
    let cause = witness
        .and_then(|comm| comm.first_failure())
        .and_then(|(rank, _)| failures.iter().position(|(failed, _)| *failed == rank))
        .unwrap_or(0);
    let (rank, failure) = failures.remove(cause);
    Err(LaunchError::RankFailed {
        rank,
        failure,
        others: failures,
    })
}

/// The text of a panic payload (`panic!("…")` carries a `&str` or a `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".to_string()
    }
}
