//! The largest GPT whose training step fits a device-memory budget, one rank on wgpu with
//! Burn's fusion layer (`Fusion<CubeBackend<WgpuRuntime>>`, what `burn::backend::Wgpu` is with
//! Burn's default features; Mesa's lavapipe on a machine without a GPU), for each way of
//! placing the model state:
//!
//! - plain Burn: the unsharded model with Burn's Adam, everything on the device (16 bytes of
//!   model state per f32 parameter; on `Autodiff<Zero<Wgpu>>`, whose ops go straight to the
//!   backend for a model that is not sharded);
//! - stage 3: `Autodiff<Zero<Wgpu>>` with `ZeroOptimizer::adam`, masters and moments on the
//!   device (at one rank the same 16 bytes, plus the bucket and gather buffers); like every
//!   sharded side, with no gather cache (`max_live_gathered_bytes` 0): each op gathers the
//!   parameter it uses and drops it after, where the default cache (512 MiB) would keep every
//!   gathered parameter from forward to backward, a second copy of the parameters;
//! - stage 3, optimizer on the host (`Placement::fractions(0, 1)`) with the fused Adam on Flex:
//!   the device holds parameters and gradients, the host the fp32 masters and
//!   both moments;
//! - stage 3, parameters on the host too: the same optimizer, and every parameter shard in host
//!   memory (`offload_param_frac` 1): the device holds a parameter only while an op uses it,
//!   and the gradients;
//! - stage 3, optimizer on the host, auto placement: the same, with `auto_placement_capacity_mib`
//!   set to the budget instead of every shard on the host: after two warm-up steps the shards
//!   that fit move to the device, and the others' shards stay on the device between their
//!   gathers while each period of the step has room;
//! - stage 3, auto placement, optimizer chunks in its margin: the same placement with a split
//!   optimizer whose every chunk starts on the host; once the placement has decided, chunks
//!   move to the device while their masters and moments fit in 0.8 of the room it left over
//!   (`gpu_margin_mem_ratio`), and step there;
//! - plain Burn and stage 3 with optimizer and parameters on the host, each on Burn's
//!   `Autodiff<_, BalancedCheckpointing>` (sides `plain-burn-checkpointed` and
//!   `stage3-parameters-on-host-checkpointed`): the activations of memory-bound ops are
//!   recomputed in backward instead of kept, so at eight sequences a step less of the budget
//!   goes to activations. Each is compared with plain Burn under the same checkpointing.
//!
//! The models keep depth and width in one ratio (`k` blocks of width 64·k, `k` heads of 64,
//! MLP 4× wide) up to `k` = 16 and grow in depth only after it (width 1024, 16 heads): Burn's
//! `Linear` takes the weight's gradient of a `[batch, seq, in]` input as one `[batch, in, out]`
//! product before summing over the batch, a single buffer of 8·1024·4096·4 B = 128 MiB at width
//! 1024 and eight sequences, the largest buffer lavapipe binds (wider, every side fails
//! there, whatever its budget). They train on the same micro-batch (8 sequences of 64
//! characters, or `LARGEST_BATCH` sequences), so the activations grow with the model alike on
//! every side. The
//! sharded sides build their model with lazily initialised parameters, which `shard`
//! materialises one at a time: where parameters are offloaded, the whole model is never on the
//! device (plain Burn's model is, as it must be). "Fits" is judged by cubecl's own
//! count of the device memory it has reserved (or, with `LARGEST_JUDGE=in_use`, of its bytes
//! in use, the count the auto placement plans with), summed over every stream of the device
//! (`burn_zero_kernels::device_memory`), sampled every 5 ms by a thread of its own while four
//! training steps run, the largest sample kept: the same independent measurement for every
//! side, none of it burn-zero's accounting. Each trial runs in a child process of its own (this
//! bench executable with `--trial`), so that no pool of an earlier trial is counted.
//!
//! For each side, `k` doubles from 1 (or `LARGEST_MIN_K`) until a trial exceeds the budget (or
//! fails: an auto placement whose warm-up exceeds its capacity stops with a named error), then
//! the interval is halved down to the largest `k` that fits; the report gives the largest `k`
//! that fit, its parameters, its measured peak, its tokens per second and its
//! uploads of host memory to the device per step (both over the last two steps, after the auto
//! placement's two warm-up steps; the uploads are the rank's own count, and the trial's JSON
//! line adds the read-backs and what the auto placement decided and kept).
//!
//! `--backend cuda` (built with `--features cuda`; the GPU check's `largest` section) runs the
//! trials on CUDA device 0 (`CubeBackend<CudaRuntime>`), under its free memory unless
//! `LARGEST_BUDGET_MIB` is set; `LARGEST_MODEL_REPORT` names a file for the JSON report.
//!
//! Environment: `LARGEST_BUDGET_MIB` (default 128), `LARGEST_MIN_K` and `LARGEST_MAX_K` (where
//! the doubling starts and the largest size tried; default 1 and 12),
//! `LARGEST_SIDES` (the sides to run, by name, comma-separated; default all), `LARGEST_BATCH`
//! (sequences per step; default 8), `LARGEST_STEPS` (steps per trial; default 4), `LARGEST_JUDGE`
//! (`reserved`, the default, or `in_use`).
//! `cargo bench --bench largest_model --features wgpu`; without `--features wgpu` there is no
//! device-memory count and the bench says so.

#[path = "common/adapter.rs"]
mod adapter;
#[path = "common/report.rs"]
mod report;

use std::process::Command;
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_fusion::Fusion;
use burn_zero::comm::launch;
use burn_zero::{Capacity, Placement, Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard};
use burn_zero_gpt::{Corpus, Gpt, GptConfig, Materialise, TEXT};
use burn_zero_kernels::peak_device_memory;
use serde_json::{Value, json};

/// wgpu as Burn's default features build it: the fusion layer over the cubecl backend.
type Wgpu = Fusion<CubeBackend<WgpuRuntime, f32, i32, u32>>;
/// CUDA as the GPU check runs it: the cubecl backend (`--features cuda`).
#[cfg(feature = "cuda")]
type Cuda = burn_zero::comm::nccl::CudaBackend;
#[cfg(feature = "cuda")]
use burn_zero::comm::nccl::CudaDevice;

/// The device the trials run on (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeviceKind {
    Wgpu,
    #[cfg(feature = "cuda")]
    Cuda,
}

impl DeviceKind {
    fn name(self) -> &'static str {
        match self {
            DeviceKind::Wgpu => "wgpu",
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => "cuda",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        match name {
            "wgpu" => Some(DeviceKind::Wgpu),
            #[cfg(feature = "cuda")]
            "cuda" => Some(DeviceKind::Cuda),
            _ => None,
        }
    }
}

/// Sequences per step (`LARGEST_BATCH`, default 8) and characters per sequence: the same for
/// every model and side. The batch sets how much of the budget activations take: the fewer
/// sequences, the more of it is model state, which is what placement moves off the device.
fn batch() -> usize {
    env_number("LARGEST_BATCH", 8).max(1)
}
const SEQ_LEN: usize = 64;
/// Steps per trial (`LARGEST_STEPS`, default 4, at least 3), the last `TIMED` of them timed.
/// The auto placement's warm-up is the first two steps; a side without it holds every byte it
/// will hold from its second step on (the optimizer makes its state in the first), so three
/// steps judge it as well where a large model's trial must stay short.
fn steps() -> usize {
    env_number("LARGEST_STEPS", 4).max(TIMED + 1)
}
const TIMED: usize = 2;
const LR: f64 = 1e-3;
const SEED: u64 = 2024;
/// How often the sampler reads the device's memory.
const SAMPLE_EVERY: Duration = Duration::from_millis(5);
/// The share of the auto placement's left-over room the margin side gives optimizer chunks.
const MARGIN_RATIO: f64 = 0.8;

/// Where the model state lives, and whether activations are checkpointed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    PlainBurn,
    Stage3,
    Stage3OptimizerOnHost,
    Stage3ParametersOnHost,
    Stage3AutoPlacement,
    Stage3AutoPlacementMargin,
    /// Plain Burn on `Autodiff<_, BalancedCheckpointing>`.
    PlainBurnCheckpointed,
    /// Optimizer and parameters on the host, on `Autodiff<_, BalancedCheckpointing>`.
    Stage3ParametersOnHostCheckpointed,
}

impl Side {
    const ALL: [Side; 8] = [
        Side::PlainBurn,
        Side::Stage3,
        Side::Stage3OptimizerOnHost,
        Side::Stage3ParametersOnHost,
        Side::Stage3AutoPlacement,
        Side::Stage3AutoPlacementMargin,
        Side::PlainBurnCheckpointed,
        Side::Stage3ParametersOnHostCheckpointed,
    ];

    fn name(self) -> &'static str {
        match self {
            Side::PlainBurn => "plain-burn",
            Side::Stage3 => "stage3",
            Side::Stage3OptimizerOnHost => "stage3-optimizer-on-host",
            Side::Stage3ParametersOnHost => "stage3-parameters-on-host",
            Side::Stage3AutoPlacement => "stage3-auto-placement",
            Side::Stage3AutoPlacementMargin => "stage3-auto-placement-margin",
            Side::PlainBurnCheckpointed => "plain-burn-checkpointed",
            Side::Stage3ParametersOnHostCheckpointed => "stage3-parameters-on-host-checkpointed",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Side::PlainBurn => "plain Burn (Adam)",
            Side::Stage3 => "stage 3",
            Side::Stage3OptimizerOnHost => "stage 3, optimizer on the host",
            Side::Stage3ParametersOnHost => "stage 3, optimizer and parameters on the host",
            Side::Stage3AutoPlacement => "stage 3, optimizer on the host, auto placement",
            Side::Stage3AutoPlacementMargin => {
                "stage 3, auto placement, optimizer chunks in its margin"
            }
            Side::PlainBurnCheckpointed => "plain Burn (Adam), activation checkpointing",
            Side::Stage3ParametersOnHostCheckpointed => {
                "stage 3, optimizer and parameters on the host, activation checkpointing"
            }
        }
    }

    /// Whether the side trains on Burn's `Autodiff<_, BalancedCheckpointing>`: activations of
    /// memory-bound ops recomputed in backward instead of kept from forward.
    fn checkpointed(self) -> bool {
        matches!(
            self,
            Side::PlainBurnCheckpointed | Side::Stage3ParametersOnHostCheckpointed
        )
    }

    /// Where a sharded side places parameter shards and optimizer state (`None`: plain Burn,
    /// not sharded).
    fn placement(self) -> Option<Placement> {
        let auto = Placement::auto(Capacity::MiB(mib(budget())));
        match self {
            Side::PlainBurn | Side::PlainBurnCheckpointed => None,
            Side::Stage3 => Some(Placement::device()),
            Side::Stage3OptimizerOnHost => Some(Placement::fractions(0.0, 1.0)),
            Side::Stage3ParametersOnHost | Side::Stage3ParametersOnHostCheckpointed => {
                Some(Placement::fractions(1.0, 1.0))
            }
            Side::Stage3AutoPlacement => Some(auto),
            // Every chunk's state starts on the host; after the placement, those that fit in
            // 0.8 of the room it left move to the device.
            Side::Stage3AutoPlacementMargin => Some(auto.with_gpu_margin_mem_ratio(MARGIN_RATIO)),
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Side::ALL.into_iter().find(|side| side.name() == name)
    }
}

/// The widest model's `k`: from here on models grow in depth only (see the module docs).
const WIDEST_K: usize = 16;

/// The model of size `k`: `k` blocks of width 64·min(k, 16), heads of 64.
fn config(k: usize, vocab: usize) -> GptConfig {
    let heads = k.min(WIDEST_K);
    let width = 64 * heads;
    GptConfig::new(vocab, SEQ_LEN, width, heads, k, 4 * width)
}

/// The model of size `k` on `device`, its parameters initialised lazily: each is
/// materialised on the device when first used (by `shard`, one at a time), unless
/// `materialise` asks for all of them now.
fn model<B: AutodiffBackend>(
    k: usize,
    corpus: &Corpus,
    device: &B::Device,
    materialise: bool,
) -> Gpt<B> {
    B::seed(device, SEED);
    let model = config(k, corpus.vocab()).init(device);
    if materialise {
        model.visit(&mut Materialise);
    }
    model
}

/// [`steps`] training steps of `model` with `optimizer`; the seconds of the last `TIMED`.
/// `timing` is called as they start.
fn train<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    mut model: Gpt<B>,
    optimizer: &mut O,
    corpus: &Corpus,
    device: &B::Device,
    mut timing: impl FnMut(),
) -> f64 {
    let mut started = Instant::now();
    let steps = steps();
    for step in 0..steps {
        if step == steps - TIMED {
            timing();
            started = Instant::now();
        }
        let (inputs, targets) = corpus.batch::<B>(SEED, step, 0..batch(), SEQ_LEN, device);
        let loss = model.loss(inputs, targets);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(LR, model, grads);
        B::sync(device).expect("the device syncs");
    }
    started.elapsed().as_secs_f64()
}

/// One trial, in this (child) process, on `backend`: prints one JSON line.
fn trial(side: Side, k: usize, backend: DeviceKind) {
    match backend {
        DeviceKind::Wgpu => trial_on::<Wgpu>(side, k, WgpuDevice::default()),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => trial_on::<Cuda>(side, k, CudaDevice::new(0)),
    }
}

/// [`trial`] on backend `B`'s `device`.
fn trial_on<B: Backend>(side: Side, k: usize, device: B::Device) {
    let corpus = Corpus::new(TEXT);
    let ((parameters, seconds, placement), peak) =
        peak_device_memory::<B, _>(&device, SAMPLE_EVERY, || {
            match (side.placement(), side.checkpointed()) {
                (None, false) => plain::<Autodiff<Zero<B>>>(k, &corpus, &device),
                (None, true) => {
                    plain::<Autodiff<Zero<B>, BalancedCheckpointing>>(k, &corpus, &device)
                }
                (Some(placement), false) => {
                    sharded::<B, NoCheckpointing>(k, &corpus, &device, placement)
                }
                (Some(placement), true) => {
                    sharded::<B, BalancedCheckpointing>(k, &corpus, &device, placement)
                }
            }
        });
    let peak = peak.expect("a backend with a device-memory count");
    let tokens = (TIMED * batch() * SEQ_LEN) as f64;
    let line = json!({
        "side": side.name(),
        "k": k,
        "parameters": parameters,
        "peak_reserved_bytes": peak.reserved,
        "peak_in_use_bytes": peak.in_use,
        "tokens_per_s": tokens / seconds,
        "placement": placement,
    });
    println!("{line}");
}

/// Plain Burn's trial on `AB`: the parameters, the timed seconds, no placement.
///
/// Not sharded: `Zero` forwards every op of an unsharded model to the backend (Burn's autodiff
/// needs a backend with its distributed operations, which `Zero` is), so this is Burn's own
/// training, holding its own memory.
fn plain<AB: AutodiffBackend>(k: usize, corpus: &Corpus, device: &AB::Device) -> Trained {
    let model = model::<AB>(k, corpus, device, true);
    let parameters = model.num_params();
    let mut adam = AdamConfig::new().init();
    let seconds = train(model, &mut adam, corpus, device, || {});
    (parameters, seconds, Value::Null)
}

/// What a trial measured besides the device's peak: parameters, timed seconds, and for a
/// sharded side what crossed the bus and what the placement decided.
type Trained = (usize, f64, Value);

/// A sharded side's trial: stage 3 on `Autodiff<Zero<B>, C>` with `placement`, one rank.
fn sharded<B: Backend, C: CheckpointStrategy>(
    k: usize,
    corpus: &Corpus,
    device: &B::Device,
    placement: Placement,
) -> Trained {
    // No gather cache on any sharded side: the default one (512 MiB) would keep every gathered
    // parameter from forward to backward, a second copy of the model's parameters on the
    // device under a budget of a few hundred MiB.
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_max_live_gathered_bytes(0)
        .with_placement(placement);
    let mut ranks = launch::<B, _, _, ZeroError>(1, std::slice::from_ref(device), |ctx| {
        // Built lazily and sharded one parameter at a time: where parameters are offloaded, the
        // whole model is never on the device at once.
        let (sharded, shard_peak) = peak_device_memory::<B, _>(ctx.device(), SAMPLE_EVERY, || {
            let base = model::<Autodiff<Zero<B>, C>>(k, corpus, ctx.device(), false);
            shard(base, &ctx, &config)
        });
        let (model, zero) = sharded?;
        let parameters = model.num_params();
        let mut timed_from = zero.counts();
        let timing = || timed_from = zero.counts();
        let mut optimizer = ZeroOptimizer::new(&zero, AdamConfig::new())?;
        let seconds = train(model, &mut optimizer, corpus, ctx.device(), timing);
        let margin = optimizer.margin_report();
        // What crossed between host and device per timed step, and what the auto placement
        // kept on the device between gathers over the run.
        let timed = zero.counts() - timed_from;
        let report = zero.memory_report();
        let placement = json!({
            // What the device held while the model was built and sharded.
            "shard_peak_in_use_bytes": shard_peak.map(|p| p.in_use),
            "margin": margin.map(|m| json!({
                "budget_bytes": m.budget_bytes,
                "moved_chunks": m.moved_chunks,
                "moved_bytes": m.moved_bytes,
                "host_chunks": m.host_chunks,
            })),
            "uploads_per_step": timed.host_writes as f64 / TIMED as f64,
            "read_backs_per_step": timed.host_reads as f64 / TIMED as f64,
            // What crosses the bus on a GPU, each way.
            "upload_bytes_per_step": timed.host_write_bytes as f64 / TIMED as f64,
            "read_back_bytes_per_step": timed.host_read_bytes as f64 / TIMED as f64,
            "auto_placement": report.auto_placement,
            "kept_shards": report.kept_shards,
        });
        Ok((parameters, seconds, placement))
    })
    .expect("one rank trains");
    ranks.swap_remove(0)
}

/// Runs one trial in a child process; `None` when it failed (for instance out of memory).
fn run_trial(side: Side, k: usize, backend: DeviceKind, budget: u64) -> Option<Value> {
    let exe = std::env::current_exe().expect("the bench knows its executable");
    let output = Command::new(exe)
        .args(["--trial", side.name(), &k.to_string()])
        .args(["--backend", backend.name()])
        .env("LARGEST_BUDGET_MIB", (budget >> 20).to_string())
        .output()
        .expect("the bench can run itself");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{'));
    match (output.status.success(), line) {
        (true, Some(line)) => serde_json::from_str(line).ok(),
        _ => {
            // The panic's message (the line after "panicked at"), else the last lines.
            let stderr = String::from_utf8_lossy(&output.stderr);
            let lines: Vec<&str> = stderr.lines().collect();
            let why = match lines.iter().position(|l| l.contains("panicked at")) {
                Some(at) => lines[at..].iter().take(2).copied().collect::<Vec<_>>(),
                None => lines.iter().rev().take(3).copied().collect(),
            };
            eprintln!("  {} k={k}: the trial failed: {why:?}", side.name());
            None
        }
    }
}

/// The device budget, in bytes (`LARGEST_BUDGET_MIB`, default 128).
fn budget() -> u64 {
    env_number("LARGEST_BUDGET_MIB", 128) as u64 * (1 << 20)
}

/// Which count a trial's peak is judged by against the budget (`LARGEST_JUDGE`): cubecl's
/// reserved bytes (the default: what the device gave up, pool pages included) or its bytes
/// in use (live allocations).
#[derive(Debug, Clone, Copy)]
enum Judge {
    Reserved,
    InUse,
}

impl Judge {
    fn from_env() -> Self {
        match std::env::var("LARGEST_JUDGE").as_deref() {
            Ok("in_use") => Judge::InUse,
            _ => Judge::Reserved,
        }
    }

    fn key(self) -> &'static str {
        match self {
            Judge::Reserved => "peak_reserved_bytes",
            Judge::InUse => "peak_in_use_bytes",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Judge::Reserved => "cubecl's reserved bytes",
            Judge::InUse => "cubecl's bytes in use",
        }
    }
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let backend = match args.iter().position(|a| a == "--backend") {
        None => DeviceKind::Wgpu,
        Some(at) => {
            let name = args.get(at + 1).map_or("", String::as_str);
            match DeviceKind::parse(name) {
                Some(backend) => backend,
                None => {
                    eprintln!(
                        "largest_model: --backend {name:?} is not one this build runs: wgpu, or \
                         cuda with --features cuda"
                    );
                    std::process::exit(2);
                }
            }
        }
    };
    if let Some(at) = args.iter().position(|a| a == "--trial") {
        let side = Side::parse(&args[at + 1]).expect("a side's name");
        let k = args[at + 2].parse().expect("a size");
        trial(side, k, backend);
        return;
    }
    // `cargo test --benches` runs bench targets without `--bench`; only `cargo bench` measures.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let (device_name, capacity) = match open_device(backend) {
        Ok(opened) => opened,
        Err(reason) => {
            eprintln!("largest_model: {reason}");
            write_report(&json!({ "skipped": reason }));
            return;
        }
    };
    // On CUDA the budget is the device's free memory unless one is given.
    let budget = match (std::env::var("LARGEST_BUDGET_MIB").is_ok(), capacity) {
        (false, Some(free)) => free,
        _ => budget(),
    };
    let judge = Judge::from_env();
    let max_k = env_number("LARGEST_MAX_K", 12);
    // `LARGEST_MIN_K`: where the doubling starts (each trial is a process of its own, and on
    // CUDA each compiles its kernels first: sizes known to fit need not be tried).
    let min_k = env_number("LARGEST_MIN_K", 1).clamp(1, max_k.max(1));
    // `LARGEST_SIDES`: the sides to run, by name, comma-separated (default: all).
    let chosen = std::env::var("LARGEST_SIDES").ok();
    let sides = Side::ALL.into_iter().filter(|side| {
        chosen
            .as_deref()
            .is_none_or(|names| names.split(',').any(|n| n.trim() == side.name()))
    });
    let mut rows = Vec::new();
    for side in sides {
        let fits = |k: usize| {
            let result = run_trial(side, k, backend, budget)?;
            let peak = result[judge.key()].as_u64().unwrap_or(u64::MAX);
            // The trial's speed and transfers too: a search stopped early still leaves, for
            // each size it tried, what the sides paid there.
            let per_step = |name: &str| {
                result["placement"][name]
                    .as_f64()
                    .map_or_else(|| "-".to_string(), |n| n.to_string())
            };
            let per_mib = |name: &str| {
                result["placement"][name]
                    .as_f64()
                    .map_or_else(|| "-".to_string(), |n| format!("{:.1}", n / 1048576.0))
            };
            eprintln!(
                "  {} k={k}: {} parameters, peak {:.1} MiB, {:.1} tokens/s, uploads {} ({} MiB) \
                 and read-backs {} ({} MiB) per step",
                side.name(),
                result["parameters"],
                mib(peak),
                result["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
                per_step("uploads_per_step"),
                per_mib("upload_bytes_per_step"),
                per_step("read_backs_per_step"),
                per_mib("read_back_bytes_per_step"),
            );
            Some((peak <= budget, result))
        };
        let (fit, over) = search(min_k, max_k, fits);
        rows.push((side, fit, over));
    }
    let (md, json) = render(&rows, budget, judge, &device_name);
    write_report(&json);
    report::publish("largest_model", &md, Some(&json));
}

/// Writes `json` where `LARGEST_MODEL_REPORT` says (the GPU check's data file), when it is set.
fn write_report(json: &Value) {
    if let Ok(path) = std::env::var("LARGEST_MODEL_REPORT") {
        let text = serde_json::to_string_pretty(json).expect("a JSON value serialises");
        if let Err(error) = std::fs::write(&path, text + "\n") {
            eprintln!("largest_model: could not write {path}: {error}");
        }
    }
}

/// The largest `k` from 1 to `max_k` for which `fits` says yes, and the trial of the smallest
/// that did not fit (when it ran): `k` doubles until a trial does not fit, then the interval
/// is halved, so that a search up to a GPU's size takes a few trials per side. A trial that
/// failed (`None`: out of memory, for one) does not fit. Sizes are assumed to fit up to some
/// `k` and no further.
fn search(
    min_k: usize,
    max_k: usize,
    mut fits: impl FnMut(usize) -> Option<(bool, Value)>,
) -> (Option<Value>, Option<Value>) {
    // The largest size that fit with its trial, and the smallest that did not with its trial
    // when one ran.
    let mut fit: Option<(usize, Value)> = None;
    let mut over: Option<(usize, Option<Value>)> = None;
    let mut k = min_k;
    while k <= max_k {
        match fits(k) {
            Some((true, result)) => fit = Some((k, result)),
            other => {
                over = Some((k, other.map(|(_, result)| result)));
                break;
            }
        }
        if k == max_k {
            break;
        }
        k = (k * 2).min(max_k);
    }
    while let (Some((low, _)), Some((high, _))) = (&fit, &over) {
        if high - low <= 1 {
            break;
        }
        let mid = (low + high) / 2;
        match fits(mid) {
            Some((true, result)) => fit = Some((mid, result)),
            other => over = Some((mid, other.map(|(_, result)| result))),
        }
    }
    (fit.map(|(_, v)| v), over.and_then(|(_, v)| v))
}

/// The device of `backend` ready for trials: its name for the report and, on CUDA, its free
/// memory in bytes; why not, when there is none or no memory count.
fn open_device(backend: DeviceKind) -> Result<(String, Option<u64>), String> {
    match backend {
        DeviceKind::Wgpu => {
            // The adapter first: it initialises the device with Burn's own options, which the
            // first use of the device (the memory count below) would otherwise do.
            let adapter = adapter::wgpu_adapter().map_err(|reason| {
                format!(
                    "no wgpu adapter ({reason}). Install a Vulkan driver (Mesa's lavapipe: \
                     apt-get install mesa-vulkan-drivers) to run it."
                )
            })?;
            if burn_zero_kernels::device_memory::<Wgpu>(&WgpuDevice::default()).is_none() {
                return Err(
                    "built without the wgpu kernels, so there is no device-memory \
                            count: cargo bench --bench largest_model --features wgpu"
                        .into(),
                );
            }
            Ok((adapter, None))
        }
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            let device = CudaDevice::new(0);
            match burn_zero_comm::device_capacity::<Cuda>(&device) {
                Some(Ok(capacity)) => {
                    let name = format!(
                        "CUDA device 0 ({:.0} MiB, {:.0} MiB free)",
                        mib(capacity.total),
                        mib(capacity.free)
                    );
                    Ok((name, Some(capacity.free)))
                }
                Some(Err(error)) => Err(format!("no CUDA device: {error}")),
                None => Err("no CUDA device: the backend is not CUDA's".into()),
            }
        }
    }
}

type Row = (Side, Option<Value>, Option<Value>);

fn render(rows: &[Row], budget: u64, judge: Judge, adapter: &str) -> (String, Value) {
    let mut md = format!(
        "Largest GPT under a device budget of {:.0} MiB ({}, all streams, sampled every 5 ms \
         over {} steps), 1 rank, f32, {} × {SEQ_LEN} tokens a step, tokens/s over \
         the last {TIMED}, on {adapter}:\n\n",
        mib(budget),
        judge.describe(),
        steps(),
        batch()
    );
    md += "| placement | largest k | parameters | peak reserved MiB | peak in use MiB | tokens/s | uploads per step (MiB) | next size (k+1) judged peak MiB | × plain Burn's parameters |\n";
    md += "|---|---|---|---|---|---|---|---|---|\n";
    // Each side against plain Burn with the same checkpointing.
    let plain = |checkpointed: bool| {
        let base = match checkpointed {
            true => Side::PlainBurnCheckpointed,
            false => Side::PlainBurn,
        };
        rows.iter()
            .find(|(side, ..)| *side == base)
            .and_then(|(_, fit, _)| fit.as_ref())
            .and_then(|fit| fit["parameters"].as_u64())
    };
    let mut entries = Vec::new();
    for (side, fit, over) in rows {
        let cell = |v: &Option<Value>, key: &str| v.as_ref().map(|v| v[key].clone());
        let parameters = cell(fit, "parameters").and_then(|v| v.as_u64());
        let ratio = match (parameters, plain(side.checkpointed())) {
            (Some(p), Some(base)) if base > 0 => format!("{:.2}", p as f64 / base as f64),
            _ => "—".into(),
        };
        let show_mib = |v: Option<Value>| {
            v.and_then(|v| v.as_u64())
                .map_or("—".into(), |b| format!("{:.1}", mib(b)))
        };
        let uploads = fit.as_ref().map_or("—".into(), |v| {
            let placement = &v["placement"];
            match (
                placement["uploads_per_step"].as_f64(),
                placement["upload_bytes_per_step"].as_f64(),
            ) {
                (Some(n), Some(bytes)) => format!("{n:.0} ({:.1} MiB)", bytes / 1048576.0),
                _ => "—".into(),
            }
        });
        md += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            side.describe(),
            cell(fit, "k").map_or("none fits".into(), |v| v.to_string()),
            parameters.map_or("—".into(), |p| p.to_string()),
            show_mib(cell(fit, "peak_reserved_bytes")),
            show_mib(cell(fit, "peak_in_use_bytes")),
            cell(fit, "tokens_per_s")
                .and_then(|v| v.as_f64())
                .map_or("—".into(), |t| format!("{t:.0}")),
            uploads,
            show_mib(cell(over, judge.key())),
            ratio,
        );
        entries.push(json!({ "side": side.name(), "largest": fit, "next_over_budget": over }));
    }
    let json = json!({
        "budget_bytes": budget,
        "judged_by": judge.key(),
        "adapter": adapter,
        "batch": batch(),
        "seq_len": SEQ_LEN,
        "steps": steps(),
        "sides": entries,
    });
    (md, json)
}
