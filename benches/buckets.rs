//! Gradient-reduction time against bucket size: a ~50M-parameter MLP sharded over 2 CPU ranks
//! (`LocalGroup`, NdArray), stage 3, buckets of 0.5, 5, 25 and 100 MiB (and one collective per
//! parameter), with the reduction overlapped with backward on a communication thread and
//! without. Criterion times rank 0's backward pass (which ends when every gradient is reduced);
//! the table adds the module state's own figures — time spent reducing, the part of it backward did
//! not hide, buckets reduced before backward ended — and goes to stdout and
//! `target/bench-reports/buckets.md`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::Tensor;
use burn_zero::comm::launch;
use burn_zero::core::ReductionStats;
use burn_zero::{PerTensor, Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard};
mod common;

use common::{Deep, WIDTH};

use criterion::{BenchmarkId, Criterion};

type Train = Autodiff<Zero<NdArray>>;

const RANKS: usize = 2;
const SIZES: [f64; 5] = [0.0, 0.5, 5.0, 25.0, 100.0];

/// Reduction statistics and backward time of every measured backward, by (bucket size,
/// overlap).
type Samples = Vec<(ReductionStats, Duration)>;
static STATS: Mutex<BTreeMap<(u64, bool), Samples>> = Mutex::new(BTreeMap::new());

/// Runs `iters` backward passes on every rank; returns rank 0's total backward time.
fn run(bucket_mb: f64, overlap: bool, iters: u64) -> Duration {
    let config = ZeroConfig::new()
        .with_bucket_size_mb(bucket_mb)
        .with_overlap_comm(overlap)
        .with_persist_below_numel(0);
    let per_rank = launch::<NdArray, _, _, ZeroError>(RANKS, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(Deep::<Train>::new(ctx.device()), &ctx, &config)?;
        // A backward pass uses up the parameters' gradient marks and the optimizer's step
        // renews them: without a step between two backward passes, the second reduces nothing.
        // The step (Adam, learning rate 0: the model stays as it is) is outside the timing.
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut stats = Vec::new();
        // Each sample shards a new model, whose first backward fills the buckets' buffer pools
        // with fresh (page-faulting) memory; a training job pays that once, in its first step.
        // The steady state is what is timed.
        let x = Tensor::<Train, 2>::ones([1, WIDTH], ctx.device());
        let grads = GradientsParams::from_grads(model.forward(x).mean().backward(), &model);
        model = optimizer.step(0.0, model, grads);
        for _ in 0..iters {
            let x = Tensor::<Train, 2>::ones([1, WIDTH], ctx.device());
            let loss = model.forward(x).mean();
            let started = Instant::now();
            let grads = loss.backward();
            let backward = started.elapsed();
            let grads = GradientsParams::from_grads(grads, &model);
            stats.push((zero.last_reduction(), backward));
            model = optimizer.step(0.0, model, grads);
        }
        Ok(stats)
    })
    .expect("benchmark ranks");
    let stats = per_rank.into_iter().next().unwrap_or_default();
    let total = stats.iter().map(|(_, backward)| *backward).sum();
    STATS
        .lock()
        .unwrap()
        .entry((bucket_mb.to_bits(), overlap))
        .or_default()
        .extend(stats);
    total
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("gradient_reduction_50M_2ranks");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(5));
    for bucket_mb in SIZES {
        for overlap in [true, false] {
            let mode = if overlap { "overlapped" } else { "after" };
            group.bench_function(BenchmarkId::new(mode, format!("{bucket_mb}MiB")), |b| {
                b.iter_custom(|iters| run(bucket_mb, overlap, iters))
            });
        }
    }
    group.finish();
}

fn report() {
    let mut out = String::from(
        "| bucket | reduction | collectives | bytes reduced per rank | reducing (median) | GB/s | not hidden by backward | buckets done before backward ended | backward incl. reduction (median) | reducing / backward |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for ((bits, overlap), mut samples) in STATS.lock().unwrap().clone() {
        let bucket_mb = f64::from_bits(bits);
        samples.sort_by_key(|(_, backward)| *backward);
        let backward = samples[samples.len() / 2].1;
        let mut stats: Vec<ReductionStats> = samples.iter().map(|(s, _)| *s).collect();
        stats.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
        let median = stats[stats.len() / 2];
        let label = if bucket_mb <= 0.0 {
            "per parameter".to_string()
        } else {
            format!("{bucket_mb} MiB")
        };
        out += &format!(
            "| {label} | {} | {} | {:.1} MB | {:.1} ms | {:.2} | {:.1} ms | {} | {:.1} ms | {:.0}% |\n",
            if overlap {
                "overlapped"
            } else {
                "after backward"
            },
            median.collectives,
            median.bytes as f64 / 1e6,
            median.seconds * 1e3,
            median.bytes as f64 / median.seconds / 1e9,
            median.exposed_seconds * 1e3,
            median.overlapped,
            backward.as_secs_f64() * 1e3,
            100.0 * median.seconds / backward.as_secs_f64(),
        );
    }
    common::publish("buckets", &out);
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion);
    criterion.final_summary();
    report();
}
