//! `GradientReducer`: each parameter's final gradient is reduced across ranks (mean) and
//! replaced, through autodiff's gradient slot, by this rank's shard of the result (or the
//! whole mean, for all-reduced parameters).
//!
//! Gradients are reduced in buckets ([`crate::reduce::bucket`]) in one order on every rank,
//! whatever order the hooks fire in and whichever parameters a rank used, with zeros standing
//! in for the gradients this rank does not have. So ranks never issue different collectives.
//! The first backward pass reduces the reduce-scattered buckets by descending parameter key
//! and the all-reduced ones after them; from the second on, the buckets are rebuilt for the
//! order the first pass produced gradients in and go in the order it completed them, rank 0's
//! on every rank (`GradientReducer::end_backward`). With `overlap_comm` (stages 0, 2, 3) a
//! communication thread ([`crate::reduce::thread`]) reduces each bucket as soon as it is
//! complete, while backward goes on, in the position of the rank's order of collectives that
//! the completing hook took (so the order is the program's, not the threads' timing);
//! otherwise, and at stage 1, every bucket is reduced when backward ends, on the training
//! thread. Either way the hook itself never blocks (see [`GradientReducer::gradient_ready`]).
//!
//! A rank alone (world size 1) has no peer to wait for: its collectives are answered in place
//! ([`burn_zero_comm::ordered`]). With `overlap_comm` it reduces each bucket in the hook that
//! completes it, on the training thread, in the same order and with the same arithmetic: no
//! communication thread to hand the gradients over to (each bucket is still finished on the
//! device once; see [`crate::reduce::reduction::reduce`]).
//!
//! A gradient waits in one of two places until its bucket is reduced: the bucket queue (of
//! the communication thread, or of this thread without one) or, when it is itself sharded
//! and would have to gather, with the pass until backward ends. Its autodiff slot waits with
//! the pass for the result.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorMetadata};

use crate::memory::MemoryKind;
use crate::reduce::bucket::{self, Bucket};
use crate::reduce::deliver::{Destinations, deliver};
use crate::reduce::queue::{BucketQueue, Reduced};
use crate::reduce::reduction::{ReduceError, Reduction};
use crate::reduce::slot::GradSlot;
use crate::reduce::stats::ReductionStats;
use crate::reduce::thread::CommThread;
use crate::store::ParamStore;
use crate::tensor::ZeroTensor;
use burn_zero_comm::sync::lock;
use burn_zero_comm::{CommError, agree};

/// One rank's gradient reduction for a sharded module: the static bucket layout, the
/// communication thread (if reduction overlaps backward) and the state of the backward pass
/// in progress.
pub struct GradientReducer<B: Backend> {
    store: Arc<ParamStore<B>>,
    pass: Mutex<Pass<B>>,
    last: Mutex<ReductionStats>,
}

impl<B: Backend> std::fmt::Debug for GradientReducer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientReducer")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

/// The state of one backward pass.
struct Pass<B: Backend> {
    /// Gradients waiting for their bucket, when buckets are reduced on this thread.
    queue: BucketQueue<B>,
    /// The communication thread, when reduction overlaps backward.
    thread: Option<CommThread<B>>,
    /// When each bucket is reduced on this thread as soon as it is complete (a rank alone with
    /// overlap: its collectives are answered in place, so reducing cannot block), what the
    /// hooks of this pass reduced.
    eager: Option<Eager<B>>,
    /// Autodiff's slots of this pass's gradients, by parameter key.
    slots: BTreeMap<usize, GradSlot<B>>,
    /// Gradients that stay with this thread until backward ends, with their bytes: all of
    /// them without a communication thread; with one, the (rare) sharded ones, which gather.
    held: BTreeMap<usize, (ZeroTensor<B>, usize)>,
    /// What a slot holds between its gradient's hand-over and the result: one element, shared.
    placeholder: Option<B::FloatTensorPrimitive>,
    /// Whether a backward pass is in progress.
    active: bool,
    /// Reduced gradients of parameters this rank did not use in the last backward (its
    /// autodiff graph has no slot for them), kept for the optimizer.
    orphans: BTreeMap<usize, ZeroTensor<B>>,
    /// The parameter keys in the order their final gradients arrived in this pass, until the
    /// buckets are rebuilt.
    arrivals: Vec<usize>,
    /// Whether the buckets have been rebuilt for the order a backward pass produces gradients.
    rebuilt: bool,
}

impl<B: Backend> Pass<B> {
    fn start(&mut self) {
        if !self.active {
            self.active = true;
            self.slots.clear();
            self.held.clear();
            self.orphans.clear();
            self.arrivals.clear();
            if let Some(eager) = &mut self.eager {
                *eager = Eager::default();
            }
        }
    }

    /// What a slot holds between its gradient's hand-over and the result (autodiff's
    /// container no longer keeps the full gradient alive).
    fn placeholder(&mut self, store: &ParamStore<B>) -> B::FloatTensorPrimitive {
        self.placeholder
            .get_or_insert_with(|| {
                Tensor::<B, 1>::zeros([1], store.device())
                    .into_primitive()
                    .tensor()
            })
            .clone()
    }

    /// Whether this pass reduces buckets as they complete, so that the first pass's order of
    /// completion is worth recording.
    fn reduces_during_backward(&self) -> bool {
        self.thread.is_some() || self.eager.is_some()
    }
}

/// What the hooks of an eager pass reduced.
struct Eager<B: Backend> {
    /// The buckets, in order.
    reduced: Vec<Reduced<B>>,
    /// The failure that stopped them, reported when backward ends.
    failure: Option<ReduceError>,
    /// Time spent reducing.
    seconds: f64,
    /// The most full-gradient bytes that waited at once for the rest of their bucket (see
    /// [`ReductionStats::peak_incomplete_bytes`]).
    peak_incomplete_bytes: usize,
}

impl<B: Backend> Default for Eager<B> {
    fn default() -> Self {
        Self {
            reduced: Vec::new(),
            failure: None,
            seconds: 0.0,
            peak_incomplete_bytes: 0,
        }
    }
}

impl<B: Backend> GradientReducer<B> {
    /// A reducer of the parameters of `store`, in `buckets` (reduction order), on `thread`
    /// when reduction overlaps backward, or in the hooks that complete them when `eager`.
    pub(crate) fn new(
        store: Arc<ParamStore<B>>,
        buckets: Vec<Bucket>,
        thread: Option<CommThread<B>>,
        eager: bool,
    ) -> Self {
        Self {
            store,
            pass: Mutex::new(Pass {
                queue: BucketQueue::new(buckets),
                thread,
                eager: eager.then(Eager::default),
                slots: BTreeMap::new(),
                held: BTreeMap::new(),
                placeholder: None,
                active: false,
                orphans: BTreeMap::new(),
                arrivals: Vec::new(),
                rebuilt: false,
            }),
            last: Mutex::new(ReductionStats::default()),
        }
    }

    /// The store whose parameters' gradients this reduces.
    pub fn store(&self) -> &Arc<ParamStore<B>> {
        &self.store
    }

    fn lock_pass(&self) -> MutexGuard<'_, Pass<B>> {
        lock(&self.pass)
    }

    /// Gradient-reduction statistics of the last backward pass.
    pub fn last_reduction(&self) -> ReductionStats {
        *lock(&self.last)
    }

    /// The gradient bucket layout: the parameter keys of each bucket, in reduction order.
    pub fn bucket_layout(&self) -> Vec<Vec<usize>> {
        self.lock_pass()
            .queue
            .buckets()
            .iter()
            .map(Bucket::keys)
            .collect()
    }

    /// Reduced gradient shards of parameters this rank did not use in the last backward pass
    /// (its autodiff gradients have no entry for them), by parameter key. Taken once.
    pub fn take_orphan_gradients(&self) -> BTreeMap<usize, ZeroTensor<B>> {
        std::mem::take(&mut self.lock_pass().orphans)
    }

    /// Starts a backward pass (idempotent within one pass).
    pub(crate) fn begin_backward(&self) {
        self.lock_pass().start();
    }

    /// The final gradient of parameter `key` sits in `slot`: hand it to the communication
    /// thread, or keep it until backward ends (or, `eager`, until its bucket is complete).
    ///
    /// Nothing that waits for another rank runs on this thread here. Autodiff calls this hook
    /// while it holds the rank's graph lock, and after every backward pass burn-autodiff locks
    /// *every* graph of the process to clean up. A rank blocked in a collective under its lock
    /// can then wait forever for a rank that waits for that lock (seen with four ranks). The
    /// communication thread holds no graph lock, so it may block; an eager reduction is a rank
    /// alone's, whose collectives never wait.
    pub(crate) fn gradient_ready(&self, key: usize, slot: GradSlot<B>) {
        let grad = slot.read();
        let bytes = grad.shape().num_elements() * grad.dtype().size();
        let store = &self.store;
        store.read_within_period();
        store.memory().add(MemoryKind::Buckets, bytes);
        let mut guard = self.lock_pass();
        let pass = &mut *guard;
        pass.start();
        // Only the first pass that reduces during backward decides the buckets' order.
        if !pass.rebuilt && pass.reduces_during_backward() {
            pass.arrivals.push(key);
        }
        match (&mut pass.thread, grad) {
            (Some(thread), ZeroTensor::Local(grad)) => {
                // The thread finishes the device's work once per bucket before reading it.
                thread.submit(key, grad, bytes);
                slot.write(ZeroTensor::Local(pass.placeholder(store)));
            }
            (None, ZeroTensor::Local(grad)) if pass.eager.is_some() => {
                pass.queue.push(key, grad, bytes);
                if let Some(eager) = &mut pass.eager {
                    self.reduce_complete(&mut pass.queue, eager);
                }
                slot.write(ZeroTensor::Local(pass.placeholder(store)));
            }
            // Kept as it is: materialising a sharded gradient would gather under the lock.
            (_, grad) => {
                pass.held.insert(key, (grad, bytes));
            }
        }
        pass.slots.insert(key, slot);
    }

    /// Ends a backward pass: reduces every bucket not reduced yet, zero-filled where this rank
    /// has no gradient, writes the results into autodiff's slots, and drops the gathered
    /// parameters the pass left in the cache. After the first pass with a communication
    /// thread, puts the buckets in the order that pass completed them.
    pub(crate) fn end_backward(&self) {
        let backward_ended = Instant::now();
        let store = &self.store;
        let mut guard = self.lock_pass();
        let pass = &mut *guard;
        if pass.active {
            let started = Instant::now();
            let held = std::mem::take(&mut pass.held);
            let (reduced, overlap) = match &mut pass.thread {
                Some(thread) => {
                    for (key, (grad, bytes)) in held {
                        thread.submit(key, grad.materialize(), bytes);
                    }
                    // Every bucket takes its position now, before the fence.
                    thread.reserve_rest();
                    // A fence at the end of the pass: a rank that gathered more than the
                    // others meets a mismatch here instead of waiting for a partner that
                    // will not come until the next step.
                    match store.comm().barrier() {
                        Ok(()) => {
                            let finished = thread.finish(backward_ended);
                            let overlap = (
                                finished.busy_seconds,
                                finished.early,
                                finished.peak_incomplete_bytes,
                            );
                            (finished.reduced, Some(overlap))
                        }
                        Err(error) => (Err(ReduceError::Comm(error)), None),
                    }
                }
                None => {
                    for (key, (grad, bytes)) in held {
                        pass.queue.push(key, grad.materialize(), bytes);
                    }
                    let eager = pass.eager.as_mut().map(std::mem::take).unwrap_or_default();
                    // The hooks' time, to which the rest's (exposed) time adds below.
                    let overlap = pass.eager.is_some().then_some((
                        eager.seconds,
                        eager.reduced.len(),
                        eager.peak_incomplete_bytes,
                    ));
                    let reduced = match eager.failure {
                        Some(error) => {
                            pass.queue.reset(store.memory());
                            Err(error)
                        }
                        None => self
                            .reduce_here(&mut pass.queue)
                            .map(|rest| eager.reduced.into_iter().chain(rest).collect()),
                    };
                    (reduced, overlap)
                }
            };
            let reduced = reduced.unwrap_or_else(|error| {
                panic!(
                    "burn-zero: rank {} could not reduce its gradients: {error}",
                    store.rank()
                )
            });
            let exposed_seconds = started.elapsed().as_secs_f64();
            let (mut seconds, overlapped, peak_incomplete_bytes) = overlap.unwrap_or((0.0, 0, 0));
            if pass.thread.is_none() {
                seconds += exposed_seconds;
            }
            let mut stats = ReductionStats {
                exposed_seconds,
                seconds,
                overlapped,
                peak_incomplete_bytes,
                ..ReductionStats::default()
            };
            let to = Destinations {
                slots: &mut pass.slots,
                orphans: &mut pass.orphans,
            };
            deliver(store, pass.queue.buckets(), reduced, to, &mut stats);
            if !pass.rebuilt && pass.reduces_during_backward() {
                pass.rebuilt = true;
                if let Err(error) = self.regroup_buckets(pass) {
                    panic!(
                        "burn-zero: rank {} could not agree on its gradient buckets' order: \
                         {error}",
                        store.rank()
                    );
                }
            }
            pass.active = false;
            tracing::debug!(rank = store.rank(), ?stats, "gradients reduced");
            *lock(&self.last) = stats;
        }
        drop(guard);
        store.end_pass();
        store.clear_gather_cache();
    }

    /// Rebuilds the buckets for the order the first backward pass produced gradients in
    /// ([`bucket::regroup`]: members regrouped where a bucket's members may move, every bucket
    /// then in the order the pass completes it; PyTorch DDP rebuilds its buckets after the
    /// first iteration for the same reason). The layout's order, descending parameter key, is
    /// the reverse of the forward's order, which is not the order backward produces gradients
    /// in: burn-autodiff runs backward level by level of node depth, so a parameter that enters
    /// the graph through a shallow op (a LayerNorm's scale and shift, broadcast by a reshape)
    /// gets its gradient only at the very end. With buckets reduced strictly in order, one
    /// such bucket first in line held back every bucket behind it, and the device kept every
    /// gradient of the pass until backward ended.
    ///
    /// Every rank takes rank 0's order (ranks that used different parameters may have seen
    /// different orders): one all-gather, once.
    fn regroup_buckets(&self, pass: &mut Pass<B>) -> Result<(), CommError> {
        let buckets = pass.queue.buckets();
        let keys: Vec<usize> = buckets.iter().flat_map(Bucket::keys).collect();
        let arrived: HashMap<usize, usize> = pass
            .arrivals
            .iter()
            .enumerate()
            .map(|(at, key)| (*key, at))
            .collect();
        // Each member's place in the order, in layout order; `keys.len()`: it never came.
        let never = keys.len();
        let mut places: Vec<usize> = keys
            .iter()
            .map(|key| arrived.get(key).copied().unwrap_or(never))
            .collect();
        let world = &self.store.groups().world;
        if world.world_size() > 1 {
            // Places below 2²⁴ are exact as f32.
            let mine: Vec<f32> = places.iter().map(|&place| place as f32).collect();
            let all = agree::exchange(world.as_ref(), self.store.device(), &mine)?;
            places = all[0].iter().map(|&place| place as usize).collect();
        }
        let position: HashMap<usize, usize> = keys
            .iter()
            .zip(places)
            .map(|(&key, place)| (key, if place == never { usize::MAX } else { place }))
            .collect();
        let rebuilt = bucket::regroup(buckets, |key| position[&key]);
        let layout = |buckets: &[Bucket]| buckets.iter().map(Bucket::keys).collect::<Vec<_>>();
        if layout(&rebuilt) == layout(buckets) {
            return Ok(());
        }
        tracing::debug!(
            rank = self.store.rank(),
            buckets = ?layout(&rebuilt),
            "gradient buckets rebuilt in the order backward produces gradients"
        );
        if let Some(thread) = &mut pass.thread {
            thread.rebuild(rebuilt.clone());
        }
        pass.queue = BucketQueue::new(rebuilt);
        Ok(())
    }

    /// Runs `reduce` with what reducing a bucket on this thread needs.
    fn on_this_thread<T>(&self, reduce: impl FnOnce(&Reduction<'_, B>) -> T) -> T {
        let store = &self.store;
        reduce(&Reduction {
            comm: store.comm().as_ref(),
            replicas: store.groups().replicas.as_deref(),
            device: store.device(),
            predivide: store.config().gradient_predivide_factor,
            memory: store.memory(),
            to_host: &store.host_gradients(),
            counters: store.counters(),
            at_peak: Some(&|| store.read_within_period()),
        })
    }

    /// Reduces every bucket not reduced yet on this thread, in order.
    fn reduce_here(&self, queue: &mut BucketQueue<B>) -> Result<Vec<Reduced<B>>, ReduceError> {
        let memory = self.store.memory();
        self.on_this_thread(|ctx| {
            let mut reduced = Vec::new();
            while !queue.is_done() {
                match queue.reduce_next(ctx) {
                    Ok(bucket) => reduced.push(bucket),
                    Err(error) => {
                        queue.reset(memory);
                        return Err(error);
                    }
                }
            }
            queue.reset(memory);
            Ok(reduced)
        })
    }

    /// Reduces, in order, the buckets of `queue` whose gradients have all come (an eager
    /// pass): the results wait in `eager` for the end of backward, and so does a failure,
    /// after which nothing more is reduced.
    fn reduce_complete(&self, queue: &mut BucketQueue<B>, eager: &mut Eager<B>) {
        if eager.failure.is_none() {
            let started = Instant::now();
            self.on_this_thread(|ctx| {
                while queue.next_is_complete() {
                    match queue.reduce_next(ctx) {
                        Ok(bucket) => eager.reduced.push(bucket),
                        Err(error) => {
                            eager.failure = Some(error);
                            return;
                        }
                    }
                }
            });
            eager.seconds += started.elapsed().as_secs_f64();
        }
        let waiting = queue.pending_bytes();
        eager.peak_incomplete_bytes = eager.peak_incomplete_bytes.max(waiting);
    }
}
