//! The communication thread: reduces gradient buckets while backward is still running.
//!
//! Autodiff's hook hands each final gradient over and returns at once. The hook that
//! completes a bucket (all its members handed over, and every earlier bucket complete) also
//! takes the bucket's position in the rank's order of collectives, on the training thread
//! ([`burn_zero_comm::OrderedComm::reserve`]); the thread packs the bucket and runs its
//! collective in that position, through the rank's one issuing thread (with hybrid sharding,
//! the all-reduce across the shard groups follows in the same position). So the gathers the training thread issues
//! during a stage-3 backward and the bucket reductions are interleaved by program order, the
//! same on every rank, never by how fast this thread packs (see [`burn_zero_comm::ordered`]
//! for the whole argument). At the end of backward the training thread takes the positions of
//! the buckets still open, waits for the results and writes them into autodiff's gradient
//! slots itself. Buckets are reduced strictly in layout order, with the same arithmetic as on
//! the training thread, so results are bitwise the same as without overlap.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn_zero_comm::sync::lock;
use burn_zero_comm::{CommError, Communicator, Deferred, RankCounters, Reservation};
use burn_zero_kernels::QueueMark;

use crate::memory::MemoryTracker;
use crate::reduce::bucket::Bucket;
use crate::reduce::queue::{BucketQueue, Reduced};
use crate::reduce::reduction::{self, ReduceError, Reduction, Values};
use crate::store::groups::OrderedGroups;
use crate::store::host_gradients::HostGradients;

enum Job<B: Backend> {
    /// Parameter `key`'s final gradient, counted as `bytes` of bucket memory.
    Gradient {
        key: usize,
        grad: B::FloatTensorPrimitive,
        bytes: usize,
    },
    /// Reduce the next bucket, in the position `reservation` holds (with hybrid sharding,
    /// `replicas` is the same position on the replica group, for the all-reduce across the
    /// shard groups).
    Reduce {
        reservation: Reservation<B>,
        replicas: Option<Reservation<B>>,
        /// The point of the training thread's queue its gradients were written before.
        written: QueueMark,
        /// The bucket's full gradients, in bytes: taken off the backlog once it is reduced.
        bytes: usize,
    },
    /// Backward is over (its last hook ran at `backward_ended`) and every bucket has had its
    /// `Reduce`: send everything back.
    Finish { backward_ended: Instant },
    /// Between passes: reduce these buckets, in this order, from the next pass on.
    Rebuild(Vec<Bucket>),
}

/// What the thread sends back at the end of a backward pass.
pub(crate) struct Finished<B: Backend> {
    pub reduced: Result<Vec<Reduced<B>>, ReduceError>,
    /// Time the thread spent packing, reducing and unpacking.
    pub busy_seconds: f64,
    /// Buckets whose reduction was done before backward's last hook ran.
    pub early: usize,
    /// The most full-gradient bytes handed over that waited at once for the rest of their
    /// bucket (see [`crate::ReductionStats::peak_incomplete_bytes`]).
    pub peak_incomplete_bytes: usize,
}

/// Handle on a rank's communication thread, kept by the training thread.
pub(crate) struct CommThread<B: Backend> {
    jobs: Option<Sender<Job<B>>>,
    finished: Receiver<Finished<B>>,
    thread: Option<JoinHandle<()>>,
    /// The rank's order of collectives, where each bucket takes its position(s): the shard
    /// group's, and the replica group's with hybrid sharding.
    order: OrderedGroups<B>,
    /// Each bucket's member keys, in reduction order.
    members: Vec<Vec<usize>>,
    /// Each bucket's full gradients, in bytes.
    bucket_bytes: Vec<usize>,
    /// Gradients of buckets handed over for reduction and not reduced yet.
    backlog: Arc<Backlog>,
    /// Keys handed over in this backward pass.
    handed: HashSet<usize>,
    /// The next bucket without a position.
    next: usize,
    /// Bytes of this pass's gradients handed over whose bucket is not complete yet, and the
    /// most of them at once.
    incomplete_bytes: usize,
    peak_incomplete_bytes: usize,
    /// The device the gradients are on, and the rank's counts.
    device: B::Device,
    counters: Arc<RankCounters>,
}

impl<B: Backend> CommThread<B> {
    /// Starts the thread of a rank, reducing `buckets` in positions of `order` (the rank's
    /// groups behind its issuing thread) on `device`; the gradient shards `to_host` names go to
    /// host memory as they are reduced.
    pub fn spawn(
        order: OrderedGroups<B>,
        buckets: Vec<Bucket>,
        device: B::Device,
        predivide: f64,
        memory: Arc<MemoryTracker>,
        counters: Arc<RankCounters>,
        to_host: Arc<HostGradients>,
    ) -> std::io::Result<Self> {
        let (jobs, inbox) = channel::<Job<B>>();
        let (outbox, finished) = channel::<Finished<B>>();
        let rank = order.shard.rank();
        let (members, bucket_bytes) = index(&buckets);
        let backlog = Arc::new(Backlog::new(&bucket_bytes));
        let drained = backlog.clone();
        let work = Work {
            device: device.clone(),
            predivide,
            memory,
            counters: counters.clone(),
            to_host,
        };
        let thread = std::thread::Builder::new()
            .name(format!("burn-zero-reduce-{rank}"))
            .spawn(move || {
                serve(&work, BucketQueue::new(buckets), &inbox, &outbox, &drained);
            })?;
        Ok(Self {
            jobs: Some(jobs),
            finished,
            thread: Some(thread),
            order,
            members,
            bucket_bytes,
            backlog,
            handed: HashSet::new(),
            next: 0,
            incomplete_bytes: 0,
            peak_incomplete_bytes: 0,
            device,
            counters,
        })
    }

    /// Hands over parameter `key`'s final gradient, written on the caller's thread. When this
    /// completes the next bucket(s), the caller's pending work on the device is finished once
    /// (the thread reads the bucket's gradients from its own stream on cubecl backends) and
    /// their positions in the rank's order are taken here, on the caller's thread: one device
    /// synchronisation per bucket, not one per gradient.
    pub fn submit(&mut self, key: usize, grad: B::FloatTensorPrimitive, bytes: usize) {
        self.send(Job::Gradient { key, grad, bytes });
        self.handed.insert(key);
        self.incomplete_bytes += bytes;
        let complete = |this: &Self| {
            this.members
                .get(this.next)
                .is_some_and(|keys| keys.iter().all(|key| this.handed.contains(key)))
        };
        if complete(self) {
            let written = self.settle();
            while complete(self) {
                self.incomplete_bytes = self
                    .incomplete_bytes
                    .saturating_sub(self.bucket_bytes[self.next]);
                self.reserve_next(&written);
            }
        }
        self.peak_incomplete_bytes = self.peak_incomplete_bytes.max(self.incomplete_bytes);
        self.backlog.wait_within_limit(|| {
            self.thread
                .as_ref()
                .is_none_or(|thread| thread.is_finished())
        });
    }

    /// Finishes the caller's pending work on the device before the thread reads what it was
    /// handed. A no-op on CPU backends. Where the engines order their inputs after the
    /// writers on the device ([`burn_zero_comm::Communicator::orders_inputs_on_device`]),
    /// nothing is finished: the caller's queue is marked, the issuing thread orders its own
    /// after the mark before it packs (cubecl alone would miss a gradient accumulated in
    /// place after the threads last met, [`QueueMark`]), and the engine orders the collective
    /// after the packing.
    fn settle(&self) -> QueueMark {
        let on_device = self.order.shard.orders_inputs_on_device()
            && self
                .order
                .replicas
                .as_ref()
                .is_none_or(|replicas| replicas.orders_inputs_on_device());
        if on_device {
            return QueueMark::here::<B>(&self.device);
        }
        if let Err(error) = B::sync(&self.device) {
            panic!(
                "burn-zero: rank {} could not finish its gradients on its device: {error}",
                self.order.shard.rank()
            );
        }
        self.counters.sync();
        QueueMark::none()
    }

    /// Takes the next bucket's position and hands it to the thread, with the mark its
    /// gradients were written before.
    fn reserve_next(&mut self, written: &QueueMark) {
        let reservation = self.order.shard.reserve();
        // With hybrid sharding the all-reduce across the groups runs in the same position,
        // right after the group's collective.
        let replicas = self.order.replicas.as_ref().map(|group| {
            reservation
                .on_group(group)
                .expect("the replica group is split from the rank's ordered communicator")
        });
        let bytes = self.bucket_bytes[self.next];
        self.backlog.add(bytes);
        self.send(Job::Reduce {
            reservation,
            replicas,
            written: written.clone(),
            bytes,
        });
        self.next += 1;
    }

    fn send(&self, job: Job<B>) {
        if let Some(jobs) = &self.jobs {
            // A send fails only when the thread is gone; `finish` reports that. A reservation
            // in a job that cannot be sent is dropped, which skips its position.
            let _ = jobs.send(job);
        }
    }

    /// Reduces `buckets` (the same gradients, regrouped or in another order) from the next
    /// pass on. Called between passes.
    pub fn rebuild(&mut self, buckets: Vec<Bucket>) {
        (self.members, self.bucket_bytes) = index(&buckets);
        self.backlog.set_limit(&self.bucket_bytes);
        self.send(Job::Rebuild(buckets));
    }

    /// Takes the positions of the buckets still open: the pass is over, so they are reduced
    /// zero-filled where this rank has no gradient.
    pub fn reserve_rest(&mut self) {
        if self.next < self.members.len() {
            let written = self.settle();
            while self.next < self.members.len() {
                self.reserve_next(&written);
            }
        }
    }

    /// Waits for every bucket of this backward pass, which ended at `backward_ended` (taking
    /// the positions of any still open first).
    pub fn finish(&mut self, backward_ended: Instant) -> Finished<B> {
        self.reserve_rest();
        self.next = 0;
        self.handed.clear();
        self.incomplete_bytes = 0;
        let peak_incomplete_bytes = std::mem::take(&mut self.peak_incomplete_bytes);
        let gone = || Finished {
            reduced: Err(ReduceError::Comm(CommError::InvalidGroup(
                "the gradient communication thread has stopped".into(),
            ))),
            busy_seconds: 0.0,
            early: 0,
            peak_incomplete_bytes: 0,
        };
        let finished = match &self.jobs {
            Some(jobs) if jobs.send(Job::Finish { backward_ended }).is_ok() => {
                self.finished.recv().unwrap_or_else(|_| gone())
            }
            _ => gone(),
        };
        Finished {
            peak_incomplete_bytes,
            ..finished
        }
    }
}

impl<B: Backend> Drop for CommThread<B> {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.jobs.take();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the gradient communication thread panicked");
        }
    }
}

/// Each bucket's member keys and full gradient bytes, in reduction order: what the training
/// thread needs to know of the buckets it hands over.
fn index(buckets: &[Bucket]) -> (Vec<Vec<usize>>, Vec<usize>) {
    (
        buckets.iter().map(Bucket::keys).collect(),
        buckets.iter().map(Bucket::gradient_bytes).collect(),
    )
}

/// What the thread reduces with, besides the communicator.
#[derive(Clone)]
struct Work<B: Backend> {
    device: B::Device,
    predivide: f64,
    memory: Arc<MemoryTracker>,
    counters: Arc<RankCounters>,
    /// The store's set: the gradient shards an optimizer that steps on the host wants there.
    to_host: Arc<HostGradients>,
}

impl<B: Backend> Work<B> {
    /// Runs `reduce` with a [`Reduction`] on `shard` (and with hybrid sharding, `replicas`).
    fn reduction<T>(
        &self,
        shard: &dyn Communicator<B>,
        replicas: Option<&dyn Communicator<B>>,
        reduce: impl FnOnce(&Reduction<'_, B>) -> T,
    ) -> T {
        reduce(&Reduction {
            comm: shard,
            replicas,
            device: &self.device,
            predivide: self.predivide,
            memory: &self.memory,
            to_host: &self.to_host,
            counters: &self.counters,
            // Left to the samplers: here the bucket and its gradients are held together for a
            // whole collective across ranks, not for an instant.
            at_peak: None,
        })
    }
}

/// The thread's loop: queue gradients, have the issuing thread reduce the next bucket in each
/// position it is given, answer `Finish`.
fn serve<B: Backend>(
    work: &Work<B>,
    mut queue: BucketQueue<B>,
    inbox: &Receiver<Job<B>>,
    outbox: &Sender<Finished<B>>,
    backlog: &Arc<Backlog>,
) {
    let mut pass = Pass::default();
    for job in inbox {
        match job {
            Job::Gradient { key, grad, bytes } => queue.push(key, grad, bytes),
            Job::Reduce {
                reservation,
                replicas,
                written,
                bytes,
            } => {
                pass.collect(&mut queue, backlog, false);
                if pass.failure.is_none() && !queue.is_done() {
                    let jobs = (reservation, replicas, written);
                    pass.reduce_next(work, &mut queue, jobs, bytes, backlog);
                } else {
                    // Skipped after a failure: its full gradients are freed.
                    backlog.sub(bytes);
                }
            }
            Job::Finish { backward_ended } => {
                pass.collect(&mut queue, backlog, true);
                let early = pass
                    .done_at
                    .iter()
                    .filter(|&&done| done <= backward_ended)
                    .count();
                queue.reset(&work.memory);
                let done = std::mem::take(&mut pass);
                let sent = outbox.send(Finished {
                    reduced: match done.failure {
                        Some(error) => Err(error),
                        None => Ok(done.reduced),
                    },
                    busy_seconds: done.busy_seconds,
                    early,
                    peak_incomplete_bytes: 0,
                });
                if sent.is_err() {
                    return;
                }
            }
            Job::Rebuild(buckets) => queue = BucketQueue::new(buckets),
        }
    }
}

/// The thread's results for the backward pass in progress.
struct Pass<B: Backend> {
    reduced: Vec<Reduced<B>>,
    /// When each bucket's reduction finished.
    done_at: Vec<Instant>,
    failure: Option<ReduceError>,
    busy_seconds: f64,
    /// Buckets whose reductions finish on the issuing thread, in reduction order.
    in_flight: VecDeque<InFlight<B>>,
}

impl<B: Backend> Default for Pass<B> {
    fn default() -> Self {
        Self {
            reduced: Vec::new(),
            done_at: Vec::new(),
            failure: None,
            busy_seconds: 0.0,
            in_flight: VecDeque::new(),
        }
    }
}

/// A reduced bucket, back from the issuing thread: the bucket (to reuse), its values, when its
/// reduction finished and the seconds the issuing thread spent on it.
type Outcome<B> = (Bucket, Result<Values<B>, ReduceError>, Instant, f64);

/// A bucket whose reduction finishes on the issuing thread.
struct InFlight<B: Backend> {
    index: usize,
    result: Deferred<Outcome<B>, ReduceError>,
    /// The bucket's full gradients, in bytes, for the backlog if the reduction never reached
    /// its end (which takes them off itself).
    bytes: usize,
    /// The groups to end if it failed.
    engine: Arc<dyn Communicator<B>>,
}

impl<B: Backend> Pass<B> {
    /// Reduces the next bucket in `reservation`'s position (with hybrid sharding, `replicas`
    /// holds the same position on the replica group). Packing, the collective(s) and unpacking
    /// all run on the issuing thread, so the only device synchronisation a bucket costs is the
    /// one its last hook made for its gradients (none where the engine orders on the device).
    /// Their device work is queued in the training thread's queue, which reads the unpacked
    /// shards and drops them (see `burn_zero_comm::ordered`), or, for shards read back to
    /// the host here, in the issuing thread's own.
    ///
    /// The issuing thread does not wait for the bucket's collective: it unpacks once the
    /// device has finished it ([`Reservation::run_deferred`]), and this thread collects the
    /// result later ([`Self::collect`]). With hybrid sharding the bucket finishes in its
    /// position instead: the all-reduce across the groups runs on another communicator, and
    /// the collectives of communicators that share a device must keep one order on every rank.
    fn reduce_next(
        &mut self,
        work: &Work<B>,
        queue: &mut BucketQueue<B>,
        jobs: (Reservation<B>, Option<Reservation<B>>, QueueMark),
        bytes: usize,
        backlog: &Arc<Backlog>,
    ) {
        let (reservation, replicas, written) = jobs;
        let Some((index, bucket, grads)) = queue.take_next(&work.memory) else {
            backlog.sub(bytes);
            return;
        };
        // Read back to the host here, the bucket's device work stays in this thread's queue;
        // otherwise it runs in the training thread's, which reads the results.
        let (reservation, replicas) =
            if reduction::host_read_dtype(&work.to_host, &bucket).is_some() {
                (
                    reservation.read_on_issuing_thread(),
                    replicas.map(Reservation::read_on_issuing_thread),
                )
            } else {
                (reservation, replicas)
            };
        let engine = reservation.engine().clone();
        let across = replicas.as_ref().map(|r| r.engine().clone());
        let kinds = bucket.collectives(across.is_some());
        let work = work.clone();
        let result = match across {
            None => {
                let (shard, finished) = (engine.clone(), backlog.clone());
                reservation.run_deferred(
                    &kinds,
                    move |shard_here| {
                        let started = Instant::now();
                        written.order_here();
                        let (issued, held) = work.reduction(shard_here, None, |ctx| {
                            reduction::issue(ctx, &bucket, grads)
                        })?;
                        let busy = started.elapsed().as_secs_f64();
                        Ok((issued, (bucket, held, work, busy)))
                    },
                    move |reduced, (bucket, held, work, busy)| {
                        let started = Instant::now();
                        let values = work.reduction(shard.as_ref(), None, |ctx| {
                            reduction::complete(ctx, &bucket, reduced, held)
                        });
                        finished.sub(bytes);
                        let busy = busy + started.elapsed().as_secs_f64();
                        Ok((bucket, values, Instant::now(), busy))
                    },
                )
            }
            Some(across) => {
                let replica_group = across.clone();
                let outcome = reservation.run(&kinds, move |shard| {
                    let started = Instant::now();
                    written.order_here();
                    let values = work.reduction(shard, Some(across.as_ref()), |ctx| {
                        reduction::reduce(ctx, &bucket, grads)
                    });
                    Ok((
                        bucket,
                        values,
                        Instant::now(),
                        started.elapsed().as_secs_f64(),
                    ))
                });
                backlog.sub(bytes);
                let engines = [engine, replica_group];
                self.record(queue, index, outcome.map_err(ReduceError::from), &engines);
                drop(replicas);
                return;
            }
        };
        match result {
            Ok(result) => self.in_flight.push_back(InFlight {
                index,
                result,
                bytes,
                engine,
            }),
            Err(error) => {
                backlog.sub(bytes);
                self.record(queue, index, Err(ReduceError::from(error)), &[engine]);
            }
        }
    }

    /// Takes the results of the buckets in flight, in order: those that have arrived, or with
    /// `all`, every one, waiting for each.
    fn collect(&mut self, queue: &mut BucketQueue<B>, backlog: &Backlog, all: bool) {
        while let Some(next) = self.in_flight.front() {
            let arrived = next.result.try_take();
            if arrived.is_none() && !all {
                return;
            }
            let InFlight {
                index,
                result,
                bytes,
                engine,
            } = self
                .in_flight
                .pop_front()
                .expect("the front bucket was just read");
            let result = arrived.unwrap_or_else(|| result.wait());
            if result.is_err() {
                // It never reached its end, which takes its gradients off the backlog.
                backlog.sub(bytes);
            }
            self.record(queue, index, result, &[engine]);
        }
    }

    /// Records bucket `index`'s reduction: its values, or the failure, which ends the groups
    /// of `engines` (the shard group's first) so that no rank pairs its next collective with a
    /// wrong one.
    fn record(
        &mut self,
        queue: &mut BucketQueue<B>,
        index: usize,
        outcome: Result<Outcome<B>, ReduceError>,
        engines: &[Arc<dyn Communicator<B>>],
    ) {
        let result = outcome.and_then(|(bucket, values, done_at, busy)| {
            queue.restore(index, bucket);
            self.busy_seconds += busy;
            values.map(|values| (values, done_at))
        });
        match result {
            Ok((values, done_at)) => {
                self.reduced.push(Reduced {
                    bucket: index,
                    values,
                });
                self.done_at.push(done_at);
            }
            Err(error) => {
                let rank = engines.first().map_or(0, |engine| engine.rank());
                let reason = format!("rank {rank} could not reduce a gradient bucket: {error}");
                for engine in engines {
                    engine.abort(&reason);
                }
                if self.failure.is_none() {
                    self.failure = Some(error);
                }
            }
        }
    }
}

/// The full gradients of the buckets the training thread has handed to the thread for
/// reduction and that are not reduced yet, in bytes, with a limit: one bucket's worth (the
/// largest). Without it, a training thread that runs ahead of the reductions (its backward only
/// queues work on the device; the thread waits for each collective) hands over every gradient of
/// the pass before the first bucket is reduced, and the device holds them all at once. With it,
/// the hook that hands over a bucket waits while more than one bucket beyond the one being
/// reduced is waiting, as DeepSpeed's double-buffered buckets do.
///
/// The wait is bounded ([`Backlog::LONGEST_WAIT`]): the hook runs under the rank's autodiff
/// graph lock, and a rank whose backward is over takes every graph's lock to clean up before it
/// reserves the positions of its buckets still open (those of parameters it did not use). A
/// bucket of ours in such a position cannot be reduced until that rank gets our lock; past the
/// bound the hook goes on, and the memory bound gives way rather than the job.
struct Backlog {
    bytes: Mutex<usize>,
    drained: Condvar,
    limit: AtomicUsize,
}

impl Backlog {
    /// How often a waiting hook checks that the thread is still alive.
    const RECHECK: Duration = Duration::from_millis(10);
    /// The longest a hook waits for the backlog to drain.
    const LONGEST_WAIT: Duration = Duration::from_millis(200);

    /// A backlog for buckets of `bucket_bytes` each.
    fn new(bucket_bytes: &[usize]) -> Self {
        Self {
            bytes: Mutex::new(0),
            drained: Condvar::new(),
            limit: AtomicUsize::new(Self::largest(bucket_bytes)),
        }
    }

    /// Sets the limit for buckets of `bucket_bytes` each (the buckets were rebuilt).
    fn set_limit(&self, bucket_bytes: &[usize]) {
        self.limit
            .store(Self::largest(bucket_bytes), Ordering::Relaxed);
    }

    /// The limit: one bucket's worth, the largest.
    fn largest(bucket_bytes: &[usize]) -> usize {
        bucket_bytes.iter().copied().max().unwrap_or(0)
    }

    fn add(&self, bytes: usize) {
        *lock(&self.bytes) += bytes;
    }

    fn sub(&self, bytes: usize) {
        let mut held = lock(&self.bytes);
        *held = held.saturating_sub(bytes);
        self.drained.notify_all();
    }

    /// Waits while the backlog is over its limit, for at most [`Self::LONGEST_WAIT`], unless
    /// `gone` says the thread has stopped (its failure is reported at the end of the pass).
    fn wait_within_limit(&self, gone: impl Fn() -> bool) {
        let started = Instant::now();
        let limit = self.limit.load(Ordering::Relaxed);
        let mut held = lock(&self.bytes);
        while *held > limit && !gone() && started.elapsed() < Self::LONGEST_WAIT {
            held = match self.drained.wait_timeout(held, Self::RECHECK) {
                Ok((held, _)) => held,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }
}
