//! The training step the scaling suite times, shared word for word by the burn-zero bench
//! (`benches/scaling.rs`) and the plain-Burn baseline (`benches/plain-burn`), so both run the
//! same model, data and optimizer and differ only in the backend and the optimizer wrapper.
//!
//! The model, data and module helpers come from the `burn-zero-gpt` crate.

#![allow(dead_code)]

use std::time::Duration;

use burn::module::Module;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use burn_zero_gpt::{Corpus, Gpt, Materialise, Preset, TEXT};

/// Model size: GPT `small` (d_model 192, 6 heads, 4 blocks, about 1.8M parameters).
pub const PRESET: Preset = Preset::Small;
/// Characters per sequence.
pub const SEQ_LEN: usize = 64;
/// Sequences per optimizer step over all ranks; each of N ranks takes GLOBAL_BATCH / N.
pub const GLOBAL_BATCH: usize = 16;
/// Adam's learning rate.
pub const LR: f64 = 1e-3;
/// Seed of the initial model and of the batches.
pub const SEED: u64 = 2024;
/// Criterion samples per benchmark.
pub const SAMPLES: usize = 10;
/// Criterion's warm-up and measurement times per benchmark.
pub const WARM_UP: Duration = Duration::from_millis(1500);
pub const MEASUREMENT: Duration = Duration::from_secs(8);

/// A step's shape: the model, characters per sequence and sequences per step over all ranks.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub preset: Preset,
    pub seq_len: usize,
    pub global_batch: usize,
}

/// The scaling suite's shape.
pub const SHAPE: Shape = Shape {
    preset: PRESET,
    seq_len: SEQ_LEN,
    global_batch: GLOBAL_BATCH,
};

/// The training text as symbol ids.
pub fn corpus() -> Corpus {
    Corpus::new(TEXT)
}

/// The initial model, seeded and materialised (lazily initialised parameters hold values).
pub fn model<B: AutodiffBackend>(corpus: &Corpus, device: &B::Device) -> Gpt<B> {
    model_of(PRESET, corpus, device)
}

/// [`model`] of another size (`benches/chunks.rs` runs `small` and `base`).
pub fn model_of<B: AutodiffBackend>(preset: Preset, corpus: &Corpus, device: &B::Device) -> Gpt<B> {
    model_shaped(&Shape { preset, ..SHAPE }, corpus, device)
}

/// [`model`] of `shape`'s preset, for its sequence length.
pub fn model_shaped<B: AutodiffBackend>(
    shape: &Shape,
    corpus: &Corpus,
    device: &B::Device,
) -> Gpt<B> {
    B::seed(device, SEED);
    let model = shape
        .preset
        .config(corpus.vocab(), shape.seq_len)
        .init(device);
    model.visit(&mut Materialise);
    model
}

/// This rank's mean loss on its slice of the global batch of `step`.
pub fn loss<B: AutodiffBackend>(
    model: &Gpt<B>,
    corpus: &Corpus,
    step: usize,
    rank: usize,
    world_size: usize,
    device: &B::Device,
) -> Tensor<B, 1> {
    loss_shaped(&SHAPE, model, corpus, step, rank, world_size, device)
}

/// [`loss`] on batches of `shape`.
pub fn loss_shaped<B: AutodiffBackend>(
    shape: &Shape,
    model: &Gpt<B>,
    corpus: &Corpus,
    step: usize,
    rank: usize,
    world_size: usize,
    device: &B::Device,
) -> Tensor<B, 1> {
    let rows = shape.global_batch / world_size;
    let range = rank * rows..(rank + 1) * rows;
    let (inputs, targets) = corpus.batch::<B>(SEED, step, range, shape.seq_len, device);
    model.loss(inputs, targets)
}

/// One training step: forward, loss, backward, optimizer step.
pub fn step<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    model: Gpt<B>,
    optimizer: &mut O,
    corpus: &Corpus,
    step: usize,
    rank: usize,
    world_size: usize,
    device: &B::Device,
) -> Gpt<B> {
    step_shaped(
        &SHAPE, model, optimizer, corpus, step, rank, world_size, device,
    )
}

/// [`step`] on batches of `shape`.
#[allow(clippy::too_many_arguments)]
pub fn step_shaped<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    shape: &Shape,
    model: Gpt<B>,
    optimizer: &mut O,
    corpus: &Corpus,
    step: usize,
    rank: usize,
    world_size: usize,
    device: &B::Device,
) -> Gpt<B> {
    let loss = loss_shaped(shape, &model, corpus, step, rank, world_size, device);
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optimizer.step(LR, model, grads)
}

/// The median of `values` (the mean of the two middle ones for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.is_empty() {
        f64::NAN
    } else if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

/// Seconds per step of each of the last `SAMPLES` (iterations, elapsed) pairs criterion asked
/// for: its measurement samples, which follow its warm-up calls.
pub fn per_step_samples(calls: &[(u64, Duration)]) -> Vec<f64> {
    let start = calls.len().saturating_sub(SAMPLES);
    calls[start..]
        .iter()
        .map(|(iters, elapsed)| elapsed.as_secs_f64() / (*iters).max(1) as f64)
        .collect()
}

/// What the reports say about the machine: CPU model, logical CPUs, memory, and when.
pub fn machine() -> (String, usize, u64, u64) {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name"))
        .map(|rest| rest.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_else(|| "unknown CPU".to_string());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_bytes = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kb| kb * 1024);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    (cpu, cpus, mem_bytes, now)
}

/// Steps taken one phase at a time, with each phase timed: forward (to the loss), backward
/// (gradients, reduction included, into `GradientsParams`), optimizer step.
pub const PHASE_STEPS: usize = 8;

/// Milliseconds of forward, backward and the optimizer step: the median over the steps and
/// the fastest step's (the machine's noise only ever adds time).
pub struct Phases {
    pub median: [f64; 3],
    pub fastest: [f64; 3],
}

/// Runs [`PHASE_STEPS`] steps from step `first`, timing each phase; returns the model and the
/// phase times.
#[allow(clippy::too_many_arguments)]
pub fn timed_phases<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    mut model: Gpt<B>,
    optimizer: &mut O,
    corpus: &Corpus,
    first: usize,
    rank: usize,
    world_size: usize,
    device: &B::Device,
) -> (Gpt<B>, Phases) {
    let mut times: [Vec<f64>; 3] = Default::default();
    for step in first..first + PHASE_STEPS {
        let started = std::time::Instant::now();
        let loss = loss(&model, corpus, step, rank, world_size, device);
        let forward = started.elapsed();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let backward = started.elapsed();
        model = optimizer.step(LR, model, grads);
        let total = started.elapsed();
        times[0].push(forward.as_secs_f64() * 1e3);
        times[1].push((backward - forward).as_secs_f64() * 1e3);
        times[2].push((total - backward).as_secs_f64() * 1e3);
    }
    let fastest = |t: &[f64]| t.iter().copied().fold(f64::INFINITY, f64::min);
    let phases = Phases {
        median: [median(&times[0]), median(&times[1]), median(&times[2])],
        fastest: [fastest(&times[0]), fastest(&times[1]), fastest(&times[2])],
    };
    (model, phases)
}

/// Phase times as a JSON object.
pub fn phases_json(ms: &[f64; 3]) -> serde_json::Value {
    serde_json::json!({ "forward": ms[0], "backward": ms[1], "optimizer": ms[2] })
}

/// Writes `report` to `<dir>/<name>.json`, where `name` is `$env_var` or `default`, and says
/// where it went (or why it could not).
pub fn write_report(
    dir: &std::path::Path,
    env_var: &str,
    default: &str,
    report: &serde_json::Value,
) {
    let name = std::env::var(env_var).unwrap_or_else(|_| default.into());
    let path = dir.join(format!("{name}.json"));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&path, serde_json::to_string_pretty(report).expect("json")));
    match written {
        Ok(()) => println!("wrote {}", path.display()),
        Err(error) => eprintln!("could not write {}: {error}", path.display()),
    }
}
