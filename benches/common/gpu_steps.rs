//! Step time of the GPU check, shared by the burn-zero side (`benches/gpu_steps.rs`) and the
//! plain-Burn side (`benches/plain-burn/benches/plain_gpu.rs`): the scaling suite's GPT step
//! (`workload.rs`) on one GPU, timed step by step with the device synchronised after each step,
//! so a time covers all the work the step queued. Each side is its own process (the runner
//! alternates them); each prints one JSON object and writes it to `--out`.

use std::path::PathBuf;
use std::time::Instant;

use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;

use crate::workload;
use burn::module::Module;
use burn::tensor::DType;
use burn_zero_gpt::{CastParams, Corpus, Gpt, Preset};

/// The parameters' dtype.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
}

impl Precision {
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// The command line both sides share.
#[derive(clap::Args, Debug, Clone)]
pub struct StepArgs {
    /// The model: `small` (the scaling suite's, 1.8M parameters) or `gpt2` (GPT-2 small's
    /// shape: 12 blocks of width 768, 12 heads).
    #[arg(long, default_value = "small")]
    pub preset: Preset,
    /// Characters per sequence (default: the scaling suite's 64).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Sequences per step (default: the scaling suite's 16).
    #[arg(long)]
    pub batch: Option<usize>,
    /// The parameters' dtype, Burn's and burn-zero's alike: `f32` or `bf16`.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
    /// Untimed steps first (kernel compilation, allocator warm-up, Adam's state).
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Where to write the JSON result.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

impl StepArgs {
    /// The step's shape.
    pub fn shape(&self) -> workload::Shape {
        workload::Shape {
            preset: self.preset,
            seq_len: self.seq_len.unwrap_or(workload::SEQ_LEN),
            global_batch: self.batch.unwrap_or(workload::GLOBAL_BATCH),
        }
    }
}

/// The initial model of `args`'s shape, in its precision.
pub fn model<B: AutodiffBackend>(args: &StepArgs, corpus: &Corpus, device: &B::Device) -> Gpt<B> {
    let model = workload::model_shaped::<B>(&args.shape(), corpus, device);
    match args.precision {
        Precision::F32 => model,
        precision => model.map(&mut CastParams(precision.dtype())),
    }
}

/// Seconds of each timed step, and the model after them.
// Each side includes this file as its own module and uses one of the two.
#[allow(dead_code)]
pub fn time_steps<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    model: Gpt<B>,
    optimizer: &mut O,
    corpus: &Corpus,
    args: &StepArgs,
    device: &B::Device,
) -> Result<(Gpt<B>, Vec<f64>), String> {
    time_steps_with(model, optimizer, corpus, args, device, || {})
}

/// [`time_steps`], calling `timed_start` once the warm-up steps are done and the device is
/// synchronised, just before the first timed step (where a caller snapshots its counters).
pub fn time_steps_with<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    mut model: Gpt<B>,
    optimizer: &mut O,
    corpus: &Corpus,
    args: &StepArgs,
    device: &B::Device,
    timed_start: impl FnOnce(),
) -> Result<(Gpt<B>, Vec<f64>), String> {
    let sync = || B::sync(device).map_err(|e| format!("synchronising the device: {e:?}"));
    let shape = args.shape();
    for step in 0..args.warmup {
        model = workload::step_shaped(&shape, model, optimizer, corpus, step, 0, 1, device);
    }
    sync()?;
    timed_start();
    let mut seconds = Vec::with_capacity(args.steps);
    for step in args.warmup..args.warmup + args.steps {
        let started = Instant::now();
        model = workload::step_shaped(&shape, model, optimizer, corpus, step, 0, 1, device);
        sync()?;
        seconds.push(started.elapsed().as_secs_f64());
    }
    Ok((model, seconds))
}

/// One more step after the warm-up and timed ones, the device synchronised after it: the step
/// a launch count (`--count-launches`) counts.
pub fn one_more_step<B: AutodiffBackend, O: Optimizer<Gpt<B>, B>>(
    model: Gpt<B>,
    optimizer: &mut O,
    corpus: &Corpus,
    args: &StepArgs,
    device: &B::Device,
) {
    let index = args.warmup + args.steps;
    let _model =
        workload::step_shaped(&args.shape(), model, optimizer, corpus, index, 0, 1, device);
    let _ = B::sync(device);
}

/// The fields every result has: the workload, the step times and their median.
pub fn result(
    side: &str,
    backend: &str,
    parameters: usize,
    args: &StepArgs,
    seconds: &[f64],
) -> serde_json::Value {
    let shape = args.shape();
    serde_json::json!({
        "side": side,
        "backend": backend,
        "preset": shape.preset.name(),
        "precision": args.precision.name(),
        "parameters": parameters,
        "global_batch": shape.global_batch,
        "seq_len": shape.seq_len,
        "median_step_s": workload::median(seconds),
        "fastest_step_s": seconds.iter().copied().fold(f64::INFINITY, f64::min),
        "samples_step_s": seconds,
    })
}

/// Prints `value` and writes it to `--out` when given.
pub fn emit(args: &StepArgs, value: &serde_json::Value) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).expect("json");
    println!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}
