//! Bandwidth of `LocalGroup` collectives on NdArray (CPU threads), against this machine's
//! memcpy bandwidth.
//!
//! Sizes follow nccl-tests: `size` is the whole buffer (all-gather output, reduce-scatter
//! input, all-reduce buffer); algbw = size / time; busbw = algbw · (n−1)/n for all-gather and
//! reduce-scatter, algbw · 2(n−1)/n for all-reduce. After criterion's own output, a markdown
//! table of both is printed and written to `target/bench-reports/collectives.md`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::backend::NdArray;
use burn_zero::comm::{CommError, launch};
mod common;

use common::collective::{KIB, Op, label};

use criterion::{BenchmarkId, Criterion, Throughput};

type B = NdArray;

const SIZES: [usize; 4] = [64 * KIB, KIB * KIB, 16 * KIB * KIB, 64 * KIB * KIB];
const WORLDS: [usize; 2] = [2, 4];

/// Per-iteration times seen by every sample, keyed by (op, world, bytes).
static SAMPLES: Mutex<BTreeMap<(Op, usize, usize), Vec<f64>>> = Mutex::new(BTreeMap::new());
static MEMCPY: Mutex<BTreeMap<usize, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// Runs `iters` collectives on every rank; returns the slowest rank's time between barriers.
fn run(op: Op, world: usize, bytes: usize, iters: u64) -> Duration {
    let times = launch::<B, _, _, CommError>(world, &[Default::default()], |ctx| {
        let input = op.input::<B>(bytes, world, ctx.rank(), ctx.device());
        let comm = ctx.comm();
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..iters {
            black_box(op.call(comm.as_ref(), input.clone())?);
        }
        comm.barrier()?;
        Ok(start.elapsed())
    })
    .expect("benchmark ranks");
    let slowest = times.into_iter().max().unwrap_or_default();
    SAMPLES
        .lock()
        .unwrap()
        .entry((op, world, bytes))
        .or_default()
        .push(slowest.as_secs_f64() / iters as f64);
    slowest
}

fn bench_memcpy(c: &mut Criterion) {
    let mut group = c.benchmark_group("memcpy");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500));
    for bytes in SIZES {
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(BenchmarkId::from_parameter(label(bytes)), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    dst.copy_from_slice(black_box(&src));
                    black_box(&mut dst);
                }
                let elapsed = start.elapsed();
                MEMCPY
                    .lock()
                    .unwrap()
                    .entry(bytes)
                    .or_default()
                    .push(elapsed.as_secs_f64() / iters as f64);
                elapsed
            })
        });
    }
    group.finish();
}

fn bench_collectives(c: &mut Criterion) {
    for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
        let mut group = c.benchmark_group(format!("local_group/{}", op.name()));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for world in WORLDS {
            for bytes in SIZES {
                group.throughput(Throughput::Bytes(bytes as u64));
                group.bench_function(
                    BenchmarkId::new(format!("world{world}"), label(bytes)),
                    |b| b.iter_custom(|iters| run(op, world, bytes, iters)),
                );
            }
        }
        group.finish();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn report() {
    let memcpy: BTreeMap<usize, f64> = MEMCPY
        .lock()
        .unwrap()
        .clone()
        .into_iter()
        .map(|(bytes, t)| (bytes, gbps(bytes, median(t))))
        .collect();
    let mut out = String::from(
        "| op | ranks | size | time | algbw GB/s | busbw GB/s | memcpy GB/s |\n|---|---|---|---|---|---|---|\n",
    );
    for ((op, world, bytes), times) in SAMPLES.lock().unwrap().clone() {
        let t = median(times);
        let algbw = gbps(bytes, t);
        out += &format!(
            "| {} | {world} | {} | {:.3} ms | {algbw:.2} | {:.2} | {:.2} |\n",
            op.name(),
            label(bytes),
            t * 1e3,
            algbw * op.bus_factor(world),
            memcpy.get(&bytes).copied().unwrap_or(f64::NAN),
        );
    }
    common::publish("collectives", &out);
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench_memcpy(&mut criterion);
    bench_collectives(&mut criterion);
    criterion.final_summary();
    report();
}
