//! Kernel launches per training step against plain Burn: GPT `small` (the scaling suite's
//! step, `common/workload.rs`), one rank on the plain `CubeBackend<WgpuRuntime>` (Mesa's
//! lavapipe on a machine without a GPU), every launch on the device counted from cubecl's
//! execution log (`burn_zero_kernels::LaunchLog`): Burn's ops, autodiff's and burn-zero's
//! kernels together, in three windows per step (forward to the loss, backward, optimizer step),
//! each ended by a device sync. Counts are exact and the same on every run; a GPU pays a fixed
//! host cost for each launch, which on a model this small is most of its step.
//!
//! Sides, each counted on its third step (the first two make the optimizer's state and the
//! first shards a step writes):
//! - plain Burn: `Autodiff<CubeBackend<WgpuRuntime>>` with Burn's Adam, no burn-zero;
//! - stage 0 and stage 3 with one parameter per chunk, and stage 3 with the searched chunk
//!   size, every parameter sharded, each with `ZeroOptimizer` over Burn's Adam and with the
//!   fused Adam (`ZeroOptimizer::adam`);
//! - with the fused Adam, replicated chunks, whose gradients come member by member and are
//!   joined for the step: stage 0 with the searched size, and stage 3 with the searched size
//!   and the default persistence threshold (the small parameters replicated).
//!
//! Prints the launches per window and per kernel, with each sharded side's own counts of the
//! step (collectives, of them answered in place, device synchronisations), and checks the
//! targets (PASS or FAIL): the searched chunks with the fused Adam launch no more kernels per
//! step than plain Burn, and no more than stage 0 with the fused Adam plus one launch per chunk
//! for its gather and one for its reduction; stage 0's searched chunks launch no more than
//! its one parameter per chunk; and a rank alone synchronises the device once per reduced
//! bucket and for no gather (its collectives are answered in place). Writes
//! `target/bench-reports/launches.md` and `launches.json`.
//!
//! `cargo bench --bench launches --features wgpu` (about a minute after the build). Without a
//! wgpu adapter it says how to get one and exits.

#[path = "common/adapter.rs"]
mod adapter;
#[path = "common/report.rs"]
mod report;
#[path = "common/workload.rs"]
mod workload;

use std::collections::BTreeMap;

use burn::backend::Autodiff;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_zero::comm::{Counts, launch};
use burn_zero::{ChunkSize, PerTensor, Zero, ZeroConfig, ZeroOptimizer, shard};
use burn_zero_gpt::{Corpus, Gpt};
use burn_zero_kernels::LaunchLog;
use serde_json::json;

type Inner = CubeBackend<WgpuRuntime, f32, i32, u32>;
type Train = Autodiff<Zero<Inner>>;
/// Plain Burn: its autodiff straight over the same backend, no burn-zero.
type Plain = Autodiff<Inner>;

/// The windows of a step.
const WINDOWS: [&str; 3] = ["forward", "backward", "step"];

/// One side's launches in its counted step: per window, the kernels by name.
struct Side {
    name: String,
    chunks: Option<usize>,
    windows: [BTreeMap<String, usize>; 3],
    /// burn-zero's counts of the counted step (sharded sides).
    counts: Option<Counts>,
}

impl Side {
    fn window(&self, index: usize) -> usize {
        self.windows[index].values().sum()
    }

    fn total(&self) -> usize {
        (0..3).map(|i| self.window(i)).sum()
    }
}

/// The kernel's name in a log line (`Executing <name>…`).
fn kernel_name(line: &str) -> String {
    line.trim_start_matches("Executing ")
        .split(['<', ' ', '(', '{', '\n'])
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The launches of a step's windows.
type Windows = [BTreeMap<String, usize>; 3];

/// Steps `model` twice, then counts the launches of a third step's windows, and what
/// `counts` (burn-zero's, on a sharded side) grew by in it.
fn counted_step<AB: AutodiffBackend<Device = WgpuDevice>, O: Optimizer<Gpt<AB>, AB>>(
    mut model: Gpt<AB>,
    optimizer: &mut O,
    corpus: &Corpus,
    device: &WgpuDevice,
    counts: &dyn Fn() -> Counts,
) -> (Windows, Counts) {
    for index in 0..2 {
        model = workload::step(model, optimizer, corpus, index, 0, 1, device);
    }
    let log = LaunchLog::install();
    let count = |work: &mut dyn FnMut()| {
        let ((), lines) = log
            .launches::<WgpuRuntime, _>(device, || {
                work();
                Inner::sync(device).expect("the device syncs");
            })
            .expect("the launches are counted");
        let mut kernels = BTreeMap::new();
        for line in &lines {
            *kernels.entry(kernel_name(line)).or_insert(0) += 1;
        }
        kernels
    };
    let before = counts();
    let mut loss = None;
    let forward = count(&mut || loss = Some(workload::loss(&model, corpus, 2, 0, 1, device)));
    let mut grads = None;
    let backward = count(&mut || {
        let loss = loss.take().expect("the forward ran");
        grads = Some(GradientsParams::from_grads(loss.backward(), &model));
    });
    let mut current = Some(model.clone());
    let step = count(&mut || {
        let (model, grads) = (current.take(), grads.take());
        let _ = optimizer.step(workload::LR, model.unwrap(), grads.unwrap());
    });
    ([forward, backward, step], counts() - before)
}

/// A sharded side: `stage` and `chunk_size`, every parameter sharded unless it has fewer than
/// `persist_below` elements, with Burn's Adam or the fused one.
fn sharded(
    device: &WgpuDevice,
    corpus: &Corpus,
    (stage, chunk_size, persist_below): (u8, ChunkSize, usize),
    fused: bool,
) -> Side {
    let config = ZeroConfig::new()
        .with_stage(stage)
        .with_persist_below_numel(persist_below)
        .with_chunk_size(chunk_size);
    let mut ranks = launch::<Inner, _, _, String>(1, std::slice::from_ref(device), |ctx| {
        let model = workload::model::<Train>(corpus, ctx.device());
        let (model, zero) = shard(model, &ctx, &config).map_err(|e| e.to_string())?;
        let chunks = zero.store().chunks().chunks().len();
        let counts = || zero.counts();
        let (windows, counts) = if fused {
            let mut optimizer =
                ZeroOptimizer::new(&zero, AdamConfig::new().clone()).map_err(|e| e.to_string())?;
            counted_step(model, &mut optimizer, corpus, ctx.device(), &counts)
        } else {
            let mut optimizer =
                ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
            counted_step(model, &mut optimizer, corpus, ctx.device(), &counts)
        };
        Ok((chunks, windows, counts))
    })
    .unwrap_or_else(|error| panic!("stage {stage}: {error}"));
    let (chunks, windows, counts) = ranks.swap_remove(0);
    let chunking = match chunk_size {
        ChunkSize::PerParameter => "one parameter per chunk",
        _ => "searched chunks",
    };
    let adam = if fused { "fused Adam" } else { "Burn's Adam" };
    let persisting = match persist_below {
        0 => String::new(),
        n => format!(", parameters under {n} elements replicated"),
    };
    Side {
        name: format!("stage {stage}, {chunking}{persisting}, {adam}"),
        chunks: Some(chunks),
        windows,
        counts: Some(counts),
    }
}

fn markdown(sides: &[Side], targets: &[(String, bool)]) -> String {
    let (cpu, cores, memory, _) = workload::machine();
    let memory = memory >> 30;
    let mut md = format!(
        "## Kernel launches per step against plain Burn\n\nGPT `small`, 1 rank, \
         `CubeBackend<WgpuRuntime>`, every parameter sharded; {cpu}, {cores} cores, \
         {memory} GiB. Collectives and device synchronisations: burn-zero's own counts of the \
         step.\n\n| side | chunks | forward | backward | step | total | × plain Burn | \
         collectives (in place) | device syncs |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    let plain = sides[0].total() as f64;
    for side in sides {
        let chunks = side.chunks.map_or("-".to_string(), |c| c.to_string());
        let (collectives, syncs) = side.counts.map_or(("-".into(), "-".into()), |c| {
            (
                format!("{} ({})", c.collectives(), c.in_place),
                c.syncs.to_string(),
            )
        });
        md += &format!(
            "| {} | {chunks} | {} | {} | {} | {} | {:.2} | {collectives} | {syncs} |\n",
            side.name,
            side.window(0),
            side.window(1),
            side.window(2),
            side.total(),
            side.total() as f64 / plain
        );
    }
    md += "\nLaunches by kernel (forward / backward / step):\n\n| kernel |";
    for side in sides {
        md += &format!(" {} |", side.name);
    }
    md += "\n|---|";
    md += &"---|".repeat(sides.len());
    md += "\n";
    let mut kernels: Vec<&String> = sides
        .iter()
        .flat_map(|s| s.windows.iter().flat_map(|w| w.keys()))
        .collect();
    kernels.sort();
    kernels.dedup();
    for kernel in kernels {
        md += &format!("| {kernel} |");
        for side in sides {
            let n = side
                .windows
                .each_ref()
                .map(|w| w.get(kernel).copied().unwrap_or(0));
            md += &format!(" {} / {} / {} |", n[0], n[1], n[2]);
        }
        md += "\n";
    }
    md += "\nTargets:\n\n";
    for (what, pass) in targets {
        md += &format!("- {}: {what}\n", if *pass { "PASS" } else { "FAIL" });
    }
    md
}

fn main() {
    // `cargo test --benches` runs bench targets without `--bench`; only `cargo bench` measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // cubecl's execution log, before any wgpu client exists.
    LaunchLog::install();
    if let Err(reason) = adapter::wgpu_adapter() {
        eprintln!(
            "launches: no wgpu adapter ({reason}); nothing measured. Install a Vulkan driver \
             (Mesa's lavapipe: apt-get install mesa-vulkan-drivers) to count launches."
        );
        return;
    }
    let device = WgpuDevice::default();
    let corpus = workload::corpus();
    let sides = all_sides(&device, &corpus);
    let targets = targets(&sides);
    let md = markdown(&sides, &targets);
    let json = report_json(&sides, &targets);
    report::publish("launches", &md, Some(&json));
}

/// Counts every side, in the order the report and the targets index them: plain Burn; stage
/// 0 and 3 per parameter and stage 3 searched, with Burn's Adam (1–3) and then the fused one
/// (4–6); then the replicated chunks with the fused Adam: stage 0 searched (7) and stage 3
/// searched with the default persistence threshold (8).
fn all_sides(device: &WgpuDevice, corpus: &Corpus) -> Vec<Side> {
    let mut sides = vec![plain_side(device, corpus)];
    let searched = ChunkSize::default_search();
    for fused in [false, true] {
        for layout in [
            (0, ChunkSize::PerParameter, 0),
            (3, ChunkSize::PerParameter, 0),
            (3, searched, 0),
        ] {
            sides.push(sharded(device, corpus, layout, fused));
        }
    }
    // Replicated chunks, whose gradients are joined for the step: stage 0's (every parameter
    // replicated) and stage 3's with the default persistence threshold.
    let persisting = ZeroConfig::new().persist_below_numel;
    for layout in [(0, searched, 0), (3, searched, persisting)] {
        sides.push(sharded(device, corpus, layout, true));
    }
    sides
}

/// The baseline side: plain Burn's autodiff over the same backend with Burn's Adam, no
/// burn-zero (so no counts of its own).
fn plain_side(device: &WgpuDevice, corpus: &Corpus) -> Side {
    let model = workload::model::<Plain>(corpus, device);
    let mut adam = AdamConfig::new().init();
    let (windows, _) = counted_step(model, &mut adam, corpus, device, &Counts::default);
    Side {
        name: "plain Burn, Burn's Adam".into(),
        chunks: None,
        windows,
        counts: None,
    }
}

/// The targets, each with whether it is met: the searched chunks with the fused Adam against
/// plain Burn and against stage 0 plus two launches per chunk, stage 0's replicated searched
/// chunks against its one parameter per chunk, and one device sync per reduced bucket.
fn targets(sides: &[Side]) -> Vec<(String, bool)> {
    let (plain, stage0, searched) = (&sides[0], &sides[4], &sides[6]);
    let replicated = &sides[7];
    let chunks = searched.chunks.unwrap_or_default();
    let mut targets = vec![
        (
            format!(
                "{}: {} launches a step against plain Burn's {}",
                searched.name,
                searched.total(),
                plain.total()
            ),
            searched.total() <= plain.total(),
        ),
        (
            format!(
                "{}: {} launches a step, at most {} ({}'s {} plus two per chunk, {chunks} \
                 chunks)",
                searched.name,
                searched.total(),
                stage0.total() + 2 * chunks,
                stage0.name,
                stage0.total()
            ),
            searched.total() <= stage0.total() + 2 * chunks,
        ),
        (
            format!(
                "{}: {} launches a step, at most {}'s {}",
                replicated.name,
                replicated.total(),
                stage0.name,
                stage0.total()
            ),
            replicated.total() <= stage0.total(),
        ),
    ];
    let counted: Vec<Counts> = sides.iter().filter_map(|s| s.counts).collect();
    let syncs: u64 = counted.iter().map(|c| c.syncs).sum();
    let buckets: u64 = counted
        .iter()
        .map(|c| c.reduce_scatters + c.all_reduces)
        .sum();
    targets.push((
        format!(
            "a rank alone synchronises the device for no bucket and no gather (no sampler \
             reads its memory): {syncs} synchronisations for {buckets} buckets over the \
             sharded sides"
        ),
        syncs == 0 && buckets > 0,
    ));
    targets
}

/// `launches.json`: the setup, each side's launches per window and its counts, and the
/// targets with their verdicts.
fn report_json(sides: &[Side], targets: &[(String, bool)]) -> serde_json::Value {
    json!({
        "preset": "small",
        "world_size": 1,
        "backend": "CubeBackend<WgpuRuntime>",
        "adapter": adapter::wgpu_adapter().ok(),
        "sides": sides.iter().map(|s| json!({
            "name": s.name,
            "chunks": s.chunks,
            "windows": WINDOWS.iter().zip(&s.windows).map(|(w, k)| (w.to_string(), json!(k)))
                .collect::<serde_json::Map<_, _>>(),
            "total": s.total(),
            "counts": s.counts,
        })).collect::<Vec<_>>(),
        "targets": targets.iter().map(|(what, pass)| json!({"what": what, "pass": pass}))
            .collect::<Vec<_>>(),
    })
}
