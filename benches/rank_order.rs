//! Reductions in rank order (`RankOrderReduction`: an all-to-all, then each rank sums its
//! pieces in rank order) against the engine's own reduce-scatter and all-reduce, for buckets of
//! 1 to 256 MiB of f32 at 2, 3 and 4 ranks, on `LocalGroup` (Flex, CPU threads).
//!
//! Besides the times, the bench counts the bytes each rank hands its engine for other ranks and
//! receives from them, at the engine's boundary (a counting wrapper under the reduction), and
//! asserts them against the formulas the cost model uses (`docs/rank-order-cost.md`): per rank,
//! a reduce-scatter in rank order sends and receives (N−1)/N of the bucket, as a ring
//! reduce-scatter does; an all-reduce, padded to whole shards, twice that (the all-to-all, then
//! the all-gather of the summed shards). On one CPU the times say what the extra pass costs next
//! to an in-memory engine, not what links cost: the GPU check and the cost model cover those.
//!
//! `cargo bench --bench rank_order` (a filter picks a subset, e.g. `-- '1MiB|16MiB'`). After
//! criterion's output a table is printed and written to `target/bench-reports/rank-order.md`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use burn_zero::comm::{CommError, Communicator, RankOrderReduction, ReduceOp, launch};
use criterion::Criterion;

type B = Flex;

const MIB: usize = 1 << 20;
const SIZES_MIB: [usize; 5] = [1, 4, 16, 64, 256];
const WORLDS: [usize; 3] = [2, 3, 4];

/// Bytes a rank handed its engine for the other ranks, and received from them.
#[derive(Default)]
struct Traffic {
    sent: AtomicU64,
    received: AtomicU64,
}

/// An engine that counts, per rank, the bytes its all-to-alls and all-gathers move between
/// ranks: an all-to-all sends N−1 of its input's N blocks away and receives N−1; an all-gather
/// sends its block to N−1 ranks and receives N−1 blocks.
struct Counting {
    inner: Arc<dyn Communicator<B>>,
    traffic: Arc<Traffic>,
}

impl Counting {
    fn count(&self, sent: u64, received: u64) {
        self.traffic.sent.fetch_add(sent, Ordering::Relaxed);
        self.traffic.received.fetch_add(received, Ordering::Relaxed);
    }
}

fn bytes(tensor: &Tensor<B, 1>) -> u64 {
    (tensor.dims()[0] * tensor.dtype().size()) as u64
}

impl Communicator<B> for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let others = (self.world_size() - 1) as u64;
        self.count(bytes(&block) * others, bytes(&block) * others);
        self.inner.all_gather(block)
    }
    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.inner.reduce_scatter(input, op)
    }
    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.inner.all_reduce(input, op)
    }
    fn all_to_all(&self, input: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let n = self.world_size() as u64;
        let away = bytes(&input) / n * (n - 1);
        self.count(away, away);
        self.inner.all_to_all(input)
    }
    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
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
}

/// The reductions measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Way {
    EngineReduceScatter,
    RankOrderReduceScatter,
    EngineAllReduce,
    RankOrderAllReduce,
}

impl Way {
    const ALL: [Way; 4] = [
        Way::EngineReduceScatter,
        Way::RankOrderReduceScatter,
        Way::EngineAllReduce,
        Way::RankOrderAllReduce,
    ];

    fn name(self) -> &'static str {
        match self {
            Way::EngineReduceScatter => "engine reduce-scatter",
            Way::RankOrderReduceScatter => "rank-order reduce-scatter",
            Way::EngineAllReduce => "engine all-reduce",
            Way::RankOrderAllReduce => "rank-order all-reduce",
        }
    }

    /// Bytes each rank must send (and receive) for a bucket of `bucket` bytes at `n` ranks,
    /// by the formulas; `None` for the engine's own (not counted: inside the engine).
    fn formula(self, bucket: u64, n: u64, elem: u64) -> Option<u64> {
        // An all-reduce pads its buffer to whole shards.
        let padded = bucket.div_ceil(n * elem) * n * elem;
        match self {
            Way::RankOrderReduceScatter => Some(bucket / n * (n - 1)),
            Way::RankOrderAllReduce => Some(2 * (padded / n * (n - 1))),
            Way::EngineReduceScatter | Way::EngineAllReduce => None,
        }
    }
}

type Key = (usize, Way, usize);
/// Seconds per reduction, and the counted bytes per rank (sent, received) of each run.
static SAMPLES: Mutex<BTreeMap<Key, Vec<f64>>> = Mutex::new(BTreeMap::new());
static TRAFFIC: Mutex<BTreeMap<Key, (u64, u64)>> = Mutex::new(BTreeMap::new());

/// Elements of a bucket of `mib` MiB of f32 at `world` ranks: whole shards, as the gradient
/// buckets are laid out (rank rows of one length).
fn numel(world: usize, mib: usize) -> usize {
    (mib * MIB / 4).next_multiple_of(world)
}

/// `iters` reductions of `way` on `world` ranks of `mib` MiB each; the slowest rank's time.
fn run(way: Way, world: usize, mib: usize, iters: u64) -> Duration {
    let numel = numel(world, mib);
    let per_rank = launch::<B, _, _, CommError>(world, &[Default::default()], |ctx| {
        let traffic = Arc::new(Traffic::default());
        let counting: Arc<dyn Communicator<B>> = Arc::new(Counting {
            inner: ctx.engine().clone(),
            traffic: traffic.clone(),
        });
        let comm: Arc<dyn Communicator<B>> = match way {
            Way::RankOrderReduceScatter | Way::RankOrderAllReduce => {
                Arc::new(RankOrderReduction::new(counting))
            }
            Way::EngineReduceScatter | Way::EngineAllReduce => counting,
        };
        let values: Vec<f32> = (0..numel)
            .map(|i| ((i * 31 + ctx.rank() * 7) % 1009) as f32 / 97.0 - 5.0)
            .collect();
        let input = Tensor::<B, 1>::from_data(TensorData::new(values, [numel]), ctx.device());
        let reduce = |input: Tensor<B, 1>| match way {
            Way::EngineReduceScatter | Way::RankOrderReduceScatter => {
                comm.reduce_scatter(input, ReduceOp::Sum)
            }
            Way::EngineAllReduce | Way::RankOrderAllReduce => comm.all_reduce(input, ReduceOp::Sum),
        };
        // One untimed call fills the buffer pools; its traffic is the one checked.
        reduce(input.clone())?;
        let counted = (
            traffic.sent.load(Ordering::Relaxed),
            traffic.received.load(Ordering::Relaxed),
        );
        comm.barrier()?;
        let started = Instant::now();
        for _ in 0..iters {
            reduce(input.clone())?;
        }
        comm.barrier()?;
        Ok((started.elapsed(), counted))
    })
    .expect("the ranks reduce");
    let counted = per_rank[0].1;
    let formula = way.formula((numel * 4) as u64, world as u64, 4);
    if let Some(expected) = formula {
        for (rank, (_, got)) in per_rank.iter().enumerate() {
            assert_eq!(
                *got,
                (expected, expected),
                "{} of {mib} MiB at {world} ranks, rank {rank}: bytes sent and received",
                way.name()
            );
        }
    }
    TRAFFIC.lock().unwrap().insert((world, way, mib), counted);
    let slowest = per_rank.iter().map(|(t, _)| *t).max().unwrap_or_default();
    SAMPLES
        .lock()
        .unwrap()
        .entry((world, way, mib))
        .or_default()
        .push(slowest.as_secs_f64() / iters.max(1) as f64);
    slowest
}

fn report() {
    let samples = SAMPLES.lock().unwrap();
    let traffic = TRAFFIC.lock().unwrap();
    let mut table = String::from(
        "| ranks | bucket | reduction | median time | vs the engine's | bytes sent per rank | \
         formula |\n|---|---|---|---|---|---|---|\n",
    );
    let median = |values: &[f64]| {
        let mut values = values.to_vec();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    for (&(world, way, mib), values) in samples.iter() {
        let time = median(values);
        let engine = match way {
            Way::RankOrderReduceScatter => Some(Way::EngineReduceScatter),
            Way::RankOrderAllReduce => Some(Way::EngineAllReduce),
            _ => None,
        }
        .and_then(|base| samples.get(&(world, base, mib)))
        .map(|base| time / median(base));
        let sent = traffic.get(&(world, way, mib)).map(|t| t.0);
        let formula = way.formula((numel(world, mib) * 4) as u64, world as u64, 4);
        table += &format!(
            "| {world} | {mib} MiB | {} | {:.2} ms | {} | {} | {} |\n",
            way.name(),
            time * 1e3,
            engine.map_or("-".into(), |r| format!("{r:.2}×")),
            match (way, sent) {
                (Way::EngineReduceScatter | Way::EngineAllReduce, _) =>
                    "(inside the engine)".into(),
                (_, Some(sent)) => format!("{sent}"),
                (_, None) => "-".into(),
            },
            formula.map_or("-".into(), |f| format!("{f}")),
        );
    }
    println!("\n{table}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-reports");
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join("rank-order.md"), table);
    }
}

fn main() {
    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(2));
    for world in WORLDS {
        for mib in SIZES_MIB {
            for way in Way::ALL {
                let label = format!("world{world}/{mib}MiB/{}", way.name());
                c.bench_function(&label, |b| {
                    b.iter_custom(|iters| run(way, world, mib, iters));
                });
            }
        }
    }
    c.final_summary();
    report();
}
