//! Sharded checkpoints on the ~50M-parameter model (stage 3, f32, Adam after one step, so each
//! save holds parameters, fp32 masters and both moments: 16 bytes per parameter over the ranks):
//! save and load throughput per rank against the disk's own sequential write speed with fsync,
//! measured in the same run, alternating; and the peak heap of consolidating the checkpoint
//! into one file, above its baseline, by a counting global allocator.
//!
//! The directory is `target/bench-checkpoint` (a real disk; `BURN_ZERO_BENCH_DIR` overrides
//! it). The table goes to stdout and `target/bench-reports/checkpoint.md`.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::Tensor;
use burn_zero::checkpoint::{OutputDtype, SaveOptions, consolidate, load, save};
use burn_zero::comm::launch;
use burn_zero::{PerTensor, Zero, ZeroConfig, ZeroOptimizer, shard};
use burn_zero_testing::alloc::CountingAllocator;
use common::{Deep, WIDTH};

type Train = Autodiff<Zero<Flex>>;
type Failure = Box<dyn std::error::Error + Send + Sync>;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

const MB: f64 = 1e6;
const ROUNDS: usize = 2;

/// The disk's sequential write speed with fsync: `bytes` in 8 MiB writes, then fsync.
fn disk_write_speed(dir: &Path, bytes: usize) -> f64 {
    let path = dir.join("disk-speed.bin");
    let block = vec![0x5au8; 8 << 20];
    let started = Instant::now();
    let mut file = std::fs::File::create(&path).expect("scratch file");
    let mut written = 0;
    while written < bytes {
        file.write_all(&block).expect("write");
        written += block.len();
    }
    file.sync_all().expect("fsync");
    let seconds = started.elapsed().as_secs_f64();
    drop(file);
    std::fs::remove_file(&path).ok();
    written as f64 / seconds / MB
}

/// Per rank: bytes written and seconds of `save`; bytes read and seconds of `load`.
fn save_and_load(dir: &Path, world: usize) -> Vec<(u64, f64, u64, f64)> {
    let config = ZeroConfig::new().with_persist_below_numel(0);
    launch::<Flex, _, _, Failure>(world, &[Default::default()], |ctx| {
        let (model, zero) = shard(Deep::<Train>::new(ctx.device()), &ctx, &config)?;
        let mut optim = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let x = Tensor::<Train, 2>::ones([1, WIDTH], ctx.device());
        let grads = GradientsParams::from_grads(model.forward(x).mean().backward(), &model);
        let model = optim.step(1e-3, model, grads);
        ctx.comm().barrier()?;
        let started = Instant::now();
        let saved = save(dir, 1, &model, &optim, &SaveOptions::default())?;
        let save_s = started.elapsed().as_secs_f64();
        let file = saved.join(format!("rank-{:05}-of-{world:05}.safetensors", ctx.rank()));
        let written = std::fs::metadata(file)?.len();
        drop((model, optim));

        let (model, zero) = shard(Deep::<Train>::new(ctx.device()), &ctx, &config)?;
        let optim = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        ctx.comm().barrier()?;
        let started = Instant::now();
        let (_model, _optim, loaded) = load(dir, model, optim)?;
        let load_s = started.elapsed().as_secs_f64();
        Ok((written, save_s, loaded.bytes_read, load_s))
    })
    .expect("benchmark ranks")
}

fn main() {
    let dir: PathBuf = std::env::var_os("BURN_ZERO_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-checkpoint"));
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut out = format!(
        "Checkpoint throughput, 50.4M-parameter model (48 × Linear 1024², f32, stage 3, Adam), \
         {cpus} logical CPUs ({cpu}), directory {}\n\n\
         | ranks | round | disk write+fsync MB/s | save MB/s per rank | save MB/s all ranks | \
         save / disk | load MB/s per rank | load MB/s all ranks |\n|---|---|---|---|---|---|---|---|\n",
        dir.display()
    );
    for world in [1, 2] {
        for round in 0..ROUNDS {
            std::fs::remove_dir_all(&dir).ok();
            std::fs::create_dir_all(&dir).expect("bench directory");
            let disk = disk_write_speed(&dir, 512 << 20);
            let ranks = save_and_load(&dir, world);
            let per_rank_save =
                ranks.iter().map(|r| r.0 as f64 / r.1 / MB).sum::<f64>() / world as f64;
            let all_save = ranks.iter().map(|r| r.0).sum::<u64>() as f64
                / ranks.iter().map(|r| r.1).fold(0.0, f64::max)
                / MB;
            let per_rank_load =
                ranks.iter().map(|r| r.2 as f64 / r.3 / MB).sum::<f64>() / world as f64;
            let all_load = ranks.iter().map(|r| r.2).sum::<u64>() as f64
                / ranks.iter().map(|r| r.3).fold(0.0, f64::max)
                / MB;
            out += &format!(
                "| {world} | {round} | {disk:.0} | {per_rank_save:.0} | {all_save:.0} | {:.0}% | \
                 {per_rank_load:.0} | {all_load:.0} |\n",
                100.0 * all_save / disk
            );
        }
    }

    // Consolidation of the last (2-rank) checkpoint: peak heap above the baseline.
    let largest = WIDTH * WIDTH * 4;
    let target = dir.join("consolidated.safetensors");
    let baseline = ALLOCATOR.live();
    ALLOCATOR.reset_peak();
    let started = Instant::now();
    let done = consolidate(&dir, &target, OutputDtype::F32).expect("consolidation");
    let seconds = started.elapsed().as_secs_f64();
    let peak = ALLOCATOR.peak() - baseline;
    out += &format!(
        "\nConsolidation into one fp32 file ({} tensors, {:.0} MB) in {seconds:.2} s: peak heap \
         {:.1} MB above baseline; bound 2 × largest tensor ({:.1} MB) + read buffer (≤ 64 MiB, \
         here at most one {:.1} MB piece) = {:.1} MB\n",
        done.tensors,
        done.bytes as f64 / MB,
        peak as f64 / MB,
        largest as f64 / MB,
        largest as f64 / MB,
        (3 * largest) as f64 / MB,
    );
    std::fs::remove_dir_all(&dir).ok();
    common::publish("checkpoint", &out);
}
