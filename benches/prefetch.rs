//! Exposed gather time with and without prefetch: GPT `small` (the scaling suite's workload),
//! ZeRO-3, 2 ranks (`LocalGroup` threads on Flex), every parameter sharded. "Exposed" is the
//! time the training thread waits for gathered parameters (`ZeroState::gather_stats`); with
//! prefetch the gathers run on the rank's issuing thread while the training thread computes.
//!
//! Two gather budgets: the default (every gathered parameter stays cached for the pass, so
//! only the forward gathers) and 2 MiB (about three of the largest weights: backward gathers
//! again). The depths are run in alternation, `ROUNDS` times, so that drift on a shared
//! machine falls on every side alike; the medians go to stdout and to
//! `target/bench-reports/prefetch.md` and `.json`.
//!
//! Not a criterion benchmark: what it reports is a counter the library keeps per step, not a
//! closure's duration. `cargo bench --bench prefetch`.

#[path = "common/report.rs"]
mod report;
#[path = "common/workload.rs"]
mod workload;

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::optim::AdamConfig;
use burn_zero::comm::launch;
use burn_zero::{PerTensor, Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard};

type Train = Autodiff<Zero<Flex>>;

const WORLD_SIZE: usize = 2;
const WARM_UP_STEPS: usize = 2;
const STEPS: usize = 8;
const ROUNDS: usize = 3;
const DEPTHS: [usize; 3] = [0, 1, 3];
const BUDGETS: [(&str, usize); 2] = [("default (512 MiB)", 512 << 20), ("2 MiB", 2 << 20)];

/// Per-step figures of one run, rank 0's view (both ranks wait for each other).
#[derive(Clone, Copy)]
struct Sample {
    exposed_ms: f64,
    step_ms: f64,
    gathers: f64,
    prefetched: f64,
}

fn run(config: &ZeroConfig) -> Sample {
    let samples = launch::<Flex, _, _, ZeroError>(WORLD_SIZE, &[Default::default()], |ctx| {
        let corpus = workload::corpus();
        let model = workload::model::<Train>(&corpus, ctx.device());
        let (mut model, zero) = shard(model, &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let (rank, n) = (ctx.rank(), ctx.world_size());
        for step in 0..WARM_UP_STEPS {
            model = workload::step(model, &mut optimizer, &corpus, step, rank, n, ctx.device());
        }
        let before = zero.gather_stats();
        let started = Instant::now();
        for step in WARM_UP_STEPS..WARM_UP_STEPS + STEPS {
            model = workload::step(model, &mut optimizer, &corpus, step, rank, n, ctx.device());
        }
        let elapsed = started.elapsed();
        let after = zero.gather_stats();
        let per_step = |d: Duration| d.as_secs_f64() * 1e3 / STEPS as f64;
        Ok(Sample {
            exposed_ms: per_step(after.exposed - before.exposed),
            step_ms: per_step(elapsed),
            gathers: (after.gathers - before.gathers) as f64 / STEPS as f64,
            prefetched: (after.prefetched - before.prefetched) as f64 / STEPS as f64,
        })
    })
    .expect("the run");
    samples[0]
}

struct Row {
    budget: &'static str,
    depth: usize,
    exposed_ms: f64,
    step_ms: f64,
    gathers_per_step: f64,
    prefetched_per_step: f64,
}

fn main() {
    // `cargo test --benches` runs bench targets with `--bench`-less arguments too; only
    // `cargo bench` (which passes `--bench`) measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let mut samples = vec![Vec::new(); BUDGETS.len() * DEPTHS.len()];
    for round in 0..ROUNDS {
        for (b, (_, bytes)) in BUDGETS.iter().enumerate() {
            for (d, &depth) in DEPTHS.iter().enumerate() {
                let config = ZeroConfig::new()
                    .with_stage(3)
                    .with_persist_below_numel(0)
                    .with_max_live_gathered_bytes(*bytes)
                    .with_prefetch(depth);
                let sample = run(&config);
                eprintln!(
                    "round {round}, budget {}, depth {depth}: exposed {:.2} ms/step, step {:.1} ms",
                    BUDGETS[b].0, sample.exposed_ms, sample.step_ms
                );
                samples[b * DEPTHS.len() + d].push(sample);
            }
        }
    }
    let mut rows = Vec::new();
    for (b, (budget, _)) in BUDGETS.iter().enumerate() {
        for (d, &depth) in DEPTHS.iter().enumerate() {
            let runs = &samples[b * DEPTHS.len() + d];
            let median =
                |f: fn(&Sample) -> f64| workload::median(&runs.iter().map(f).collect::<Vec<_>>());
            rows.push(Row {
                budget,
                depth,
                exposed_ms: median(|s| s.exposed_ms),
                step_ms: median(|s| s.step_ms),
                gathers_per_step: median(|s| s.gathers),
                prefetched_per_step: median(|s| s.prefetched),
            });
        }
    }
    let (cpu, cpus, mem_bytes, _) = workload::machine();
    let mut md = format!(
        "Gather prefetch, GPT small, ZeRO-3, {WORLD_SIZE} ranks (LocalGroup, Flex), median of \
         {ROUNDS} runs of {STEPS} steps; {cpu}, {cpus} CPUs, {:.0} GiB.\n\n\
         | gather budget | prefetch depth | gathers / step | prefetched / step | exposed gather ms / step | step ms | exposed vs depth 0 |\n\
         |---|---|---|---|---|---|---|\n",
        mem_bytes as f64 / (1u64 << 30) as f64
    );
    for row in &rows {
        let base = rows
            .iter()
            .find(|r| r.budget == row.budget && r.depth == 0)
            .map_or(f64::NAN, |r| r.exposed_ms);
        md.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} | {:.2} | {:.1} | {:.0}% |\n",
            row.budget,
            row.depth,
            row.gathers_per_step,
            row.prefetched_per_step,
            row.exposed_ms,
            row.step_ms,
            100.0 * row.exposed_ms / base
        ));
    }
    let rows: Vec<_> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "budget": r.budget,
                "depth": r.depth,
                "exposed_ms": r.exposed_ms,
                "step_ms": r.step_ms,
                "gathers_per_step": r.gathers_per_step,
                "prefetched_per_step": r.prefetched_per_step,
            })
        })
        .collect();
    let json = serde_json::json!({ "cpu": cpu, "cpus": cpus, "rows": rows });
    report::publish("prefetch", &md, Some(&json));
}
