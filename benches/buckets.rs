//! Gradient-reduction time against bucket size: a ~50M-parameter MLP sharded over 2 CPU ranks
//! (`LocalGroup`, NdArray), stage 3, buckets of 0.5, 5, 25 and 100 MiB (and one collective per
//! parameter). Criterion times the reduction alone (as the group measures it, at the end of
//! each backward); a markdown table goes to stdout and `target/bench-reports/buckets.md`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_zero::comm::launch;
use burn_zero::core::{ReductionStats, current_group};
use burn_zero::{Zero, ZeroConfig, ZeroError, shard};
mod common;

use common::{Deep, WIDTH};

use criterion::{BenchmarkId, Criterion};

type Train = Autodiff<Zero<NdArray>>;

const RANKS: usize = 2;
const SIZES: [f64; 5] = [0.0, 0.5, 5.0, 25.0, 100.0];

/// Reduction statistics of every measured backward, by bucket size.
static STATS: Mutex<BTreeMap<u64, Vec<ReductionStats>>> = Mutex::new(BTreeMap::new());

/// Runs `iters` backward passes on every rank; returns rank 0's total reduction time.
fn run(bucket_mb: f64, iters: u64) -> Duration {
    let config = ZeroConfig::new()
        .with_bucket_size_mb(bucket_mb)
        .with_persist_below_numel(0);
    let per_rank = launch::<NdArray, _, _, ZeroError>(RANKS, &[Default::default()], |ctx| {
        let model = shard(Deep::<Train>::new(ctx.device()), &ctx, &config)?;
        let group = current_group::<NdArray>().expect("sharded");
        let mut stats = Vec::new();
        for _ in 0..iters {
            let x = Tensor::<Train, 2>::ones([1, WIDTH], ctx.device());
            let loss = model.forward(x).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            stats.push(group.last_reduction());
            drop(grads);
        }
        Ok(stats)
    })
    .expect("benchmark ranks");
    let stats = per_rank.into_iter().next().unwrap_or_default();
    let total: f64 = stats.iter().map(|s| s.seconds).sum();
    STATS
        .lock()
        .unwrap()
        .entry(bucket_mb.to_bits())
        .or_default()
        .extend(stats);
    Duration::from_secs_f64(total)
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("gradient_reduction_50M_2ranks");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(5));
    for bucket_mb in SIZES {
        group.bench_function(
            BenchmarkId::from_parameter(format!("{bucket_mb}MiB")),
            |b| b.iter_custom(|iters| run(bucket_mb, iters)),
        );
    }
    group.finish();
}

fn report() {
    let mut out = String::from(
        "| bucket | collectives | bytes reduced per rank | reduction time (median) | GB/s |\n|---|---|---|---|---|\n",
    );
    for (bits, mut stats) in STATS.lock().unwrap().clone() {
        let bucket_mb = f64::from_bits(bits);
        stats.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
        let median = stats[stats.len() / 2];
        let label = if bucket_mb <= 0.0 {
            "per parameter".to_string()
        } else {
            format!("{bucket_mb} MiB")
        };
        out += &format!(
            "| {label} | {} | {:.1} MB | {:.1} ms | {:.2} |\n",
            median.collectives,
            median.bytes as f64 / 1e6,
            median.seconds * 1e3,
            median.bytes as f64 / median.seconds / 1e9
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
