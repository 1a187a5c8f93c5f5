//! The plain-Burn baseline of the scaling suite: one GPT `small` training step (forward,
//! backward, Adam) on `Autodiff<NdArray>` with Burn's own optimizer, on one thread, with the
//! whole global batch. Criterion times it; the median seconds per step go to
//! `target/bench-reports/plain.json` for `tools/scaling-report` (`PLAIN_REPORT=name`
//! writes `name.json` instead).

#[path = "../../common/workload.rs"]
mod workload;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::optim::AdamConfig;
use criterion::{Criterion, SamplingMode};

type Train = Autodiff<NdArray>;

/// Every (iterations, elapsed) criterion asked for, warm-up first.
static CALLS: Mutex<Vec<(u64, Duration)>> = Mutex::new(Vec::new());

fn main() {
    // A burn-zero rank steps on a spawned thread; so does the baseline.
    std::thread::spawn(run).join().expect("bench thread");
}

fn run() {
    let mut criterion = Criterion::default().configure_from_args();
    let device = Default::default();
    let corpus = workload::corpus();
    let model = workload::model::<Train>(&corpus, &device);
    let parameters = model.parameters();
    let mut optimizer = AdamConfig::new().init();
    // The first step creates Adam's state; it is not timed.
    let model = workload::step(model, &mut optimizer, &corpus, 0, 0, 1, &device);
    // A few steps timed phase by phase, as the burn-zero bench does.
    let (model, phases) = workload::timed_phases(model, &mut optimizer, &corpus, 1, 0, 1, &device);
    let mut model = Some(model);
    let mut next = 1 + workload::PHASE_STEPS;

    let mut group = criterion.benchmark_group("scaling");
    group
        .sample_size(workload::SAMPLES)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(workload::WARM_UP)
        .measurement_time(workload::MEASUREMENT);
    group.bench_function("plain_burn", |b| {
        b.iter_custom(|iters| {
            let started = Instant::now();
            for _ in 0..iters {
                let taken = model.take().expect("the model");
                model = Some(workload::step(
                    taken,
                    &mut optimizer,
                    &corpus,
                    next,
                    0,
                    1,
                    &device,
                ));
                next += 1;
            }
            let elapsed = started.elapsed();
            CALLS.lock().unwrap().push((iters, elapsed));
            elapsed
        })
    });
    group.finish();
    criterion.final_summary();

    let samples = workload::per_step_samples(&CALLS.lock().unwrap());
    let (cpu, cpus, memory_bytes, unix_time) = workload::machine();
    let report = serde_json::json!({
        "backend": "Autodiff<NdArray>",
        "optimizer": "Burn's Adam (OptimizerAdaptor)",
        "preset": workload::PRESET.name(),
        "parameters": parameters,
        "global_batch": workload::GLOBAL_BATCH,
        "seq_len": workload::SEQ_LEN,
        "median_step_s": workload::median(&samples),
        "samples_step_s": samples,
        "phases_ms": workload::phases_json(&phases.median),
        "phases_fastest_ms": workload::phases_json(&phases.fastest),
        "machine": { "cpu": cpu, "logical_cpus": cpus, "memory_bytes": memory_bytes },
        "unix_time": unix_time,
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-reports");
    workload::write_report(&dir, "PLAIN_REPORT", "plain", &report);
}
