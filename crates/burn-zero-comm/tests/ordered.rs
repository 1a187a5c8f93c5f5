//! The ordered issuing layer: when a training thread and a hook thread race to submit
//! collectives, and they race differently on different ranks, the engine still sees one
//! order, the same on every rank, from one thread.
//!
//! The race is forced, not hoped for: on rank 0 the hook thread fills its reservation only
//! after the training thread has submitted its next gather; on rank 1 the training thread
//! submits its next gather only after the hook thread has submitted its reduction. Without
//! the layer (the hook thread on a duplicate group) the engine sees two different orders,
//! which is the NCCL deadlock; the control run below shows it.

use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, ThreadId};
use std::time::Duration;

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::{StreamId, Tensor};
use burn_zero_comm::{
    CollectiveKind, CommError, Communicator, Completion, DataOp, Issued, LaunchOptions,
    OrderedComm, ReduceOp, launch_with,
};
use burn_zero_testing::recording::{CallLog, RecordingComm};

type B = NdArray;

const ROUNDS: usize = 6;

/// How many gathers the training thread has submitted (not necessarily issued).
#[derive(Default)]
struct Submitted {
    gathers: Mutex<usize>,
    changed: Condvar,
}

impl Submitted {
    fn bump(&self) {
        *self.gathers.lock().unwrap() += 1;
        self.changed.notify_all();
    }
    fn wait_for(&self, gathers: usize) {
        let mut count = self.gathers.lock().unwrap();
        while *count < gathers {
            count = self.changed.wait(count).unwrap();
        }
    }
}

/// Waits until the engine has seen `call`.
fn wait_for_call(log: &Mutex<Vec<(String, ThreadId)>>, call: &str) {
    while !log.lock().unwrap().iter().any(|(seen, _)| seen == call) {
        thread::sleep(Duration::from_millis(1));
    }
}

/// What the engine saw on one rank: the calls in order, the threads that issued them, and
/// the submitting threads.
struct Seen {
    calls: Vec<String>,
    issuers: Vec<ThreadId>,
    training: ThreadId,
    hook: ThreadId,
}

/// Runs the raced program on two ranks: `ordered` through [`OrderedComm`], otherwise the
/// hook thread on a duplicate group (the design the layer replaces).
fn run(ordered: bool) -> Vec<Seen> {
    let options = LaunchOptions::with_timeout(Duration::from_secs(20));
    launch_with::<B, _, _, _>(2, &[Default::default()], &options, |ctx| {
        let rank = ctx.rank();
        let device = *ctx.device();
        let log = Arc::new(Mutex::new(Vec::new()));
        let engine: Arc<dyn Communicator<B>> =
            Arc::new(RecordingComm::new(ctx.engine().clone(), log.clone()));
        let order = OrderedComm::new(engine.clone());
        let side = if ordered {
            None
        } else {
            Some(engine.duplicate()?)
        };
        let submitted = Arc::new(Submitted::default());
        let (to_hook, hook_inbox) = channel();

        let hook = {
            let submitted = submitted.clone();
            let log = log.clone();
            thread::spawn(move || -> Result<ThreadId, CommError> {
                for (round, reservation) in hook_inbox {
                    if rank == 0 && round + 1 < ROUNDS {
                        // Rank 0's hook is slow: the training thread gets to its next gather
                        // first (submitted it, with the layer, where it waits for this
                        // reservation; issued it, without).
                        if ordered {
                            submitted.wait_for(round + 2);
                        } else {
                            wait_for_call(&log, &format!("all_gather {}", round + 2));
                        }
                    }
                    let input = Tensor::<B, 1>::ones([2 * (round + 1)], &device)
                        .mul_scalar((rank + 1) as f32);
                    let sum = match (&reservation, &side) {
                        (Some(reservation), _) => {
                            Communicator::<B>::all_reduce(reservation, input, ReduceOp::Sum)?
                        }
                        (None, Some(side)) => side.all_reduce(input, ReduceOp::Sum)?,
                        (None, None) => unreachable!(),
                    };
                    drop(reservation);
                    let sum: Vec<f32> = sum.into_data().to_vec().unwrap();
                    assert_eq!(sum, vec![3.0; 2 * (round + 1)]);
                }
                Ok(thread::current().id())
            })
        };

        for round in 0..ROUNDS {
            if rank == 1 && round > 0 {
                // Rank 1's training thread is slow: the engine sees the last round's
                // reduction first.
                wait_for_call(&log, &format!("all_reduce {}", 2 * round));
            }
            let block = Tensor::<B, 1>::ones([round + 1], &device).mul_scalar(rank as f32);
            submitted.bump();
            let gathered: Vec<f32> = if ordered {
                order.all_gather(block)?
            } else {
                engine.all_gather(block)?
            }
            .into_data()
            .to_vec()
            .unwrap();
            let mut expected = vec![0.0; round + 1];
            expected.extend(vec![1.0; round + 1]);
            assert_eq!(gathered, expected);
            // The hook that completes a bucket takes its position here, on this thread.
            let reservation = ordered.then(|| order.reserve());
            to_hook.send((round, reservation)).unwrap();
        }
        drop(to_hook);
        let hook = hook.join().unwrap()?;
        drop(order);
        let log = log.lock().unwrap().clone();
        Ok::<_, CommError>(Seen {
            calls: log.iter().map(|(call, _)| call.clone()).collect(),
            issuers: log.iter().map(|(_, thread)| *thread).collect(),
            training: thread::current().id(),
            hook,
        })
    })
    .unwrap()
}

/// The order the program means: gather of round `r`, then the reduction its hook completed.
fn program_order() -> Vec<String> {
    (0..ROUNDS)
        .flat_map(|round| {
            [
                format!("all_gather {}", round + 1),
                format!("all_reduce {}", 2 * (round + 1)),
            ]
        })
        .collect()
}

#[test]
fn every_rank_issues_the_program_order_from_one_thread_whatever_the_race() {
    let seen = run(true);
    for (rank, rank_seen) in seen.iter().enumerate() {
        assert_eq!(rank_seen.calls, program_order(), "rank {rank}");
        let issuer = rank_seen.issuers[0];
        assert!(
            rank_seen.issuers.iter().all(|&t| t == issuer),
            "rank {rank}: collectives came from more than one thread"
        );
        assert_ne!(issuer, rank_seen.training, "rank {rank}");
        assert_ne!(issuer, rank_seen.hook, "rank {rank}");
    }
}

#[test]
fn without_the_layer_the_same_race_gives_ranks_different_orders() {
    // The control: it shows the race above is real. Over NCCL these two orders deadlock.
    let seen = run(false);
    assert_ne!(seen[0].calls, seen[1].calls);
    assert_eq!(seen[1].calls, program_order());
}

#[test]
fn an_unused_reservation_is_skipped() {
    launch_with::<B, _, _, _>(2, &[Default::default()], &LaunchOptions::default(), |ctx| {
        let order = OrderedComm::new(ctx.engine().clone());
        drop(order.reserve());
        let total = order.all_reduce(Tensor::<B, 1>::ones([3], ctx.device()), ReduceOp::Sum)?;
        assert_eq!(total.into_data().to_vec::<f32>().unwrap(), vec![2.0; 3]);
        Ok::<_, CommError>(())
    })
    .unwrap();
}

#[test]
fn a_failure_in_one_rank_reaches_the_others_through_the_layer() {
    let result = launch_with::<B, _, _, _>(
        2,
        &[Default::default()],
        &LaunchOptions::with_timeout(Duration::from_secs(20)),
        |ctx| {
            let order = OrderedComm::new(ctx.engine().clone());
            if ctx.rank() == 1 {
                return Err(CommError::InvalidGroup("rank 1 gives up".into()));
            }
            order.barrier()
        },
    );
    let error = result.unwrap_err().to_string();
    assert!(error.contains("rank 1 gives up"), "{error}");
}

/// Bits of a flat tensor, for comparisons that must be exact.
fn bits(tensor: Tensor<B, 1>) -> Vec<u32> {
    let values = tensor.into_data().to_vec::<f32>().unwrap();
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_group_of_one_rank_answers_its_collectives_in_place() {
    let log: CallLog = Arc::default();
    let engine_log = log.clone();
    launch_with::<B, _, _, _>(
        1,
        &[Default::default()],
        &LaunchOptions::default(),
        move |ctx| {
            let recorded = RecordingComm::new(ctx.engine().clone(), engine_log.clone());
            let order = OrderedComm::new(Arc::new(recorded));
            let input =
                Tensor::<B, 1>::from_floats([1.5, -0.0, 3.25, f32::MIN_POSITIVE], ctx.device());
            let expected = bits(input.clone());
            assert_eq!(bits(order.all_gather(input.clone())?), expected);
            assert_eq!(
                bits(order.reduce_scatter(input.clone(), ReduceOp::Mean)?),
                expected
            );
            assert_eq!(
                bits(order.all_reduce(input.clone(), ReduceOp::Max)?),
                expected
            );
            assert_eq!(bits(order.broadcast(input.clone(), 0)?), expected);
            assert_eq!(
                bits(order.reserve().all_gather_later(input.clone())?.wait()?),
                expected
            );
            order.barrier()?;
            let error = order.broadcast(input.clone(), 1).unwrap_err();
            assert!(
                matches!(error, CommError::InvalidRoot { root: 1, .. }),
                "{error}"
            );
            // Work handed to a position runs on the calling thread, its collective in place.
            let caller = thread::current().id();
            let (ran_on, reduced) =
                order
                    .reserve()
                    .run(&[burn_zero_comm::CollectiveKind::AllReduce], move |comm| {
                        Ok((
                            thread::current().id(),
                            comm.all_reduce(input, ReduceOp::Sum)?,
                        ))
                    })?;
            assert_eq!(ran_on, caller);
            assert_eq!(bits(reduced), expected);
            let counts = order.counters().snapshot();
            assert_eq!(counts.all_gathers, 2);
            assert_eq!(counts.reduce_scatters, 1);
            assert_eq!(counts.all_reduces, 2);
            assert_eq!(counts.other_collectives, 2);
            assert_eq!(counts.in_place, 7);
            assert_eq!(counts.syncs, 0);
            // Positions answered in place do not keep the issuing thread from serving a later
            // one, started only now: a duplicate goes to the engine.
            for _ in 0..1000 {
                order.all_reduce(Tensor::<B, 1>::ones([1], ctx.device()), ReduceOp::Sum)?;
            }
            let duplicate = order.reserve().duplicate()?;
            assert_eq!(duplicate.world_size(), 1);
            Ok::<_, CommError>(())
        },
    )
    .unwrap();
    // No collective reached the engine (the recording group does not log duplicates).
    let calls: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .map(|(call, _)| call.clone())
        .collect();
    assert!(calls.is_empty(), "{calls:?}");
}

#[test]
fn a_position_on_a_one_rank_group_keeps_its_place_beside_a_larger_group() {
    launch_with::<B, _, _, _>(2, &[Default::default()], &LaunchOptions::default(), |ctx| {
        let world = OrderedComm::new(ctx.engine().clone());
        // Each rank alone in its group: the hybrid layout with shard groups of one rank.
        let alone = world.split_ordered(ctx.rank())?;
        assert_eq!(alone.world_size(), 1);
        let mut totals = Vec::new();
        for round in 0..20 {
            let value = (ctx.rank() * 100 + round) as f32;
            let input = Tensor::<B, 1>::from_floats([value], ctx.device());
            let position = alone.reserve();
            let across = position.on_group(&world)?;
            let engine = across.engine().clone();
            // The position spans two groups: the work runs on the issuing thread (which
            // calls the world's engine itself), the one-rank reduction in place.
            let total = position.run(&[], move |shard| {
                let own = shard.reduce_scatter(input, ReduceOp::Sum)?;
                engine.all_reduce(own, ReduceOp::Sum)
            })?;
            drop(across);
            totals.push(total.into_data().to_vec::<f32>().unwrap()[0]);
            // Unused one-rank positions between them.
            drop(alone.reserve());
        }
        let expected: Vec<f32> = (0..20).map(|round| (100 + 2 * round) as f32).collect();
        assert_eq!(totals, expected);
        Ok::<_, CommError>(())
    })
    .unwrap();
}

/// An engine that says it orders its inputs on the device and waits for the device once per
/// collective, as the NCCL group does: the layer hands it tensors without a synchronisation,
/// and the waits it counts into the rank's counters are the rank's.
struct OrderingOnDevice {
    inner: Arc<dyn Communicator<B>>,
    counters: Mutex<Option<Arc<burn_zero_comm::RankCounters>>>,
}

impl OrderingOnDevice {
    fn waited(&self) {
        if let Some(counters) = self.counters.lock().unwrap().as_ref() {
            counters.engine_wait();
        }
    }
}

impl Communicator<B> for OrderingOnDevice {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.waited();
        self.inner.all_gather(block)
    }
    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.waited();
        self.inner.reduce_scatter(input, op)
    }
    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.waited();
        self.inner.all_reduce(input, op)
    }
    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.waited();
        self.inner.broadcast(buffer, root)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.inner.duplicate()
    }
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.inner.split(color)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }
    fn orders_inputs_on_device(&self) -> bool {
        true
    }
    fn count_into(&self, counters: &Arc<burn_zero_comm::RankCounters>) {
        *self.counters.lock().unwrap() = Some(counters.clone());
    }
}

#[test]
fn an_engine_that_orders_inputs_on_the_device_is_handed_them_without_a_synchronisation() {
    let counts = launch_with::<B, _, _, _>(
        2,
        &[Default::default(); 2],
        &LaunchOptions::default(),
        |ctx| {
            let engine = Arc::new(OrderingOnDevice {
                inner: ctx.engine().clone(),
                counters: Mutex::new(None),
            });
            let ordered = OrderedComm::new(engine);
            let device = Default::default();
            let block = Tensor::<B, 1>::ones([4], &device);
            ordered.all_gather(block.clone())?;
            ordered.all_reduce(block.clone(), ReduceOp::Sum)?;
            ordered.reserve().all_gather_later(block)?.wait()?;
            Ok::<_, CommError>(ordered.counters().snapshot())
        },
    )
    .unwrap();
    for counts in counts {
        assert_eq!(
            (counts.all_gathers, counts.all_reduces),
            (2, 1),
            "{counts:?}"
        );
        assert_eq!(
            counts.syncs, 0,
            "no synchronisation before the collectives: {counts:?}"
        );
        assert_eq!(counts.engine_waits, 3, "the engine's own waits: {counts:?}");
    }
    // The control: the same collectives on the engine itself are each synchronised first.
    let counts = launch_with::<B, _, _, _>(
        2,
        &[Default::default(); 2],
        &LaunchOptions::default(),
        |ctx| {
            let ordered = OrderedComm::new(ctx.engine().clone());
            let block = Tensor::<B, 1>::ones([4], &Default::default());
            ordered.all_gather(block.clone())?;
            ordered.all_reduce(block, ReduceOp::Sum)?;
            Ok::<_, CommError>(ordered.counters().snapshot())
        },
    )
    .unwrap();
    for counts in counts {
        assert_eq!((counts.syncs, counts.engine_waits), (2, 0), "{counts:?}");
    }
}

/// Whether the device has finished a rank's gathers: closed until the test opens it.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
    /// The thread that waited for a gather's completion.
    waiter: Mutex<Option<ThreadId>>,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

/// A gather's completion behind a [`Gate`], as an NCCL collective's event.
struct Gated(Arc<Gate>);

impl Completion for Gated {
    fn wait(self: Box<Self>) -> Result<(), CommError> {
        *self.0.waiter.lock().unwrap() = Some(thread::current().id());
        let mut open = self.0.open.lock().unwrap();
        while !*open {
            open = self.0.opened.wait(open).unwrap();
        }
        Ok(())
    }

    fn is_done(&self) -> Option<bool> {
        Some(*self.0.open.lock().unwrap())
    }
}

/// An engine whose gathers complete on a device later than they are issued: `issue` returns
/// at once with a completion that only the gate ends.
struct Deferring {
    inner: Arc<dyn Communicator<B>>,
    gate: Arc<Gate>,
}

impl Communicator<B> for Deferring {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.issue(DataOp::AllGather, block)?.wait()
    }
    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.inner.reduce_scatter(input, op)
    }
    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.inner.all_reduce(input, op)
    }
    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.inner.broadcast(buffer, root)
    }
    fn issue(&self, op: DataOp, input: Tensor<B, 1>) -> Result<Issued<B>, CommError> {
        let result = op.run(self.inner.as_ref(), input)?;
        Ok(match op {
            DataOp::AllGather => {
                Issued::pending(Box::new(Gated(self.gate.clone())), move || result)
            }
            _ => Issued::ready(result),
        })
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.inner.duplicate()
    }
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.inner.split(color)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }
}

#[test]
fn the_thread_that_reads_a_collective_waits_for_it_and_the_issuing_thread_goes_on() {
    let gates: Vec<Arc<Gate>> = (0..2).map(|_| Arc::default()).collect();
    let given = gates.clone();
    launch_with::<B, _, _, _>(
        2,
        &[Default::default(); 2],
        &LaunchOptions::default(),
        move |ctx| {
            let gate = given[ctx.rank()].clone();
            let engine = Arc::new(Deferring {
                inner: ctx.engine().clone(),
                gate: gate.clone(),
            });
            let ordered = OrderedComm::new(engine);
            let device = Default::default();
            let mine = Tensor::<B, 1>::from_floats([ctx.rank() as f32; 2], &device);
            // Position 0: a gather ahead of use, still running on the "device".
            let prefetched = ordered.reserve().all_gather_later(mine)?;
            // Position 1, from another thread: the issuing thread must get to it although
            // position 0 has not completed.
            let (sent, answer) = channel();
            let other = ordered.clone();
            thread::spawn(move || {
                let ones = Tensor::<B, 1>::ones([3], &Default::default());
                let _ = sent.send(other.all_reduce(ones, ReduceOp::Sum));
            });
            let total = answer
                .recv_timeout(Duration::from_secs(30))
                .expect("the issuing thread waited for an earlier collective's completion")?;
            assert_eq!(total.into_data().to_vec::<f32>().unwrap(), vec![2.0; 3]);
            assert_eq!(*gate.waiter.lock().unwrap(), None, "nobody waited yet");

            gate.open();
            let gathered = prefetched.wait()?;
            assert_eq!(
                gathered.into_data().to_vec::<f32>().unwrap(),
                vec![0.0, 0.0, 1.0, 1.0]
            );
            assert_eq!(
                *gate.waiter.lock().unwrap(),
                Some(thread::current().id()),
                "the thread that reads the gather waits for its completion"
            );
            Ok::<_, CommError>(())
        },
    )
    .unwrap();
}

/// A gather whose block is made by `all_gather_later_from` (an upload from host memory) has it
/// made on the issuing thread, right before the gather (and finished there for an engine that
/// does not order its inputs on the device); on a group of one rank, here.
#[test]
fn a_block_to_gather_later_is_made_on_the_issuing_thread() {
    let made_on = launch_with::<B, _, _, _>(
        2,
        &[Default::default(); 2],
        &LaunchOptions::default(),
        |ctx| {
            let ordered = OrderedComm::new(ctx.engine().clone());
            let rank = ctx.rank() as f32;
            let (sent, made_on) = channel();
            let pending = ordered.reserve().all_gather_later_from(move || {
                let _ = sent.send(thread::current().name().map(str::to_string));
                Tensor::<B, 1>::from_floats([rank; 2], &Default::default())
            })?;
            let gathered = pending.wait()?.into_data().to_vec::<f32>().unwrap();
            assert_eq!(gathered, vec![0.0, 0.0, 1.0, 1.0]);
            // LocalGroup's other ranks read the block from their threads: it was finished
            // on the issuing thread first, and that is counted.
            assert_eq!(ordered.counters().snapshot().syncs, 1);
            Ok::<_, CommError>(made_on.recv().unwrap())
        },
    )
    .unwrap();
    for (rank, name) in made_on.into_iter().enumerate() {
        assert_eq!(
            name.as_deref(),
            Some(format!("burn-zero-issue-{rank}").as_str())
        );
    }
    let alone =
        launch_with::<B, _, _, _>(1, &[Default::default()], &LaunchOptions::default(), |ctx| {
            let ordered = OrderedComm::new(ctx.engine().clone());
            let here = thread::current().id();
            let pending = ordered.reserve().all_gather_later_from(move || {
                assert_eq!(thread::current().id(), here, "made in place");
                Tensor::<B, 1>::ones([3], &Default::default())
            })?;
            Ok::<_, CommError>(pending.wait()?.into_data().to_vec::<f32>().unwrap())
        })
        .unwrap();
    assert_eq!(alone, vec![vec![1.0; 3]]);
}

/// Work run with `run_deferred` is kept aside while its collective runs: the issuing thread
/// goes on to the next position meanwhile, and finishes the work itself once the device says
/// the collective is done.
#[test]
fn deferred_work_finishes_on_the_issuing_thread_once_its_collective_is_done() {
    launch_with::<B, _, _, _>(
        2,
        &[Default::default(); 2],
        &LaunchOptions::default(),
        |ctx| {
            let gate: Arc<Gate> = Arc::default();
            let engine = Arc::new(Deferring {
                inner: ctx.engine().clone(),
                gate: gate.clone(),
            });
            let ordered = OrderedComm::new(engine);
            let mine = Tensor::<B, 1>::from_floats([ctx.rank() as f32; 2], &Default::default());
            let deferred = ordered.reserve().run_deferred(
                &[CollectiveKind::AllGather],
                move |comm| Ok::<_, CommError>((comm.issue(DataOp::AllGather, mine)?, 10.0)),
                |gathered, add| {
                    let values = gathered
                        .add_scalar(add)
                        .into_data()
                        .to_vec::<f32>()
                        .unwrap();
                    Ok((values, thread::current().name().map(str::to_string)))
                },
            )?;
            // Position 1, from another thread: issued while position 0's collective runs.
            let (sent, answer) = channel();
            let other = ordered.clone();
            thread::spawn(move || {
                let ones = Tensor::<B, 1>::ones([3], &Default::default());
                let _ = sent.send(other.all_reduce(ones, ReduceOp::Sum));
            });
            let total = answer.recv_timeout(Duration::from_secs(30));
            assert!(
                deferred.try_take().is_none(),
                "finished before its collective"
            );
            gate.open();
            let total = total.expect("the issuing thread waited for the kept collective")?;
            assert_eq!(total.into_data().to_vec::<f32>().unwrap(), vec![2.0; 3]);
            let (values, finished_on) = deferred.wait()?;
            assert_eq!(values, vec![10.0, 10.0, 11.0, 11.0]);
            let issuing = format!("burn-zero-issue-{}", ctx.rank());
            assert_eq!(finished_on.as_deref(), Some(issuing.as_str()));
            let counts = ordered.counters().snapshot();
            assert_eq!(
                (counts.all_gathers, counts.all_reduces),
                (1, 1),
                "{counts:?}"
            );
            Ok::<_, CommError>(())
        },
    )
    .unwrap();
}

/// On wgpu (a queue and a memory pool per thread) every buffer a position makes for the
/// thread that took it — a collective's output, what deferred work makes of it — is allocated
/// in that thread's queue, though the issuing thread makes it: dropped by the reader, its
/// memory is reused after the reader's kernels. A block made to be gathered later stays the
/// issuing thread's.
#[test]
fn a_position_allocates_what_it_hands_over_in_the_readers_queue() {
    use burn::backend::wgpu::{CubeBackend, WgpuRuntime};
    use burn_fusion::Fusion;
    type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
    let test = "a_position_allocates_what_it_hands_over_in_the_readers_queue";
    if !burn_zero_testing::skip::wgpu_adapter(test) {
        return;
    }
    if !burn_zero_kernels::ThreadQueue::current::<Plain>().is_on_device() {
        println!(
            "SKIPPED: {test}: burn-zero-kernels built without its `wgpu` feature \
             (cargo test --workspace --features wgpu)"
        );
        return;
    }
    allocates_in_the_readers_queue::<Plain>("plain", |tensor| {
        tensor.into_primitive().tensor().handle.stream
    });
    // Under Burn's fusion layer the issuing thread's operations join the reader's fusion
    // stream, whose operations run on the reader's cubecl stream.
    allocates_in_the_readers_queue::<Fusion<Plain>>("fused", |tensor| {
        let fused = tensor.into_primitive().tensor();
        let client = fused.client.clone();
        client.resolve_tensor_float::<Plain>(fused).handle.stream
    });
}

/// Two wgpu ranks check, on backend `W`, where each buffer a position hands its reader was
/// allocated; `stream` resolves a tensor on the calling thread and names its buffer's stream.
fn allocates_in_the_readers_queue<W>(backend: &str, stream: fn(Tensor<W, 1>) -> StreamId)
where
    W: Backend<Device = burn::backend::wgpu::WgpuDevice>,
{
    let device = burn::backend::wgpu::WgpuDevice::default();
    launch_with::<W, _, _, _>(
        2,
        &[device.clone(), device],
        &LaunchOptions::default(),
        |ctx| {
            let device = ctx.device().clone();
            let here = stream(Tensor::<W, 1>::zeros([1], &device));
            let ordered = OrderedComm::new(ctx.engine().clone());
            let mine = || Tensor::<W, 1>::from_floats([ctx.rank() as f32; 2], &device);
            let gathered = ordered.all_gather(mine())?;
            assert_eq!(stream(gathered), here, "{backend}: an all-gather's output");
            let reduced = ordered.reserve().all_gather_later(mine())?.wait()?;
            assert_eq!(stream(reduced), here, "{backend}: a gather issued ahead");
            let (sent, made_on) = channel();
            let (rank, uploading) = (ctx.rank() as f32, device.clone());
            let later = ordered.reserve().all_gather_later_from(move || {
                let block = Tensor::<W, 1>::from_floats([rank; 2], &uploading);
                let _ = sent.send(stream(block.clone()));
                block
            })?;
            let later = later.wait()?;
            assert_eq!(
                stream(later),
                here,
                "{backend}: a gather of an uploaded block"
            );
            let uploaded = made_on.recv().unwrap();
            assert_ne!(uploaded, here, "{backend}: the uploaded block itself");
            let input = mine();
            let deferred = ordered.reserve().run_deferred(
                &[CollectiveKind::AllGather],
                move |comm| Ok::<_, CommError>((comm.issue(DataOp::AllGather, input)?, ())),
                |gathered, ()| Ok::<_, CommError>(gathered.add_scalar(1.0)),
            )?;
            let deferred = deferred.wait()?;
            assert_eq!(stream(deferred), here, "{backend}: deferred work's result");
            Ok::<_, CommError>(())
        },
    )
    .unwrap();
}
