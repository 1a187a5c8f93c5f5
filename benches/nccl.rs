//! NCCL collectives (`NcclGroup`) on the visible GPUs, against `LocalGroup` on the same CUDA
//! devices (feature `cuda`; prints that it was skipped when no CUDA device is visible).
//!
//! Sizes and bandwidths follow nccl-tests, as in `benches/collectives.rs`: `size` is the whole
//! buffer; algbw = size / time; busbw = algbw · (n−1)/n for all-gather and reduce-scatter,
//! algbw · 2(n−1)/n for all-reduce. Each time is the slowest rank's, per collective, measured
//! between two barriers over a fixed number of calls, and includes what a caller pays: the
//! synchronisation with CubeCL's stream before and after NCCL. The table is printed and written
//! to `target/bench-reports/nccl.md`.
//!
//! `NCCL_BENCH_MAX_MIB` (default 64) caps the largest buffer. `NCCL_BENCH_REPORT=path` also
//! writes the rows as JSON there (`{"skipped": ...}` without a CUDA device), for the GPU check.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use burn::tensor::Tensor;
use burn_zero::comm::nccl::{CudaBackend, CudaDevice, NcclOptions, cuda_device_count};
use burn_zero::comm::{CommError, Communicator, launch, launch_nccl};
mod common;

use common::collective::{KIB, MIB, Op, label};

type B = CudaBackend;

/// (op, buffer bytes) and seconds per call.
type Timing = ((Op, usize), f64);

/// Seconds per call of every (op, size) on this rank.
fn measure(
    comm: &dyn Communicator<B>,
    device: &CudaDevice,
    sizes: &[usize],
) -> Result<Vec<Timing>, CommError> {
    let world = comm.world_size();
    let mut times = Vec::new();
    for op in Op::ALL {
        for &bytes in sizes {
            let input = op.input::<B>(bytes, world, comm.rank(), device);
            let call = |input: Tensor<B, 1>| op.call(comm, input);
            for _ in 0..3 {
                black_box(call(input.clone())?);
            }
            let iters = (256 * MIB / bytes).clamp(5, 100);
            comm.barrier()?;
            let start = Instant::now();
            for _ in 0..iters {
                black_box(call(input.clone())?);
            }
            comm.barrier()?;
            times.push(((op, bytes), start.elapsed().as_secs_f64() / iters as f64));
        }
    }
    Ok(times)
}

fn main() {
    let count = cuda_device_count().unwrap_or_else(|error| {
        eprintln!("nccl benchmark: {error}");
        std::process::exit(1);
    });
    if count == 0 {
        println!("nccl benchmark: skipped, no CUDA device visible");
        write_json(&serde_json::json!({ "skipped": "no CUDA device visible" }));
        return;
    }
    let max_mib: usize = std::env::var("NCCL_BENCH_MAX_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let sizes: Vec<usize> = [64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB]
        .into_iter()
        .filter(|&s| s <= max_mib * MIB)
        .collect();
    let mut worlds: Vec<usize> = [1, 2, 4, 8].into_iter().filter(|&w| w <= count).collect();
    if !worlds.contains(&count) {
        worlds.push(count);
    }

    // (engine, op, world, bytes) -> slowest rank's seconds per call.
    let mut results: BTreeMap<(&str, Op, usize, usize), f64> = BTreeMap::new();
    for &world in &worlds {
        let devices: Vec<CudaDevice> = (0..world).map(CudaDevice::new).collect();
        let nccl = launch_nccl::<f32, i32, u8, _, _, _>(&devices, &NcclOptions::default(), |ctx| {
            measure(ctx.comm().as_ref(), ctx.device(), &sizes)
        })
        .unwrap_or_else(|e| panic!("NCCL ranks at world {world}: {e}"));
        let local = launch::<B, _, _, _>(world, &devices, |ctx| {
            measure(ctx.comm().as_ref(), ctx.device(), &sizes)
        })
        .unwrap_or_else(|e| panic!("LocalGroup ranks at world {world}: {e}"));
        for (engine, per_rank) in [("nccl", nccl), ("local", local)] {
            for rank_times in per_rank {
                for ((op, bytes), seconds) in rank_times {
                    let slot = results.entry((engine, op, world, bytes)).or_insert(0.0);
                    *slot = slot.max(seconds);
                }
            }
        }
    }

    let mut out = String::from(
        "| engine | op | ranks | size | time | algbw GB/s | busbw GB/s |\n|---|---|---|---|---|---|---|\n",
    );
    let mut rows = Vec::new();
    for ((engine, op, world, bytes), seconds) in results {
        let algbw = bytes as f64 / seconds / 1e9;
        let busbw = algbw * op.bus_factor(world);
        out += &format!(
            "| {engine} | {} | {world} | {} | {:.3} ms | {algbw:.2} | {busbw:.2} |\n",
            op.name(),
            label(bytes),
            seconds * 1e3,
        );
        rows.push(serde_json::json!({
            "engine": engine,
            "op": op.name(),
            "ranks": world,
            "bytes": bytes,
            "seconds": seconds,
            "algbw_gb_s": algbw,
            "busbw_gb_s": busbw,
        }));
    }
    common::publish("nccl", &out);
    write_json(&serde_json::json!({ "devices": count, "rows": rows }));
}

/// Writes `value` to `$NCCL_BENCH_REPORT` when set.
fn write_json(value: &serde_json::Value) {
    if let Ok(path) = std::env::var("NCCL_BENCH_REPORT") {
        let text = serde_json::to_string_pretty(value).expect("json");
        if let Err(error) = std::fs::write(&path, text + "\n") {
            eprintln!("could not write {path}: {error}");
            std::process::exit(1);
        }
    }
}
