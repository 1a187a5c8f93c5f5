//! The scaling suite: a GPT `small` training step (forward, backward, Adam) under burn-zero at
//! ZeRO stages 0–3 on N = 1, 2, 4 ranks (`LocalGroup` threads, NdArray f32), with the same
//! global batch split across the ranks. The plain-Burn baseline (`Autodiff<NdArray>`, Burn's
//! Adam) is a separate package, `benches/plain-burn`, because this workspace's `distributed`
//! feature does not let `Autodiff<NdArray>` compile.
//!
//! Per configuration:
//! - criterion times rank 0's steps (sample medians of seconds per step);
//! - one step is taken apart: a counting communicator (wrapping the rank's communicator and the
//!   duplicate the gradient-reduction thread uses) records the bytes each collective moves per
//!   rank after forward, backward and the optimizer step;
//! - every rank's memory report (`ZeroState::memory_report`) after backward and after
//!   the step, and the bytes of the gradients `GradientsParams` holds;
//! - a few steps timed phase by phase (forward, backward, optimizer step).
//!
//! Everything goes to `target/bench-reports/scaling.json`; `cargo run -p
//! scaling-report` turns it and the baseline's `plain.json` into `docs/scaling.md` and
//! `docs/scaling.svg`. `SCALING_WORLD_SIZES=1` runs only the given world sizes and
//! `SCALING_REPORT=name` writes `name.json` instead (`benches/plain-burn/overhead.sh` uses both
//! to alternate single-rank runs with the baseline).
//!
//! Every parameter is sharded (`persist_below_numel(0)`); stage 3 runs twice, without the
//! gather cache (`max_live_gathered_bytes(0)`: backward re-gathers, the 3Ψ schedule) and with
//! the default 512 MiB cache (a parameter gathered in forward is reused in backward).

#[path = "common/workload.rs"]
mod workload;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{Adam, AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorMetadata};
use burn_zero::comm::{CommError, Communicator, RankContext, ReduceOp, launch};
use burn_zero::core::ReductionStats;
use burn_zero::{
    MemoryReport, PerTensor, Zero, ZeroConfig, ZeroError, ZeroOptimizer, ZeroState, shard,
};
use criterion::{BenchmarkId, Criterion, SamplingMode};
use serde_json::{Value, json};

use burn_zero_gpt::{Corpus, Gpt};

type Inner = NdArray;
type Train = Autodiff<Zero<Inner>>;

const WORLD_SIZES: [usize; 3] = [1, 2, 4];

/// The world sizes to run: `SCALING_WORLD_SIZES` (e.g. `1` or `1,2`), or all of
/// [`WORLD_SIZES`].
fn world_sizes() -> Vec<usize> {
    match std::env::var("SCALING_WORLD_SIZES") {
        Ok(list) => list
            .split(',')
            .map(|n| {
                n.trim()
                    .parse()
                    .expect("SCALING_WORLD_SIZES: numbers separated by commas")
            })
            .collect(),
        Err(_) => WORLD_SIZES.to_vec(),
    }
}

/// Gradient bucket size. The model's gradients are 7.2 MB: with the default 25 MiB they would
/// form one bucket, held whole until backward ends, and stage 2 would hold as much as stage 1.
const BUCKET_MB: f64 = 1.0;

/// A benchmarked configuration: a stage, and at stage 3 whether the gather cache is on.
#[derive(Debug, Clone, Copy)]
struct Setup {
    stage: u8,
    gather_cache: bool,
}

impl Setup {
    fn name(self) -> String {
        match (self.stage, self.gather_cache) {
            (3, true) => "stage3_cached".into(),
            (stage, _) => format!("stage{stage}"),
        }
    }

    fn config(self) -> ZeroConfig {
        let config = ZeroConfig::new()
            .with_stage(self.stage)
            .with_bucket_size_mb(BUCKET_MB)
            .with_persist_below_numel(0);
        if self.gather_cache {
            config
        } else {
            config.with_max_live_gathered_bytes(0)
        }
    }
}

const SETUPS: [Setup; 5] = [
    Setup {
        stage: 0,
        gather_cache: false,
    },
    Setup {
        stage: 1,
        gather_cache: false,
    },
    Setup {
        stage: 2,
        gather_cache: false,
    },
    Setup {
        stage: 3,
        gather_cache: false,
    },
    Setup {
        stage: 3,
        gather_cache: true,
    },
];

/// Bytes and calls per collective kind, for one rank (its main communicator and duplicates).
#[derive(Debug, Default)]
struct Counters {
    all_gather_bytes: AtomicU64,
    all_gather_calls: AtomicU64,
    reduce_scatter_bytes: AtomicU64,
    reduce_scatter_calls: AtomicU64,
    all_reduce_bytes: AtomicU64,
    all_reduce_calls: AtomicU64,
    broadcast_bytes: AtomicU64,
    broadcast_calls: AtomicU64,
    barrier_calls: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Traffic {
    all_gather_bytes: u64,
    all_gather_calls: u64,
    reduce_scatter_bytes: u64,
    reduce_scatter_calls: u64,
    all_reduce_bytes: u64,
    all_reduce_calls: u64,
    broadcast_bytes: u64,
    broadcast_calls: u64,
    barrier_calls: u64,
}

impl Counters {
    fn snapshot(&self) -> Traffic {
        let read = |counter: &AtomicU64| counter.load(Ordering::SeqCst);
        Traffic {
            all_gather_bytes: read(&self.all_gather_bytes),
            all_gather_calls: read(&self.all_gather_calls),
            reduce_scatter_bytes: read(&self.reduce_scatter_bytes),
            reduce_scatter_calls: read(&self.reduce_scatter_calls),
            all_reduce_bytes: read(&self.all_reduce_bytes),
            all_reduce_calls: read(&self.all_reduce_calls),
            broadcast_bytes: read(&self.broadcast_bytes),
            broadcast_calls: read(&self.broadcast_calls),
            barrier_calls: read(&self.barrier_calls),
        }
    }
}

impl Traffic {
    /// What happened between `earlier` and `self`.
    fn since(self, earlier: Traffic) -> Traffic {
        Traffic {
            all_gather_bytes: self.all_gather_bytes - earlier.all_gather_bytes,
            all_gather_calls: self.all_gather_calls - earlier.all_gather_calls,
            reduce_scatter_bytes: self.reduce_scatter_bytes - earlier.reduce_scatter_bytes,
            reduce_scatter_calls: self.reduce_scatter_calls - earlier.reduce_scatter_calls,
            all_reduce_bytes: self.all_reduce_bytes - earlier.all_reduce_bytes,
            all_reduce_calls: self.all_reduce_calls - earlier.all_reduce_calls,
            broadcast_bytes: self.broadcast_bytes - earlier.broadcast_bytes,
            broadcast_calls: self.broadcast_calls - earlier.broadcast_calls,
            barrier_calls: self.barrier_calls - earlier.barrier_calls,
        }
    }

    fn total_bytes(&self) -> u64 {
        self.all_gather_bytes
            + self.reduce_scatter_bytes
            + self.all_reduce_bytes
            + self.broadcast_bytes
    }

    fn to_json(self) -> Value {
        json!({
            "all_gather_bytes": self.all_gather_bytes,
            "all_gather_calls": self.all_gather_calls,
            "reduce_scatter_bytes": self.reduce_scatter_bytes,
            "reduce_scatter_calls": self.reduce_scatter_calls,
            "all_reduce_bytes": self.all_reduce_bytes,
            "all_reduce_calls": self.all_reduce_calls,
            "broadcast_bytes": self.broadcast_bytes,
            "broadcast_calls": self.broadcast_calls,
            "barrier_calls": self.barrier_calls,
            "total_bytes": self.total_bytes(),
        })
    }
}

/// Bytes of a flat buffer.
fn bytes_of<B: Backend>(tensor: &Tensor<B, 1>) -> u64 {
    (tensor.dims()[0] * tensor.dtype().size()) as u64
}

/// A communicator that counts what passes through it, per rank, in the units of the ZeRO
/// paper's volume analysis: an all-gather moves its output (N blocks), a reduce-scatter its
/// input, an all-reduce twice its buffer (a reduce-scatter then an all-gather), a broadcast its
/// buffer. Duplicates (the gradient-reduction thread's group) count into the same counters.
struct Counting<B: Backend> {
    inner: Arc<dyn Communicator<B>>,
    counters: Arc<Counters>,
}

impl<B: Backend> Communicator<B> for Counting<B> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let bytes = bytes_of(&block) * self.world_size() as u64;
        self.counters
            .all_gather_bytes
            .fetch_add(bytes, Ordering::SeqCst);
        self.counters
            .all_gather_calls
            .fetch_add(1, Ordering::SeqCst);
        self.inner.all_gather(block)
    }

    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.counters
            .reduce_scatter_bytes
            .fetch_add(bytes_of(&input), Ordering::SeqCst);
        self.counters
            .reduce_scatter_calls
            .fetch_add(1, Ordering::SeqCst);
        self.inner.reduce_scatter(input, op)
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.counters
            .all_reduce_bytes
            .fetch_add(2 * bytes_of(&input), Ordering::SeqCst);
        self.counters
            .all_reduce_calls
            .fetch_add(1, Ordering::SeqCst);
        self.inner.all_reduce(input, op)
    }

    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.counters
            .broadcast_bytes
            .fetch_add(bytes_of(&buffer), Ordering::SeqCst);
        self.counters.broadcast_calls.fetch_add(1, Ordering::SeqCst);
        self.inner.broadcast(buffer, root)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.counters.barrier_calls.fetch_add(1, Ordering::SeqCst);
        self.inner.barrier()
    }

    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(Arc::new(Counting {
            inner: self.inner.duplicate()?,
            counters: self.counters.clone(),
        }))
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(Arc::new(Counting {
            inner: self.inner.split(color)?,
            counters: self.counters.clone(),
        }))
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// Adds up the bytes of every parameter's gradient in a `GradientsParams`: a sharded gradient
/// counts its shard, a local one its whole tensor.
struct GradBytes<'a> {
    grads: &'a GradientsParams,
    bytes: usize,
}

impl ModuleVisitor<Train> for GradBytes<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
        if let Some(grad) = self.grads.get::<Zero<Inner>, D>(param.id) {
            let grad = grad.into_primitive().tensor();
            self.bytes += match grad.as_sharded() {
                Some(view) => {
                    let shard = view.param().shard();
                    shard.shape().num_elements() * shard.dtype().size()
                }
                None => grad.shape().num_elements() * grad.dtype().size(),
            };
        }
    }
}

/// What a rank measured on its accounting step.
struct RankFigures {
    /// Collective traffic of the forward pass, the backward pass (gradient reduction included)
    /// and the optimizer step.
    forward: Traffic,
    backward: Traffic,
    optimizer: Traffic,
    after_backward: MemoryReport,
    /// Bytes of the gradients `GradientsParams` holds after backward (full tensors where
    /// gradients are all-reduced, this rank's shard where they are reduce-scattered).
    gradient_bytes: usize,
    after_step: MemoryReport,
    /// The optimizer's own count of fp32 master and state bytes.
    master_bytes: usize,
    state_bytes: usize,
    /// Milliseconds of forward, backward and optimizer step over a few steps.
    phases: workload::Phases,
    /// The module state's account of the accounting step's gradient reduction.
    reduction: ReductionStats,
    /// Every parameter's path and element count, in module order.
    params: Vec<(String, usize)>,
}

/// N ranks kept running between criterion's calls: each call sends every rank a number of
/// steps; rank 0 answers with the time they took.
struct Session {
    commands: Vec<Sender<Option<u64>>>,
    times: Receiver<Duration>,
    ranks: JoinHandle<Vec<RankFigures>>,
}

impl Session {
    /// Starts `world_size` ranks of `setup` on a thread of their own; they take their
    /// accounting step at once, then wait for criterion's calls.
    fn start(setup: Setup, world_size: usize) -> Self {
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..world_size).map(|_| channel::<Option<u64>>()).unzip();
        let (time_tx, times) = channel();
        let ranks = std::thread::spawn(move || run_ranks(setup, world_size, receivers, time_tx));
        Self {
            commands: senders,
            times,
            ranks,
        }
    }

    /// Every rank takes `iters` steps; returns rank 0's time for them.
    fn run(&self, iters: u64) -> Duration {
        for command in &self.commands {
            command.send(Some(iters)).expect("ranks running");
        }
        self.times.recv().expect("rank 0 answers")
    }

    fn finish(self) -> Vec<RankFigures> {
        for command in &self.commands {
            command.send(None).ok();
        }
        self.ranks.join().expect("benchmark ranks")
    }
}

/// The optimizer every rank steps with: `ZeroOptimizer` over Burn's Adam, per tensor.
type RankOptimizer = ZeroOptimizer<Inner, Adam>;

/// What a rank trains on and where it stands in the group, for the helpers of its run.
struct RankPlace<'a> {
    corpus: &'a Corpus,
    rank: usize,
    world_size: usize,
    device: &'a NdArrayDevice,
}

/// The body of a session's thread: shards the same model on `world_size` ranks (each behind
/// a counting communicator), lets each take its accounting step, then the steps its receiver
/// asks for until the session ends, rank 0 sending their times to `time_tx`. Returns every
/// rank's figures.
fn run_ranks(
    setup: Setup,
    world_size: usize,
    receivers: Vec<Receiver<Option<u64>>>,
    time_tx: Sender<Duration>,
) -> Vec<RankFigures> {
    let receivers: Vec<Mutex<Receiver<Option<u64>>>> =
        receivers.into_iter().map(Mutex::new).collect();
    let device = NdArrayDevice::default();
    let corpus = workload::corpus();
    let base: Gpt<Train> = workload::model(&corpus, &device);
    let config = setup.config();
    launch::<Inner, _, _, ZeroError>(world_size, &[device], |ctx| {
        let counters = Arc::new(Counters::default());
        let counting = Arc::new(Counting {
            inner: ctx.comm().clone(),
            counters: counters.clone(),
        });
        let ctx = RankContext::new(*ctx.device(), counting);
        let (rank, device) = (ctx.rank(), ctx.device());
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let place = RankPlace {
            corpus: &corpus,
            rank,
            world_size,
            device,
        };
        // Step 0 creates the fp32 masters and Adam's state.
        model = workload::step(model, &mut optimizer, &corpus, 0, rank, world_size, device);
        let (timed, figures) = account(model, &mut optimizer, &zero, &counters, &place);
        model = timed;

        // Then whatever criterion asks for.
        let commands = receivers[rank].lock().unwrap();
        model = serve(model, &mut optimizer, &place, &commands, &time_tx);
        // The model is dropped last, after the optimizer and the module state, as before the
        // rank's steps were split into helpers.
        drop(commands);
        drop(optimizer);
        drop(zero);
        drop(model);
        Ok(figures)
    })
    .expect("benchmark ranks")
}

/// Step 1 taken apart (traffic per phase, memory after backward and after the step, the
/// gradients' bytes, the reduction's account), then a few steps timed phase by phase.
/// Returns the model after them and the rank's figures.
fn account(
    mut model: Gpt<Train>,
    optimizer: &mut RankOptimizer,
    zero: &ZeroState<Inner>,
    counters: &Counters,
    place: &RankPlace,
) -> (Gpt<Train>, RankFigures) {
    let RankPlace {
        corpus,
        rank,
        world_size,
        device,
    } = *place;
    let start = counters.snapshot();
    let loss = workload::loss(&model, corpus, 1, rank, world_size, device);
    let forward = counters.snapshot();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let backward = counters.snapshot();
    let after_backward = zero.memory_report();
    let reduction = zero.last_reduction();
    let mut held = GradBytes {
        grads: &grads,
        bytes: 0,
    };
    model.visit(&mut held);
    let gradient_bytes = held.bytes;
    model = Optimizer::step(optimizer, workload::LR, model, grads);
    let stepped = counters.snapshot();
    let after_step = zero.memory_report();
    let (master_bytes, state_bytes) = (optimizer.master_bytes(), optimizer.state_bytes());

    // A few steps timed phase by phase.
    let (timed, phases) =
        workload::timed_phases(model, optimizer, corpus, 2, rank, world_size, device);
    let figures = RankFigures {
        forward: forward.since(start),
        backward: backward.since(forward),
        optimizer: stepped.since(backward),
        after_backward,
        gradient_bytes,
        reduction,
        phases,
        after_step,
        master_bytes,
        state_bytes,
        params: zero
            .params()
            .into_iter()
            .map(|info| (info.path, info.shape.num_elements()))
            .collect(),
    };
    (timed, figures)
}

/// Takes the steps criterion asks for through `commands` until the session ends (a `None` or
/// a closed channel); rank 0 sends the time of each call's steps to `time_tx`. Returns the
/// model, so that the rank drops it after its optimizer and module state.
fn serve(
    mut model: Gpt<Train>,
    optimizer: &mut RankOptimizer,
    place: &RankPlace,
    commands: &Receiver<Option<u64>>,
    time_tx: &Sender<Duration>,
) -> Gpt<Train> {
    let RankPlace {
        corpus,
        rank,
        world_size,
        device,
    } = *place;
    let mut next = 2 + workload::PHASE_STEPS;
    while let Ok(Some(iters)) = commands.recv() {
        let started = Instant::now();
        for _ in 0..iters {
            model = workload::step(model, optimizer, corpus, next, rank, world_size, device);
            next += 1;
        }
        if rank == 0 {
            time_tx
                .send(started.elapsed())
                .expect("the bench is listening");
        }
    }
    model
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let corpus = workload::corpus();
    // Parameter sizes, in module order, on an unsharded copy (for Ψ and the padding).
    let numels: Vec<usize> =
        burn_zero_gpt::param_values(&workload::model::<Train>(&corpus, &Default::default()))
            .iter()
            .map(Vec::len)
            .collect();
    let psi: usize = numels.iter().sum();

    let mut runs = Vec::new();
    let mut paths = Value::Null;
    let mut group = criterion.benchmark_group("scaling");
    group
        .sample_size(workload::SAMPLES)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(workload::WARM_UP)
        .measurement_time(workload::MEASUREMENT);
    for setup in SETUPS {
        for world_size in world_sizes() {
            let session = Session::start(setup, world_size);
            let mut calls = Vec::new();
            group.bench_function(BenchmarkId::new(setup.name(), world_size), |b| {
                b.iter_custom(|iters| {
                    let elapsed = session.run(iters);
                    calls.push((iters, elapsed));
                    elapsed
                })
            });
            let figures = session.finish();
            if paths.is_null() {
                paths = json!(figures[0].params);
            }
            let samples = workload::per_step_samples(&calls);
            runs.push(run_json(setup, world_size, &numels, &samples, &figures));
        }
    }
    group.finish();
    criterion.final_summary();

    let (cpu, cpus, memory_bytes, unix_time) = workload::machine();
    let report = json!({
        "backend": "Autodiff<Zero<NdArray>>",
        "engine": "LocalGroup (one thread per rank)",
        "optimizer": "ZeroOptimizer over Burn's Adam (fp32 master shards)",
        "preset": workload::PRESET.name(),
        "parameters": psi,
        "param_numels": numels,
        "params": paths,
        "global_batch": workload::GLOBAL_BATCH,
        "seq_len": workload::SEQ_LEN,
        "bytes_per_element": 4,
        "phase_steps": workload::PHASE_STEPS,
        "persist_below_numel": 0,
        "bucket_size_mb": BUCKET_MB,
        "overlap_comm": ZeroConfig::new().overlap_comm,
        "runs": runs,
        "machine": { "cpu": cpu, "logical_cpus": cpus, "memory_bytes": memory_bytes },
        "unix_time": unix_time,
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-reports");
    workload::write_report(&dir, "SCALING_REPORT", "scaling", &report);
}

/// One configuration's figures as JSON: step-time samples, and per rank the traffic by phase
/// and the memory reports.
fn run_json(
    setup: Setup,
    world_size: usize,
    numels: &[usize],
    samples: &[f64],
    figures: &[RankFigures],
) -> Value {
    let padded: usize = numels
        .iter()
        .map(|n| n.div_ceil(world_size) * world_size)
        .sum();
    let ranks: Vec<Value> = figures
        .iter()
        .map(|f| {
            let total = Traffic {
                all_gather_bytes: f.forward.all_gather_bytes
                    + f.backward.all_gather_bytes
                    + f.optimizer.all_gather_bytes,
                all_gather_calls: f.forward.all_gather_calls
                    + f.backward.all_gather_calls
                    + f.optimizer.all_gather_calls,
                reduce_scatter_bytes: f.forward.reduce_scatter_bytes
                    + f.backward.reduce_scatter_bytes
                    + f.optimizer.reduce_scatter_bytes,
                reduce_scatter_calls: f.forward.reduce_scatter_calls
                    + f.backward.reduce_scatter_calls
                    + f.optimizer.reduce_scatter_calls,
                all_reduce_bytes: f.forward.all_reduce_bytes
                    + f.backward.all_reduce_bytes
                    + f.optimizer.all_reduce_bytes,
                all_reduce_calls: f.forward.all_reduce_calls
                    + f.backward.all_reduce_calls
                    + f.optimizer.all_reduce_calls,
                broadcast_bytes: f.forward.broadcast_bytes
                    + f.backward.broadcast_bytes
                    + f.optimizer.broadcast_bytes,
                broadcast_calls: f.forward.broadcast_calls
                    + f.backward.broadcast_calls
                    + f.optimizer.broadcast_calls,
                barrier_calls: f.forward.barrier_calls
                    + f.backward.barrier_calls
                    + f.optimizer.barrier_calls,
            };
            json!({
                "comm": {
                    "forward": f.forward.to_json(),
                    "backward": f.backward.to_json(),
                    "optimizer": f.optimizer.to_json(),
                    "step": total.to_json(),
                },
                "memory_after_backward": serde_json::to_value(&f.after_backward).expect("json"),
                "memory_after_step": serde_json::to_value(&f.after_step).expect("json"),
                "gradient_bytes_after_backward": f.gradient_bytes,
                "phases_ms": workload::phases_json(&f.phases.median),
                "phases_fastest_ms": workload::phases_json(&f.phases.fastest),
                "reduction": {
                    "collectives": f.reduction.collectives,
                    "bytes": f.reduction.bytes,
                    "seconds": f.reduction.seconds,
                    "exposed_seconds": f.reduction.exposed_seconds,
                    "buckets_reduced_during_backward": f.reduction.overlapped,
                },
                "optimizer_master_bytes": f.master_bytes,
                "optimizer_state_bytes": f.state_bytes,
            })
        })
        .collect();
    json!({
        "name": setup.name(),
        "stage": setup.stage,
        "gather_cache": setup.gather_cache,
        "max_live_gathered_bytes": setup.config().max_live_gathered_bytes,
        "world_size": world_size,
        "padded_parameters": padded,
        "median_step_s": workload::median(samples),
        "samples_step_s": samples,
        "ranks": ranks,
    })
}
