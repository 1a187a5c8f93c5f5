//! Chunks against one parameter per chunk: GPT `small` and `base` (the scaling suite's step,
//! `common/workload.rs`) at ZeRO stage 3 on 2 ranks (`LocalGroup` threads sharing one device),
//! with `ChunkSize::PerParameter` and with the searched size (`ChunkSize::default_search()`),
//! on Flex and on the plain `CubeBackend<WgpuRuntime>` (Mesa's lavapipe on a machine without a
//! GPU: launches and synchronisations cost more there than on Flex, the closest to a GPU a CPU
//! machine has).
//!
//! Per configuration, rank 0's figures over the timed steps:
//! - collectives per step by kind, device synchronisations, host reads and host writes per
//!   step: differences of `ZeroState::counts()` divided by the steps, exact (burn-zero counts
//!   what it issues);
//! - on wgpu, the kernel launches of one more step per rank, every launch on the device
//!   counted from cubecl's execution log (`burn_zero_kernels::LaunchLog`, with `--features
//!   wgpu`): burn-zero's kernels, Burn's ops and autodiff's together. The log is on for the
//!   whole run (cubecl reads its configuration once), so the wgpu step times include a line
//!   written per launch: about 2,000 lines in a step of seconds on lavapipe, noise there;
//!   the GPU check counts launches in runs of their own for that reason;
//! - the chunk layout: sharded and replicated chunks, padding (`ChunkLayout::padding`);
//! - exposed gather time per step (`ZeroState::gather_stats`), the gathered peak and the model
//!   state (`ZeroState::memory_report`), and the step time.
//!
//! Both sides run in one launch: the two models are sharded on the same ranks (one
//! `RankContext`, as two modules of one training may be) and take their steps in turn, A B,
//! B A, …, each step timed to the end of its device work, so that the drift of a shared
//! machine falls on both sides alike, step by step (on 2 cores shared with other work, runs a
//! minute apart differed by 50%). Only one side runs at a time, so the rank's counts between
//! two snapshots around a step are that step's. The step-time ratio (searched /
//! per-parameter) is taken per round of `steps` steps a side and reported as min, median and
//! max. The chunk targets are checked against the figures and printed PASS or FAIL.
//! Everything goes to stdout and to `target/bench-reports/chunks.md` and `chunks.json`.
//!
//! Every parameter of 1024 elements or more is sharded (`train_gpt`'s `--persist-below`
//! default), so biases and layer norms stay replicated and form replicated chunks; every other
//! setting is the library's default (25 MiB buckets, overlapped reduction, 512 MiB gather
//! budget, no prefetch).
//!
//! Environment: `CHUNKS_BACKENDS` (`flex,wgpu`), `CHUNKS_PRESETS` (`small,base`),
//! `CHUNKS_STEPS` and `CHUNKS_ROUNDS` (override every plan's), `CHUNKS_WGPU_PRESETS` (the
//! presets run on wgpu, default `small`: `base` on lavapipe takes minutes a step).
//! Without a wgpu adapter the wgpu rows say how to get one and the bench goes on.
//!
//! Not a criterion benchmark: what it reports are counters the library keeps per step and
//! paired runs. `cargo bench --bench chunks` (add `--features wgpu` for burn-zero's cubecl
//! pack kernels on wgpu; without it gradient buckets are packed with Burn ops there).

#[path = "common/adapter.rs"]
mod adapter;
#[path = "common/report.rs"]
mod report;
#[path = "common/workload.rs"]
mod workload;

use std::time::{Duration, Instant};

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::backend::{Autodiff, Flex};
use burn::optim::{AdamConfig, Optimizer};
use burn::tensor::backend::Backend;
use burn_zero::comm::{Counts, RankContext, launch};
use burn_zero::core::chunk::{ChunkKind, ChunkLayout};
use burn_zero::{
    ChunkSize, MemoryReport, PerTensor, Zero, ZeroConfig, ZeroOptimizer, ZeroState, shard,
};
use burn_zero_gpt::{Corpus, Gpt, Preset};
use serde_json::{Value, json};

/// wgpu without Burn's fusion layer.
type PlainWgpu = CubeBackend<WgpuRuntime, f32, i32, u32>;

const WORLD_SIZE: usize = 2;
const STAGE: u8 = 3;
/// `train_gpt`'s `--persist-below`: parameters under 1024 elements stay replicated.
const PERSIST_BELOW: usize = 1024;
const WARM_UP_STEPS: usize = 2;
/// f32: parameter 4, gradient 4, master 4, Adam's two moments 8 bytes per element.
const PARAM_BYTES: u64 = 4;
const GRAD_BYTES: u64 = 4;
const OPTIM_BYTES: u64 = 12;
/// Step time on Flex: searched no slower than per-parameter / 0.97.
const FLEX_RATIO_LIMIT: f64 = 1.0 / 0.97;

/// One parameter per chunk, or the searched size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    PerParameter,
    Searched,
}

impl Side {
    const BOTH: [Side; 2] = [Side::PerParameter, Side::Searched];

    fn name(self) -> &'static str {
        match self {
            Side::PerParameter => "per parameter",
            Side::Searched => "searched",
        }
    }

    fn chunk_size(self) -> ChunkSize {
        match self {
            Side::PerParameter => ChunkSize::PerParameter,
            Side::Searched => ChunkSize::default_search(),
        }
    }

    fn config(self) -> ZeroConfig {
        ZeroConfig::new()
            .with_stage(STAGE)
            .with_persist_below_numel(PERSIST_BELOW)
            .with_chunk_size(self.chunk_size())
    }
}

/// The device the ranks share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Flex,
    Wgpu,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Flex => "flex",
            Kind::Wgpu => "wgpu",
        }
    }
}

/// What one configuration runs: its steps and rounds.
#[derive(Debug, Clone, Copy)]
struct Plan {
    kind: Kind,
    preset: Preset,
    steps: usize,
    rounds: usize,
}

/// The chunk layout in numbers (rank 0's; ranks agree on it, `shard` checks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    sharded_chunks: usize,
    replicated_chunks: usize,
    /// Elements of padding over all ranks: each sharded member's round-up to whole blocks.
    padding: usize,
    /// Ψ: elements of every parameter.
    parameters: usize,
    /// Elements of sharded and of replicated parameters.
    sharded_parameters: usize,
    replicated_parameters: usize,
    /// Elements one rank holds of the sharded chunks: (Ψ_sharded + padding) / N.
    shard_elements: usize,
    /// Bytes of the largest sharded chunk once gathered.
    largest_chunk_bytes: usize,
    /// Elements a buffer sized to the largest sharded chunk would waste over all of them
    /// (`largest × chunks − Σ chunks`: what the search minimises).
    unevenness: usize,
}

impl Layout {
    fn of(chunks: &ChunkLayout, ranks: usize) -> Self {
        let of_kind = |kind| chunks.chunks().iter().filter(move |c| c.kind == kind);
        let gathered: Vec<usize> = of_kind(ChunkKind::Sharded)
            .map(|c| c.gathered_len(ranks))
            .collect();
        let widest = gathered.iter().copied().max().unwrap_or(0);
        let bytes = |c: &burn_zero::core::chunk::Chunk| c.gathered_len(ranks) * c.dtype.size();
        Self {
            sharded_chunks: chunks.count(ChunkKind::Sharded),
            replicated_chunks: chunks.count(ChunkKind::Replicated),
            padding: chunks.padding(ranks),
            parameters: chunks.chunks().iter().map(|c| c.numel()).sum(),
            sharded_parameters: of_kind(ChunkKind::Sharded).map(|c| c.numel()).sum(),
            replicated_parameters: of_kind(ChunkKind::Replicated).map(|c| c.numel()).sum(),
            shard_elements: of_kind(ChunkKind::Sharded).map(|c| c.shard_len).sum(),
            largest_chunk_bytes: of_kind(ChunkKind::Sharded).map(bytes).max().unwrap_or(0),
            unevenness: widest * gathered.len() - gathered.iter().sum::<usize>(),
        }
    }

    fn json(&self) -> Value {
        json!({
            "sharded_chunks": self.sharded_chunks,
            "replicated_chunks": self.replicated_chunks,
            "padding_elements": self.padding,
            "parameters": self.parameters,
            "sharded_parameters": self.sharded_parameters,
            "replicated_parameters": self.replicated_parameters,
            "shard_elements_per_rank": self.shard_elements,
            "largest_chunk_bytes": self.largest_chunk_bytes,
            "unevenness_elements": self.unevenness,
        })
    }

    /// Model state by the stage-3 formula in f32: (4+4+12)(Ψ_sharded + padding)/N for the
    /// sharded parameters, and for the replicated ones their whole parameter, master and Adam
    /// state, (4+12)Ψ_replicated (their gradient is Burn's own tensor, which burn-zero's
    /// accounting does not hold).
    fn formula_bytes(&self) -> u64 {
        (PARAM_BYTES + GRAD_BYTES + OPTIM_BYTES) * self.shard_elements as u64
            + (PARAM_BYTES + OPTIM_BYTES) * self.replicated_parameters as u64
    }
}

/// Rank 0's figures of one side of a configuration.
#[derive(Debug, Clone)]
struct Figures {
    /// Over the timed steps.
    counts: Counts,
    /// Whether every timed step counted the same.
    uniform: bool,
    exposed: Duration,
    gathers: u64,
    /// Timed steps in all.
    steps: usize,
    /// Seconds of each round's timed steps.
    round_seconds: Vec<f64>,
    memory: MemoryReport,
    layout: Layout,
    /// Kernel launches of one counted step, per rank (cubecl backends built with burn-zero's
    /// `wgpu` feature; `None` elsewhere).
    launches: Option<f64>,
}

impl Figures {
    fn per_step(&self, count: u64) -> f64 {
        count as f64 / self.steps as f64
    }

    /// Milliseconds per step of each round.
    fn round_step_ms(&self) -> Vec<f64> {
        let per_round = self.steps / self.round_seconds.len().max(1);
        self.round_seconds
            .iter()
            .map(|s| s * 1e3 / per_round as f64)
            .collect()
    }

    fn step_ms(&self) -> f64 {
        workload::median(&self.round_step_ms())
    }

    fn exposed_ms(&self) -> f64 {
        self.exposed.as_secs_f64() * 1e3 / self.steps as f64
    }

    /// Parameter shards, replicated parameters, masters and optimizer state after the last
    /// step, plus the gradient shards at their peak (between backward and the step; the step
    /// frees them).
    fn model_state_bytes(&self) -> u64 {
        let m = &self.memory;
        m.parameter_shards.current
            + m.persistent_parameters.current
            + m.master_weights.current
            + m.optimizer_state.current
            + m.gradient_shards.peak
    }
}

type Train<B> = Autodiff<Zero<B>>;

/// One side on one rank: its model, optimizer and state, and what its steps counted.
struct Runner<B: Backend, O> {
    model: Option<Gpt<Train<B>>>,
    optimizer: O,
    zero: ZeroState<B>,
    counts: Counts,
    step_counts: Option<Counts>,
    uniform: bool,
    exposed: Duration,
    gathers: u64,
    steps: usize,
    round_seconds: Vec<f64>,
    launches: Option<f64>,
}

/// Runs the work given and counts the kernel launches on a device meanwhile (`None`: this
/// backend's launches are not counted). It must run the work: every rank steps.
type LaunchCounter<'a, D> = &'a (dyn Fn(&D, &mut dyn FnMut()) -> Option<usize> + Sync);

impl<B: Backend, O: Optimizer<Gpt<Train<B>>, Train<B>>> Runner<B, O> {
    /// One training step, timed to the end of the work it queued (`B::sync`, Burn's own
    /// synchronisation, which burn-zero does not count); counted and timed in `round` when
    /// given. Only this side runs meanwhile, so the rank's counts between the two snapshots
    /// are this step's.
    fn step(
        &mut self,
        corpus: &Corpus,
        index: usize,
        ctx: &RankContext<B>,
        round: Option<usize>,
    ) -> Result<(), String> {
        let (device, rank, n) = (ctx.device(), ctx.rank(), ctx.world_size());
        let (counts, gathers) = (self.zero.counts(), self.zero.gather_stats());
        let started = Instant::now();
        let model = self.model.take().expect("the side's model");
        let model = workload::step(model, &mut self.optimizer, corpus, index, rank, n, device);
        self.model = Some(model);
        let (counts, after) = (self.zero.counts() - counts, self.zero.gather_stats());
        B::sync(device).map_err(|e| format!("synchronising the device: {e:?}"))?;
        let seconds = started.elapsed().as_secs_f64();
        let Some(round) = round else {
            return Ok(());
        };
        if self.round_seconds.len() <= round {
            self.round_seconds.resize(round + 1, 0.0);
        }
        self.round_seconds[round] += seconds;
        self.counts = self.counts + counts;
        self.uniform &= self.step_counts.is_none_or(|first| first == counts);
        self.step_counts.get_or_insert(counts);
        self.exposed += after.exposed - gathers.exposed;
        self.gathers += after.gathers - gathers.gathers;
        self.steps += 1;
        Ok(())
    }

    /// One more step with its kernel launches counted by `count` on rank 0, over every rank
    /// (the ranks meet before and after it, so the window holds this step's launches and
    /// nothing else); rank 0 keeps the count per rank.
    fn count_launches(
        &mut self,
        corpus: &Corpus,
        index: usize,
        ctx: &RankContext<B>,
        count: LaunchCounter<'_, B::Device>,
    ) -> Result<(), String> {
        let mut failed = None;
        let mut step = || {
            let stepped = ctx
                .comm()
                .barrier()
                .map_err(|e| e.to_string())
                .and_then(|()| self.step(corpus, index, ctx, None))
                .and_then(|()| ctx.comm().barrier().map_err(|e| e.to_string()));
            if let Err(error) = stepped {
                failed = Some(error);
            }
        };
        let counted = if ctx.rank() == 0 {
            count(ctx.device(), &mut step)
        } else {
            step();
            None
        };
        if let Some(error) = failed {
            return Err(error);
        }
        self.launches = counted.map(|n| n as f64 / ctx.world_size() as f64);
        Ok(())
    }

    fn figures(&self) -> Figures {
        Figures {
            launches: self.launches,
            counts: self.counts,
            uniform: self.uniform,
            exposed: self.exposed,
            gathers: self.gathers,
            steps: self.steps,
            round_seconds: self.round_seconds.clone(),
            memory: self.zero.memory_report(),
            layout: Layout::of(self.zero.store().chunks(), self.zero.world_size()),
        }
    }
}

/// Both sides of `plan` on `WORLD_SIZE` ranks sharing `device`: the two models are sharded on
/// the same ranks (one `RankContext`, as two modules of one training may be) and their steps
/// interleaved, A B, B A, … within each round and from round to round, so that the machine's
/// drift falls on both alike step by step.
fn run<B: Backend>(
    device: &B::Device,
    plan: Plan,
    count: LaunchCounter<'_, B::Device>,
) -> [Figures; 2] {
    let figures = launch::<B, _, _, String>(WORLD_SIZE, std::slice::from_ref(device), |ctx| {
        let corpus = workload::corpus();
        let mut runners = Vec::new();
        for side in Side::BOTH {
            let model = workload::model_of::<Train<B>>(plan.preset, &corpus, ctx.device());
            let (model, zero) = shard(model, &ctx, &side.config()).map_err(|e| e.to_string())?;
            runners.push(Runner {
                model: Some(model),
                optimizer: ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap(),
                zero,
                counts: Counts::default(),
                step_counts: None,
                uniform: true,
                exposed: Duration::ZERO,
                gathers: 0,
                steps: 0,
                round_seconds: Vec::new(),
                launches: None,
            });
        }
        let mut index = 0;
        for _ in 0..WARM_UP_STEPS {
            for runner in &mut runners {
                runner.step(&corpus, index, &ctx, None)?;
            }
            index += 1;
        }
        for round in 0..plan.rounds {
            for pair in 0..plan.steps {
                let order = if (round + pair) % 2 == 0 {
                    [0, 1]
                } else {
                    [1, 0]
                };
                for side in order {
                    runners[side].step(&corpus, index, &ctx, Some(round))?;
                }
                index += 1;
            }
            if ctx.rank() == 0 {
                let [per, searched] = [&runners[0], &runners[1]].map(|r| r.round_seconds[round]);
                eprintln!(
                    "{} {} round {round}: per parameter {:.1} ms/step, searched {:.1} ms/step \
                     (ratio {:.3})",
                    plan.kind.name(),
                    plan.preset.name(),
                    per * 1e3 / plan.steps as f64,
                    searched * 1e3 / plan.steps as f64,
                    searched / per
                );
            }
        }
        for runner in &mut runners {
            runner.count_launches(&corpus, index, &ctx, count)?;
        }
        let figures = [runners[0].figures(), runners[1].figures()];
        drop(runners);
        Ok(figures)
    })
    .unwrap_or_else(|e| panic!("{} GPT {}: {e}", plan.kind.name(), plan.preset.name()));
    figures.into_iter().next().expect("rank 0")
}

/// Both sides of one configuration.
struct Measured {
    plan: Plan,
    /// By `Side as usize`.
    sides: [Figures; 2],
}

impl Measured {
    fn side(&self, side: Side) -> &Figures {
        &self.sides[side as usize]
    }

    /// Searched / per-parameter step time, per round.
    fn ratios(&self) -> Vec<f64> {
        let [per, searched] = &self.sides;
        per.round_seconds
            .iter()
            .zip(&searched.round_seconds)
            .map(|(per, searched)| searched / per)
            .collect()
    }
}

fn min_max(values: &[f64]) -> (f64, f64) {
    values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().to_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

fn env_number(name: &str) -> Option<usize> {
    std::env::var(name).ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}: a number, got {v:?}"))
    })
}

fn preset_named(name: &str) -> Preset {
    name.parse()
        .unwrap_or_else(|error: String| panic!("{error}"))
}

/// What runs, by default: on Flex both models (base with fewer steps and rounds: a step is
/// ~5× small's), on wgpu `small` only, 4 steps × 3 rounds (lavapipe on 2 cores takes ~20 s a
/// small step; base, ~6× the work, would take about two minutes a step).
fn plans() -> Vec<Plan> {
    let presets = env_list("CHUNKS_PRESETS", "small,base");
    let wgpu_presets = env_list("CHUNKS_WGPU_PRESETS", "small");
    let mut plans = Vec::new();
    for backend in env_list("CHUNKS_BACKENDS", "flex,wgpu") {
        let kind = match backend.as_str() {
            "flex" => Kind::Flex,
            "wgpu" => Kind::Wgpu,
            other => panic!("unknown backend {other:?}: flex or wgpu"),
        };
        for name in &presets {
            if kind == Kind::Wgpu && !wgpu_presets.contains(name) {
                continue;
            }
            let preset = preset_named(name);
            let (steps, rounds) = match (kind, preset) {
                (Kind::Flex, Preset::Base) => (4, 5),
                (Kind::Flex, _) => (8, 15),
                (Kind::Wgpu, Preset::Base) => (2, 2),
                (Kind::Wgpu, _) => (4, 3),
            };
            plans.push(Plan {
                kind,
                preset,
                steps: env_number("CHUNKS_STEPS").unwrap_or(steps),
                rounds: env_number("CHUNKS_ROUNDS").unwrap_or(rounds),
            });
        }
    }
    plans
}

fn measure(plan: Plan, wgpu: &WgpuDevice) -> Measured {
    let sides = match plan.kind {
        // Nothing counts Flex's launches, but the step still runs on every rank.
        Kind::Flex => run::<Flex>(&Default::default(), plan, &|_, work| {
            work();
            None
        }),
        Kind::Wgpu => run::<PlainWgpu>(wgpu, plan, &count_wgpu_launches),
    };
    for (side, figures) in Side::BOTH.iter().zip(&sides) {
        eprintln!(
            "{} {}, {}: {} collectives and {} syncs in {} steps, exposed gather {:.2} ms/step",
            plan.kind.name(),
            plan.preset.name(),
            side.name(),
            figures.counts.collectives(),
            figures.counts.syncs,
            figures.steps,
            figures.exposed_ms(),
        );
    }
    Measured { plan, sides }
}

/// A checked target.
struct Target {
    what: String,
    figures: String,
    pass: bool,
}

fn pass(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

fn mb(bytes: f64) -> f64 {
    bytes / 1e6
}

/// Per-step counts of one side: all-gathers, reduce-scatters, all-reduces, other
/// collectives, synchronisations, host reads, host writes.
fn counts_per_step(f: &Figures) -> [f64; 7] {
    let c = f.counts;
    [
        f.per_step(c.all_gathers),
        f.per_step(c.reduce_scatters),
        f.per_step(c.all_reduces),
        f.per_step(c.other_collectives),
        f.per_step(c.syncs),
        f.per_step(c.host_reads),
        f.per_step(c.host_writes),
    ]
}

/// Every target of every measured plan, in the report's order: per plan the collective and
/// synchronisation counts (GPT small only), the gathered peak, the padding, the step time and
/// both sides' model state.
fn targets(measured: &[Measured]) -> Vec<Target> {
    let mut out = Vec::new();
    for m in measured {
        // Collectives and synchronisations: GPT small at stage 3.
        if m.plan.preset == Preset::Small {
            out.extend(collective_targets(m));
        }
        out.push(gathered_peak_target(m));
        out.push(padding_target(m));
        out.push(step_time_target(m));
        out.extend(model_state_targets(m));
    }
    out
}

/// The searched side's collectives per step against 3 × sharded chunks + replicated chunks
/// + 1, and its device synchronisations per step against its collectives.
fn collective_targets(m: &Measured) -> [Target; 2] {
    let (kind, preset) = (m.plan.kind.name(), m.plan.preset.name());
    let layout = m.side(Side::Searched).layout;
    let counts = counts_per_step(m.side(Side::Searched));
    let collectives: f64 = counts[..4].iter().sum();
    let limit = 3 * layout.sharded_chunks + layout.replicated_chunks + 1;
    [
        Target {
            what: format!(
                "{kind} {preset}, searched: collectives per step ≤ 3 × sharded chunks + \
                 replicated chunks + 1"
            ),
            figures: format!(
                "{collectives} ({} all-gathers, {} reduce-scatters, {} all-reduces, {} other) \
                 ≤ 3 × {} + {} + 1 = {limit}",
                counts[0],
                counts[1],
                counts[2],
                counts[3],
                layout.sharded_chunks,
                layout.replicated_chunks,
            ),
            pass: collectives <= limit as f64,
        },
        Target {
            what: format!(
                "{kind} {preset}, searched: device synchronisations per step ≤ collectives"
            ),
            figures: format!("{} ≤ {collectives}", counts[4]),
            pass: counts[4] <= collectives,
        },
    ]
}

/// The searched side's gathered peak against the per-parameter side's plus two of the
/// largest chunks.
fn gathered_peak_target(m: &Measured) -> Target {
    let (kind, preset) = (m.plan.kind.name(), m.plan.preset.name());
    let per = m.side(Side::PerParameter);
    let searched = m.side(Side::Searched);
    let layout = searched.layout;
    let (peak_searched, peak_per) = (searched.memory.gathered.peak, per.memory.gathered.peak);
    let limit = peak_per + 2 * layout.largest_chunk_bytes as u64;
    Target {
        what: format!("{kind} {preset}: gathered peak ≤ per-parameter peak + 2 × largest chunk"),
        figures: format!(
            "{:.2} MB ≤ {:.2} + 2 × {:.2} = {:.2} MB",
            mb(peak_searched as f64),
            mb(peak_per as f64),
            mb(layout.largest_chunk_bytes as f64),
            mb(limit as f64)
        ),
        pass: peak_searched <= limit,
    }
}

/// The searched layout's padding: at most 1% of the parameters.
fn padding_target(m: &Measured) -> Target {
    let (kind, preset) = (m.plan.kind.name(), m.plan.preset.name());
    let layout = m.side(Side::Searched).layout;
    let share = layout.padding as f64 / layout.parameters as f64;
    Target {
        what: format!("{kind} {preset}, searched: padding ≤ 1% of parameters"),
        figures: format!(
            "{} of {} elements ({:.3}%)",
            layout.padding,
            layout.parameters,
            100.0 * share
        ),
        pass: share <= 0.01,
    }
}

/// The median over the rounds of the searched side's step time over the per-parameter
/// side's: at most 1/0.97 on Flex (no worse), below 1 on wgpu (better).
fn step_time_target(m: &Measured) -> Target {
    let (kind, preset) = (m.plan.kind.name(), m.plan.preset.name());
    let ratios = m.ratios();
    let (lo, hi) = min_max(&ratios);
    let median = workload::median(&ratios);
    let (rule, ok) = match m.plan.kind {
        Kind::Flex => (
            format!("≤ 1/0.97 = {FLEX_RATIO_LIMIT:.3} (no worse)"),
            median <= FLEX_RATIO_LIMIT,
        ),
        Kind::Wgpu => ("< 1 (better)".to_string(), median < 1.0),
    };
    Target {
        what: format!("{kind} {preset}: step time searched / per parameter {rule}"),
        figures: format!(
            "median {median:.3} (min {lo:.3}, max {hi:.3}) over {} rounds of {} steps",
            ratios.len(),
            m.plan.steps
        ),
        pass: ok,
    }
}

/// Each side's model state against the formula plus the padding, to the byte.
fn model_state_targets(m: &Measured) -> Vec<Target> {
    let (kind, preset) = (m.plan.kind.name(), m.plan.preset.name());
    Side::BOTH
        .into_iter()
        .map(|side| {
            let figures = m.side(side);
            let got = figures.model_state_bytes();
            let want = figures.layout.formula_bytes();
            Target {
                what: format!(
                    "{kind} {preset}, {}: model state = (4+4+12)(Ψ_sharded + padding)/N + \
                     (4+12)Ψ_replicated, exactly",
                    side.name()
                ),
                figures: format!(
                    "{got} bytes against {want} ({:+} bytes)",
                    got as i64 - want as i64
                ),
                pass: got == want,
            }
        })
        .collect()
}

/// The kernels launched on a wgpu `device` while `work` runs, from cubecl's execution log
/// (burn-zero's `wgpu` feature; not counted without it).
fn count_wgpu_launches(device: &WgpuDevice, work: &mut dyn FnMut()) -> Option<usize> {
    #[cfg(feature = "wgpu")]
    {
        let log = burn_zero_kernels::LaunchLog::install();
        match log.launches::<WgpuRuntime, _>(device, work) {
            Ok(((), launched)) => Some(launched.len()),
            Err(error) => {
                eprintln!("wgpu: kernel launches not counted: {error}");
                None
            }
        }
    }
    #[cfg(not(feature = "wgpu"))]
    {
        let _ = device;
        work();
        None
    }
}

fn main() {
    // `cargo test --benches` runs bench targets without `--bench`; only `cargo bench` measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // cubecl's execution log, for the launch counts, before any wgpu client exists.
    #[cfg(feature = "wgpu")]
    burn_zero_kernels::LaunchLog::install();
    let plans = plans();
    let wgpu = WgpuDevice::default();
    let adapter = if plans.iter().any(|p| p.kind == Kind::Wgpu) {
        Some(adapter::wgpu_adapter())
    } else {
        None
    };
    if let Some(Err(reason)) = &adapter {
        eprintln!(
            "wgpu: no adapter ({reason}); the wgpu rows are not measured. Install a Vulkan \
             driver (Mesa's lavapipe: apt-get install mesa-vulkan-drivers) to get them."
        );
    }
    let mut measured = Vec::new();
    let mut missing = Vec::new();
    for plan in plans {
        if plan.kind == Kind::Wgpu && !matches!(adapter, Some(Ok(_))) {
            missing.push(plan);
            continue;
        }
        measured.push(measure(plan, &wgpu));
    }
    let targets = targets(&measured);
    let (md, json) = render(&measured, &missing, adapter.as_ref(), &targets);
    report::publish("chunks", &md, Some(&json));
}

/// One side's row of the counts table, and its JSON.
fn side_row(m: &Measured, side: Side) -> (String, Value) {
    let f = m.side(side);
    let layout = f.layout;
    let c = counts_per_step(f);
    let (exposed, step) = (f.exposed_ms(), f.step_ms());
    let gathers = f.per_step(f.gathers);
    let peak = f.memory.gathered.peak;
    let mark = if f.uniform { "" } else { " (varies)" };
    let launches = f
        .launches
        .map_or_else(|| "—".to_string(), |n| format!("{n:.0}"));
    let row = format!(
        "| {} | {} | {} | {} / {} | {} | {}{mark} | {} | {} | {} | {} | {} | {} | \
         {launches} | {exposed:.2} | {:.2} | {step:.1} |\n",
        m.plan.kind.name(),
        m.plan.preset.name(),
        side.name(),
        layout.sharded_chunks,
        layout.replicated_chunks,
        layout.padding,
        c[0],
        c[1],
        c[2],
        c[3],
        c[4],
        c[5],
        c[6],
        mb(peak as f64),
    );
    let json = json!({
        "backend": m.plan.kind.name(),
        "preset": m.plan.preset.name(),
        "chunk_size": side.name(),
        "steps": m.plan.steps,
        "rounds": m.plan.rounds,
        "layout": layout.json(),
        "per_step": {
            "all_gathers": c[0],
            "reduce_scatters": c[1],
            "all_reduces": c[2],
            "other_collectives": c[3],
            "collectives": c[..4].iter().sum::<f64>(),
            "syncs": c[4],
            "host_reads": c[5],
            "host_writes": c[6],
            "gathers": gathers,
            "kernel_launches": f.launches,
        },
        "counts_equal_in_every_step": f.uniform,
        "exposed_gather_ms_per_step": exposed,
        "gathered_peak_bytes": peak,
        "model_state_bytes": f.model_state_bytes(),
        "model_state_formula_bytes": layout.formula_bytes(),
        "step_ms": step,
        "round_step_ms": f.round_step_ms(),
        "memory": serde_json::to_value(&f.memory).expect("json"),
    });
    (row, json)
}

/// The table of step-time ratios, searched over per parameter, and its JSON.
fn ratio_rows(measured: &[Measured]) -> (String, Vec<Value>) {
    let mut md = String::from(
        "\n| backend | model | steps × rounds | step time searched / per parameter: min | median | max |\n\
         |---|---|---|---|---|---|\n",
    );
    let mut ratios = Vec::new();
    for m in measured {
        let r = m.ratios();
        let (lo, hi) = min_max(&r);
        let median = workload::median(&r);
        md.push_str(&format!(
            "| {} | {} | {} × {} | {lo:.3} | {median:.3} | {hi:.3} |\n",
            m.plan.kind.name(),
            m.plan.preset.name(),
            m.plan.steps,
            m.plan.rounds
        ));
        ratios.push(json!({
            "backend": m.plan.kind.name(),
            "preset": m.plan.preset.name(),
            "steps": m.plan.steps,
            "rounds": m.plan.rounds,
            "searched_over_per_parameter": r,
            "min": lo,
            "median": median,
            "max": hi,
        }));
    }
    (md, ratios)
}

fn render(
    measured: &[Measured],
    missing: &[Plan],
    adapter: Option<&Result<String, String>>,
    targets: &[Target],
) -> (String, Value) {
    let (cpu, cpus, mem_bytes, unix_time) = workload::machine();
    let pack_path = if cfg!(feature = "wgpu") {
        "burn-zero's cubecl pack kernels"
    } else {
        "Burn ops (build with --features wgpu for burn-zero's pack kernels)"
    };
    let adapter_text = match adapter {
        Some(Ok(name)) => {
            format!(
                "wgpu: the plain CubeBackend<WgpuRuntime> on {name}, bucket packing by \
                 {pack_path}."
            )
        }
        Some(Err(reason)) => format!(
            "wgpu: no adapter ({reason}): install a Vulkan driver (Mesa's lavapipe: \
             apt-get install mesa-vulkan-drivers) to measure it."
        ),
        None => "wgpu: not run (CHUNKS_BACKENDS).".into(),
    };
    let mut md = format!(
        "Chunks, GPT at ZeRO stage {STAGE}, {WORLD_SIZE} ranks (LocalGroup threads sharing one \
         device), parameters under {PERSIST_BELOW} elements replicated, library defaults \
         otherwise. Both models are sharded on the same ranks and step in turn (A B, B A, …), \
         {WARM_UP_STEPS} warm-up steps each, then the timed steps in rounds. {cpu}, {cpus} \
         CPUs, {:.0} GiB. {adapter_text}\n\n\
         Counts are per step over the timed steps (exact: \"(varies)\" marks a side whose \
         steps did not all count the same); exposed gather time is the mean over the timed \
         steps, step time the median of the rounds' means.\n\n\
         | backend | model | chunks | sharded / replicated chunks | padding (elements) | \
         all-gathers / step | reduce-scatters / step | all-reduces / step | other / step | \
         syncs / step | host reads / step | host writes / step | kernel launches / step | \
         exposed gather ms / step | gathered peak MB | step ms |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        mem_bytes as f64 / (1u64 << 30) as f64
    );
    let mut rows = Vec::new();
    for m in measured {
        for side in Side::BOTH {
            let (row, json) = side_row(m, side);
            md.push_str(&row);
            rows.push(json);
        }
    }
    for plan in missing {
        md.push_str(&format!(
            "| {} | {} | — | not measured: no wgpu adapter; install a Vulkan driver (Mesa's \
             lavapipe: `apt-get install mesa-vulkan-drivers`) |\n",
            plan.kind.name(),
            plan.preset.name()
        ));
    }
    let (ratio_table, ratios) = ratio_rows(measured);
    md.push_str(&ratio_table);
    md.push_str("\nTargets:\n\n");
    for t in targets {
        md.push_str(&format!("- {}: {} — {}\n", pass(t.pass), t.what, t.figures));
    }
    if !missing.is_empty() {
        md.push_str("- not checked on wgpu: no adapter\n");
    }
    let json = json!({
        "machine": { "cpu": cpu, "logical_cpus": cpus, "memory_bytes": mem_bytes },
        "unix_time": unix_time,
        "world_size": WORLD_SIZE,
        "stage": STAGE,
        "persist_below_numel": PERSIST_BELOW,
        "warm_up_steps": WARM_UP_STEPS,
        "wgpu_adapter": adapter.map(|a| match a {
            Ok(name) => json!({ "name": name }),
            Err(reason) => json!({ "missing": reason }),
        }),
        "wgpu_pack_path": pack_path,
        "rows": rows,
        "ratios": ratios,
        "not_measured": missing
            .iter()
            .map(|p| json!({ "backend": p.kind.name(), "preset": p.preset.name(),
                "reason": "no wgpu adapter: install mesa-vulkan-drivers" }))
            .collect::<Vec<_>>(),
        "targets": targets
            .iter()
            .map(|t| json!({ "target": t.what, "figures": t.figures, "pass": t.pass }))
            .collect::<Vec<_>>(),
    });
    (md, json)
}
