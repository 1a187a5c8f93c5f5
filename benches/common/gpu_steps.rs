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
use burn_zero_gpt::{Corpus, Gpt};

/// The command line both sides share.
#[derive(clap::Args, Debug, Clone)]
pub struct StepArgs {
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
    for step in 0..args.warmup {
        model = workload::step(model, optimizer, corpus, step, 0, 1, device);
    }
    sync()?;
    timed_start();
    let mut seconds = Vec::with_capacity(args.steps);
    for step in args.warmup..args.warmup + args.steps {
        let started = Instant::now();
        model = workload::step(model, optimizer, corpus, step, 0, 1, device);
        sync()?;
        seconds.push(started.elapsed().as_secs_f64());
    }
    Ok((model, seconds))
}

/// The fields every result has: the workload, the step times and their median.
pub fn result(side: &str, backend: &str, parameters: usize, seconds: &[f64]) -> serde_json::Value {
    serde_json::json!({
        "side": side,
        "backend": backend,
        "preset": workload::PRESET.name(),
        "parameters": parameters,
        "global_batch": workload::GLOBAL_BATCH,
        "seq_len": workload::SEQ_LEN,
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
