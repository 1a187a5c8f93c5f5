//! The largest GPT whose training step fits a device-memory budget, one rank on wgpu with
//! Burn's fusion layer (`Fusion<CubeBackend<WgpuRuntime>>`, what `burn::backend::Wgpu` is with
//! Burn's default features; Mesa's lavapipe on a machine without a GPU), for each way of
//! placing the model state:
//!
//! - plain Burn: the unsharded model with Burn's Adam, everything on the device (16 bytes of
//!   model state per f32 parameter; on `Autodiff<Zero<Wgpu>>`, whose ops go straight to the
//!   backend for a model that is not sharded);
//! - stage 3: `Autodiff<Zero<Wgpu>>` with `ZeroOptimizer::adam`, masters and moments on the
//!   device (at one rank the same 16 bytes, plus the bucket and gather buffers);
//! - stage 3, optimizer on the host: `ZeroOptimizer::offloaded` with the fused Adam on Flex
//!   (`Offload<Flex>`): the device holds parameters and gradients, the host the fp32 masters and
//!   both moments;
//! - stage 3, parameters on the host too: the same optimizer, and every parameter shard in host
//!   memory (`offload_param_frac` 1) with no gather cache (`max_live_gathered_bytes` 0): the
//!   device holds a parameter only while an op uses it, and the gradients;
//! - stage 3, optimizer on the host, auto placement: the same, with `auto_placement_capacity_mib`
//!   set to the budget instead of every shard on the host: after two warm-up steps the shards
//!   that fit move to the device.
//!
//! The models keep depth and width in one ratio (`k` blocks of width 64·k, `k` heads of 64,
//! MLP 4× wide) and train on the same micro-batch (8 sequences of 64 characters), so the
//! activations grow with the model alike on every side. "Fits" is judged by cubecl's own
//! count of the device memory it has reserved (or, with `LARGEST_JUDGE=in_use`, of its bytes
//! in use, the count the auto placement plans with), summed over every stream of the device
//! (`burn_zero_kernels::device_memory`), sampled every 5 ms by a thread of its own while four
//! training steps run, the largest sample kept: the same independent measurement for every
//! side, none of it burn-zero's accounting. Each trial runs in a child process of its own (this
//! bench executable with `--trial`), so that no pool of an earlier trial is counted.
//!
//! For each side, `k` grows from 1 until a trial exceeds the budget; the report gives the
//! largest `k` that fit, its parameters, its measured peak and its tokens per second (over the
//! last two steps, after the auto placement's two warm-up steps).
//!
//! Environment: `LARGEST_BUDGET_MIB` (default 128), `LARGEST_MAX_K` (default 12),
//! `LARGEST_SIDES` (the sides to run, by name, comma-separated; default all), `LARGEST_JUDGE`
//! (`reserved`, the default, or `in_use`).
//! `cargo bench --bench largest_model --features wgpu`; without `--features wgpu` there is no
//! device-memory count and the bench says so.

#[path = "common/adapter.rs"]
mod adapter;
#[path = "common/report.rs"]
mod report;

use std::process::Command;
use std::time::{Duration, Instant};

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn_fusion::Fusion;
use burn_zero::comm::launch;
use burn_zero::optim::FusedAdam;
use burn_zero::optim::Offload;
use burn_zero::{Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard};
use burn_zero_gpt::{Corpus, Gpt, GptConfig, Materialise, TEXT};
use burn_zero_kernels::peak_device_memory;
use serde_json::{Value, json};

/// wgpu as Burn's default features build it: the fusion layer over the cubecl backend.
type Wgpu = Fusion<CubeBackend<WgpuRuntime, f32, i32, u32>>;

/// Sequences per step and characters per sequence: the same for every model and side.
const BATCH: usize = 8;
const SEQ_LEN: usize = 64;
/// Steps per trial, and the last of them that are timed (the auto placement's warm-up is the
/// first two).
const STEPS: usize = 4;
const TIMED: usize = 2;
const LR: f64 = 1e-3;
const SEED: u64 = 2024;
/// How often the sampler reads the device's memory.
const SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// Where the model state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    PlainBurn,
    Stage3,
    Stage3OptimizerOnHost,
    Stage3ParametersOnHost,
    Stage3AutoPlacement,
}

impl Side {
    const ALL: [Side; 5] = [
        Side::PlainBurn,
        Side::Stage3,
        Side::Stage3OptimizerOnHost,
        Side::Stage3ParametersOnHost,
        Side::Stage3AutoPlacement,
    ];

    fn name(self) -> &'static str {
        match self {
            Side::PlainBurn => "plain-burn",
            Side::Stage3 => "stage3",
            Side::Stage3OptimizerOnHost => "stage3-optimizer-on-host",
            Side::Stage3ParametersOnHost => "stage3-parameters-on-host",
            Side::Stage3AutoPlacement => "stage3-auto-placement",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Side::PlainBurn => "plain Burn (Adam)",
            Side::Stage3 => "stage 3",
            Side::Stage3OptimizerOnHost => "stage 3, optimizer on the host",
            Side::Stage3ParametersOnHost => "stage 3, optimizer and parameters on the host",
            Side::Stage3AutoPlacement => "stage 3, optimizer on the host, auto placement",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Side::ALL.into_iter().find(|side| side.name() == name)
    }
}

/// The model of size `k`: `k` blocks of width 64·k.
fn config(k: usize, vocab: usize) -> GptConfig {
    let width = 64 * k;
    GptConfig::new(vocab, SEQ_LEN, width, k, k, 4 * width)
}

fn model<B: AutodiffBackend>(k: usize, corpus: &Corpus, device: &B::Device) -> Gpt<B> {
    B::seed(device, SEED);
    let model = config(k, corpus.vocab()).init(device);
    model.visit(&mut Materialise);
    model
}

/// `STEPS` training steps of `model` with `optimizer`; the seconds of the last `TIMED`.
fn train<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    mut model: Gpt<B>,
    optimizer: &mut O,
    corpus: &Corpus,
    device: &B::Device,
) -> f64 {
    let mut started = Instant::now();
    for step in 0..STEPS {
        if step == STEPS - TIMED {
            started = Instant::now();
        }
        let (inputs, targets) = corpus.batch::<B>(SEED, step, 0..BATCH, SEQ_LEN, device);
        let loss = model.loss(inputs, targets);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(LR, model, grads);
        B::sync(device).expect("the device syncs");
    }
    started.elapsed().as_secs_f64()
}

/// One trial, in this (child) process: prints one JSON line.
fn trial(side: Side, k: usize) {
    let device = WgpuDevice::default();
    let corpus = Corpus::new(TEXT);
    // Counted on the host: nothing of the trial's side is on the device before it starts.
    let parameters = config(k, corpus.vocab())
        .init::<Flex>(&Default::default())
        .num_params();
    let (seconds, peak) = peak_device_memory::<Wgpu, _>(&device, SAMPLE_EVERY, || match side {
        Side::PlainBurn => {
            // Not sharded: `Zero` forwards every op of an unsharded model to the backend
            // (Burn's autodiff needs a backend with its distributed operations, which `Zero`
            // is), so this is Burn's own training, holding its own memory.
            let model = model::<Autodiff<Zero<Wgpu>>>(k, &corpus, &device);
            let mut adam = AdamConfig::new().init();
            train(model, &mut adam, &corpus, &device)
        }
        Side::Stage3
        | Side::Stage3OptimizerOnHost
        | Side::Stage3ParametersOnHost
        | Side::Stage3AutoPlacement => {
            let config = match side {
                Side::Stage3ParametersOnHost => ZeroConfig::new()
                    .with_stage(3)
                    .with_offload_param_frac(1.0)
                    .with_max_live_gathered_bytes(0),
                Side::Stage3AutoPlacement => ZeroConfig::new()
                    .with_stage(3)
                    .with_auto_placement_capacity_mib(Some(mib(budget())))
                    .with_max_live_gathered_bytes(0),
                _ => ZeroConfig::new().with_stage(3),
            };
            let mut ranks =
                launch::<Wgpu, _, _, ZeroError>(1, std::slice::from_ref(&device), |ctx| {
                    let base = model::<Autodiff<Zero<Wgpu>>>(k, &corpus, ctx.device());
                    let (model, zero) = shard(base, &ctx, &config)?;
                    let adam = AdamConfig::new();
                    Ok(if side == Side::Stage3 {
                        let mut optimizer =
                            ZeroOptimizer::adam(&zero, &adam).expect("valid config");
                        train(model, &mut optimizer, &corpus, ctx.device())
                    } else {
                        let fused = FusedAdam::new(&adam).expect("valid config");
                        let mut optimizer =
                            ZeroOptimizer::<_, _, Offload<Flex>>::offloaded(&zero, fused)
                                .with_one_pass();
                        train(model, &mut optimizer, &corpus, ctx.device())
                    })
                })
                .expect("one rank trains");
            ranks.swap_remove(0)
        }
    });
    let peak = peak.expect("built with --features wgpu");
    let tokens = (TIMED * BATCH * SEQ_LEN) as f64;
    let line = json!({
        "side": side.name(),
        "k": k,
        "parameters": parameters,
        "peak_reserved_bytes": peak.reserved,
        "peak_in_use_bytes": peak.in_use,
        "tokens_per_s": tokens / seconds,
    });
    println!("{line}");
}

/// Runs one trial in a child process; `None` when it failed (for instance out of memory).
fn run_trial(side: Side, k: usize) -> Option<Value> {
    let exe = std::env::current_exe().expect("the bench knows its executable");
    let output = Command::new(exe)
        .args(["--trial", side.name(), &k.to_string()])
        .output()
        .expect("the bench can run itself");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{'));
    match (output.status.success(), line) {
        (true, Some(line)) => serde_json::from_str(line).ok(),
        _ => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
            eprintln!("  {} k={k}: the trial failed: {tail:?}", side.name());
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
    if let Some(at) = args.iter().position(|a| a == "--trial") {
        let side = Side::parse(&args[at + 1]).expect("a side's name");
        let k = args[at + 2].parse().expect("a size");
        trial(side, k);
        return;
    }
    // `cargo test --benches` runs bench targets without `--bench`; only `cargo bench` measures.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    // The adapter first: it initialises the device with Burn's own options, which the first
    // use of the device (the memory count below) would otherwise do.
    let adapter = match adapter::wgpu_adapter() {
        Ok(adapter) => adapter,
        Err(reason) => {
            eprintln!(
                "largest_model: no wgpu adapter ({reason}). Install a Vulkan driver (Mesa's \
                 lavapipe: apt-get install mesa-vulkan-drivers) to run it."
            );
            return;
        }
    };
    if burn_zero_kernels::device_memory::<Wgpu>(&WgpuDevice::default()).is_none() {
        eprintln!(
            "largest_model: built without the wgpu kernels, so there is no device-memory count: \
             cargo bench --bench largest_model --features wgpu"
        );
        return;
    }
    let budget = budget();
    let judge = Judge::from_env();
    let max_k = env_number("LARGEST_MAX_K", 12);
    // `LARGEST_SIDES`: the sides to run, by name, comma-separated (default: all).
    let chosen = std::env::var("LARGEST_SIDES").ok();
    let sides = Side::ALL.into_iter().filter(|side| {
        chosen
            .as_deref()
            .is_none_or(|names| names.split(',').any(|n| n.trim() == side.name()))
    });
    let mut rows = Vec::new();
    for side in sides {
        let mut fit: Option<Value> = None;
        let mut over: Option<Value> = None;
        for k in 1..=max_k {
            let Some(result) = run_trial(side, k) else {
                break;
            };
            let peak = result[judge.key()].as_u64().unwrap_or(u64::MAX);
            eprintln!(
                "  {} k={k}: {} parameters, peak {:.1} MiB",
                side.name(),
                result["parameters"],
                mib(peak)
            );
            if peak > budget {
                over = Some(result);
                break;
            }
            fit = Some(result);
        }
        rows.push((side, fit, over));
    }
    let (md, json) = render(&rows, budget, judge, &adapter);
    report::publish("largest_model", &md, Some(&json));
}

type Row = (Side, Option<Value>, Option<Value>);

fn render(rows: &[Row], budget: u64, judge: Judge, adapter: &str) -> (String, Value) {
    let mut md = format!(
        "Largest GPT under a device budget of {:.0} MiB ({}, all streams, sampled every 5 ms \
         over {STEPS} steps), 1 rank, f32, {BATCH} × {SEQ_LEN} tokens a step, tokens/s over \
         the last {TIMED}, on {adapter}:\n\n",
        mib(budget),
        judge.describe()
    );
    md += "| placement | largest k | parameters | peak reserved MiB | peak in use MiB | tokens/s | next size (k+1) judged peak MiB | × plain Burn's parameters |\n";
    md += "|---|---|---|---|---|---|---|---|\n";
    let plain = rows
        .iter()
        .find(|(side, ..)| *side == Side::PlainBurn)
        .and_then(|(_, fit, _)| fit.as_ref())
        .and_then(|fit| fit["parameters"].as_u64());
    let mut entries = Vec::new();
    for (side, fit, over) in rows {
        let cell = |v: &Option<Value>, key: &str| v.as_ref().map(|v| v[key].clone());
        let parameters = cell(fit, "parameters").and_then(|v| v.as_u64());
        let ratio = match (parameters, plain) {
            (Some(p), Some(base)) if base > 0 => format!("{:.2}", p as f64 / base as f64),
            _ => "—".into(),
        };
        let show_mib = |v: Option<Value>| {
            v.and_then(|v| v.as_u64())
                .map_or("—".into(), |b| format!("{:.1}", mib(b)))
        };
        md += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            side.describe(),
            cell(fit, "k").map_or("none fits".into(), |v| v.to_string()),
            parameters.map_or("—".into(), |p| p.to_string()),
            show_mib(cell(fit, "peak_reserved_bytes")),
            show_mib(cell(fit, "peak_in_use_bytes")),
            cell(fit, "tokens_per_s")
                .and_then(|v| v.as_f64())
                .map_or("—".into(), |t| format!("{t:.0}")),
            show_mib(cell(over, judge.key())),
            ratio,
        );
        entries.push(json!({ "side": side.name(), "largest": fit, "next_over_budget": over }));
    }
    let json = json!({
        "budget_bytes": budget,
        "judged_by": judge.key(),
        "adapter": adapter,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "steps": STEPS,
        "sides": entries,
    });
    (md, json)
}
