//! Bandwidth of `LocalGroup` collectives on Flex and NdArray (CPU threads, 2 and 4 ranks,
//! 64 KiB to 64 MiB), against this machine's memcpy bandwidth measured in the same run.
//! Criterion's filter picks a subset, e.g. `cargo bench --bench collectives --
//! 'memcpy/(1|16|64)MiB|world2/(1|16|64)MiB'`.
//!
//! Sizes follow nccl-tests: `size` is the whole buffer (all-gather output, reduce-scatter
//! input, all-reduce buffer); algbw = size / time; busbw = algbw · (n−1)/n for all-gather and
//! reduce-scatter, algbw · 2(n−1)/n for all-reduce; memcpy GB/s = size / time of one
//! `copy_from_slice` of `size` bytes. Each rank issues the same collective again and again and
//! drops each result, as a training loop does, so results land in reused buffers; one untimed
//! call per sample fills the pool first. After
//! criterion's own output, a markdown table is printed and written to
//! `target/bench-reports/collectives.md`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::backend::{Flex, NdArray};
use burn::tensor::backend::Backend;
use burn_zero::comm::{CommError, launch};
mod common;

use common::collective::{KIB, Op, label};

use criterion::{BenchmarkId, Criterion, Throughput};

const SIZES: [usize; 4] = [64 * KIB, KIB * KIB, 16 * KIB * KIB, 64 * KIB * KIB];
const WORLDS: [usize; 2] = [2, 4];

/// Per-iteration times seen by every sample, keyed by (backend, op, world, bytes).
type Key = (&'static str, Op, usize, usize);
static SAMPLES: Mutex<BTreeMap<Key, Vec<f64>>> = Mutex::new(BTreeMap::new());
/// Minor page faults of the whole process per collective call, by the same key.
static FAULTS: Mutex<BTreeMap<Key, Vec<f64>>> = Mutex::new(BTreeMap::new());
static MEMCPY: Mutex<BTreeMap<usize, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// Minor page faults of this process so far (field 10 of `/proc/self/stat`); `None` where
/// there is no procfs.
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces; the fields after it are plain numbers.
    let after_name = stat.rsplit_once(')')?.1;
    after_name.split_whitespace().nth(7)?.parse().ok()
}

/// Runs `iters` collectives on every rank; returns the slowest rank's time between barriers.
fn run<B: Backend>(
    backend: &'static str,
    op: Op,
    world: usize,
    bytes: usize,
    iters: u64,
) -> Duration {
    let per_rank = launch::<B, _, _, CommError>(world, &[Default::default()], |ctx| {
        let input = op.input::<B>(bytes, world, ctx.rank(), ctx.device());
        let comm = ctx.comm();
        // Each sample starts a new group, whose first call fills the rank's buffer pool with
        // fresh (page-faulting) memory. A training job makes that call once and thousands after
        // it on the same group: the steady state is what is timed.
        black_box(op.call(comm.as_ref(), input.clone())?);
        comm.barrier()?;
        let faults = minor_faults();
        let start = Instant::now();
        for _ in 0..iters {
            black_box(op.call(comm.as_ref(), input.clone())?);
        }
        comm.barrier()?;
        let elapsed = start.elapsed();
        let faults = faults.zip(minor_faults()).map(|(start, end)| end - start);
        Ok((elapsed, faults))
    })
    .expect("benchmark ranks");
    let key = (backend, op, world, bytes);
    // Rank 0 counted every rank's faults between the two barriers.
    if let Some((_, Some(faults))) = per_rank.first() {
        FAULTS
            .lock()
            .unwrap()
            .entry(key)
            .or_default()
            .push(*faults as f64 / iters as f64);
    }
    let slowest = per_rank
        .into_iter()
        .map(|(elapsed, _)| elapsed)
        .max()
        .unwrap_or_default();
    SAMPLES
        .lock()
        .unwrap()
        .entry(key)
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

fn bench_collectives<B: Backend>(c: &mut Criterion, backend: &'static str) {
    for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
        let mut group = c.benchmark_group(format!("local_group/{backend}/{}", op.name()));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1));
        for world in WORLDS {
            for bytes in SIZES {
                group.throughput(Throughput::Bytes(bytes as u64));
                group.bench_function(
                    BenchmarkId::new(format!("world{world}"), label(bytes)),
                    |b| b.iter_custom(|iters| run::<B>(backend, op, world, bytes, iters)),
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
        "| backend | op | ranks | size | time | algbw GB/s | busbw GB/s | memcpy GB/s | algbw / memcpy | minor faults per call |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let faults = FAULTS.lock().unwrap().clone();
    for (key, times) in SAMPLES.lock().unwrap().clone() {
        let (backend, op, world, bytes) = key;
        let t = median(times);
        let algbw = gbps(bytes, t);
        let copy = memcpy.get(&bytes).copied().unwrap_or(f64::NAN);
        let faults = faults
            .get(&key)
            .map_or("n/a".to_string(), |f| format!("{:.0}", median(f.clone())));
        out += &format!(
            "| {backend} | {} | {world} | {} | {:.3} ms | {algbw:.2} | {:.2} | {copy:.2} | {:.0}% | {faults} |\n",
            op.name(),
            label(bytes),
            t * 1e3,
            algbw * op.bus_factor(world),
            100.0 * algbw / copy,
        );
    }
    common::publish("collectives", &out);
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench_memcpy(&mut criterion);
    bench_collectives::<Flex>(&mut criterion, "flex");
    bench_collectives::<NdArray>(&mut criterion, "ndarray");
    criterion.final_summary();
    report();
}
