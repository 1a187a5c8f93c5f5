//! Turns the scaling suite's results into `docs/scaling.md` (tables) and `docs/scaling.svg`
//! (step time and memory per rank against the number of ranks).
//!
//! ```sh
//! cargo bench --manifest-path benches/plain-burn/Cargo.toml   # target/bench-reports/plain.json
//! cargo bench --bench scaling                                 # target/bench-reports/scaling.json
//! cargo run -p scaling-report                                 # docs/scaling.md, docs/scaling.svg
//! ```
//!
//! `benches/plain-burn/instructions.sh` writes `instructions.json` (the single-rank overhead in
//! instructions, counted by callgrind); the report includes it when present, and
//! `cargo run -p scaling-report -- --instructions-only` puts it into the existing
//! `docs/scaling.md` without the other benchmarks' results.

mod svg;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Bytes per element of parameters, gradients, masters and moments (all f32 here).
const ELEMENT: f64 = 4.0;
const STAGE_COLOURS: [(&str, &str); 5] = [
    ("stage0", "#4e79a7"),
    ("stage1", "#f28e2b"),
    ("stage2", "#59a14f"),
    ("stage3", "#e15759"),
    ("stage3_cached", "#b07aa1"),
];
const PLAIN_COLOUR: &str = "#333333";

/// Where the benchmark results are read and the report is written.
#[derive(clap::Parser, Debug)]
#[command(about = "Writes docs/scaling.md and docs/scaling.svg from the scaling benchmarks' JSON")]
struct Args {
    /// Folder of scaling.json, plain.json and the ab-*.json rounds (default:
    /// target/bench-reports of the workspace).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Folder the report is written to (default: docs of the workspace).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Only replace (or add) the instruction-count section of the existing scaling.md, from
    /// instructions.json.
    #[arg(long)]
    instructions_only: bool,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let input = args
        .input
        .unwrap_or_else(|| root.join("target/bench-reports"));
    let output = args.output.unwrap_or_else(|| root.join("docs"));
    let instructions = read(&input.join("instructions.json")).ok();
    if args.instructions_only {
        let Some(instructions) = instructions else {
            eprintln!(
                "no {}; run benches/plain-burn/instructions.sh first",
                input.join("instructions.json").display()
            );
            std::process::exit(1);
        };
        let md = output.join("scaling.md");
        let text = std::fs::read_to_string(&md).unwrap_or_else(|error| {
            eprintln!("cannot read {}: {error}", md.display());
            std::process::exit(1);
        });
        std::fs::write(
            &md,
            with_section(&text, &instructions_section(&instructions)),
        )
        .expect("write scaling.md");
        println!("wrote the instruction counts into {}", md.display());
        return;
    }
    let scaling = read(&input.join("scaling.json")).unwrap_or_else(|error| {
        eprintln!("{error}\nrun `cargo bench --bench scaling` first");
        std::process::exit(1);
    });
    let plain = match read(&input.join("plain.json")) {
        Ok(plain) => Some(plain),
        Err(error) => {
            eprintln!(
                "{error}\nthe plain-Burn column stays empty; run \
                 `cargo bench --manifest-path benches/plain-burn/Cargo.toml` for it"
            );
            None
        }
    };
    let mut report = Report::new(&scaling, plain.as_ref());
    report.instructions = instructions;
    // Alternating single-rank rounds (benches/plain-burn/overhead.sh), if any.
    for round in 1.. {
        let (Ok(plain), Ok(zero)) = (
            read(&input.join(format!("ab-plain-{round}.json"))),
            read(&input.join(format!("ab-scaling-{round}.json"))),
        ) else {
            break;
        };
        let medians = zero["runs"]
            .as_array()
            .map(|runs| {
                runs.iter()
                    .filter(|r| int(&r["world_size"]) == 1)
                    .map(|r| {
                        (
                            r["name"].as_str().unwrap_or("?").to_string(),
                            num(&r["median_step_s"]) * 1e3,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        report.rounds.push(Round {
            plain_ms: num(&plain["median_step_s"]) * 1e3,
            zero_ms: medians,
            when: utc(int(&plain["unix_time"])),
        });
    }
    std::fs::create_dir_all(&output).expect("output directory");
    let md = output.join("scaling.md");
    let svg = output.join("scaling.svg");
    std::fs::write(&md, report.markdown()).expect("write scaling.md");
    std::fs::write(&svg, report.svg()).expect("write scaling.svg");
    println!("wrote {} and {}", md.display(), svg.display());
}

fn read(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("cannot parse {}: {e}", path.display()))
}

fn num(value: &Value) -> f64 {
    value.as_f64().unwrap_or(f64::NAN)
}

fn int(value: &Value) -> u64 {
    value.as_u64().unwrap_or(0)
}

/// One (configuration, N) measurement, rank 0's figures.
struct Run {
    name: String,
    stage: u64,
    cached: bool,
    world_size: u64,
    padded: u64,
    step_ms: f64,
    spread_ms: (f64, f64),
    /// Model state by part, bytes, after backward (parameters, gradients held, master, Adam).
    params: u64,
    grads: u64,
    master: u64,
    state: u64,
    buckets_peak: u64,
    gathered_peak: u64,
    param_shards_peak: u64,
    /// Fastest milliseconds of forward, backward and the optimizer step (rank 0).
    phases: [f64; 3],
    /// Milliseconds the training thread waited for the gradient reduction (one step).
    reduction_ms: f64,
    /// Gradient buckets of the step, and how many were reduced before backward ended.
    collectives: u64,
    overlapped: u64,
    /// Whether every rank reported the same model state and traffic as rank 0.
    ranks_agree: bool,
    comm: Value,
}

impl Run {
    fn new(run: &Value) -> Self {
        let ranks = run["ranks"].as_array().cloned().unwrap_or_default();
        let rank0 = &ranks[0];
        let memory = &rank0["memory_after_backward"];
        let usage = |kind: &str, what: &str| int(&memory[kind][what]);
        let samples: Vec<f64> = run["samples_step_s"]
            .as_array()
            .map(|s| s.iter().map(num).collect())
            .unwrap_or_default();
        let (low, high) = samples
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| {
                (lo.min(*s), hi.max(*s))
            });
        let state_of = |rank: &Value| {
            let m = &rank["memory_after_backward"];
            (
                int(&m["parameter_shards"]["current"])
                    + int(&m["persistent_parameters"]["current"]),
                int(&rank["gradient_bytes_after_backward"]),
                int(&m["master_weights"]["current"]),
                int(&m["optimizer_state"]["current"]),
                rank["comm"]["step"].clone(),
            )
        };
        let first = state_of(rank0);
        Self {
            name: run["name"].as_str().unwrap_or("?").to_string(),
            stage: int(&run["stage"]),
            cached: run["gather_cache"].as_bool().unwrap_or(false),
            world_size: int(&run["world_size"]),
            padded: int(&run["padded_parameters"]),
            step_ms: num(&run["median_step_s"]) * 1e3,
            spread_ms: (low * 1e3, high * 1e3),
            params: first.0,
            grads: first.1,
            master: first.2,
            state: first.3,
            buckets_peak: usage("buckets", "peak"),
            gathered_peak: usage("gathered", "peak"),
            param_shards_peak: usage("parameter_shards", "peak"),
            phases: phases(&rank0["phases_fastest_ms"]),
            reduction_ms: num(&rank0["reduction"]["exposed_seconds"]) * 1e3,
            collectives: int(&rank0["reduction"]["collectives"]),
            overlapped: int(&rank0["reduction"]["buckets_reduced_during_backward"]),
            ranks_agree: ranks.iter().all(|rank| state_of(rank) == first),
            comm: rank0["comm"].clone(),
        }
    }

    fn model_state(&self) -> u64 {
        self.params + self.grads + self.master + self.state
    }

    fn step_bytes(&self) -> u64 {
        int(&self.comm["step"]["total_bytes"])
    }
}

/// Forward, backward and optimizer milliseconds from a `phases_ms` object.
fn phases(value: &Value) -> [f64; 3] {
    [
        num(&value["forward"]),
        num(&value["backward"]),
        num(&value["optimizer"]),
    ]
}

/// Per-rank model state of the ZeRO paper for f32 parameters and gradients, an fp32 master
/// copy and Adam's two fp32 moments, in units of Ψ bytes.
fn formula(stage: u64, n: f64) -> f64 {
    match stage {
        0 => 4.0 + 4.0 + 12.0,
        1 => 4.0 + 4.0 + 12.0 / n,
        2 => 4.0 + (4.0 + 12.0) / n,
        _ => (4.0 + 4.0 + 12.0) / n,
    }
}

fn formula_text(stage: u64) -> &'static str {
    match stage {
        0 => "(4+4+12)Ψ",
        1 => "(4+4)Ψ + 12Ψ/N",
        2 => "4Ψ + (4+12)Ψ/N",
        _ => "(4+4+12)Ψ/N",
    }
}

/// Communication volume per step and rank the analysis predicts, in units of Ψ elements.
fn theory(run: &Run) -> (f64, &'static str) {
    match (run.stage, run.cached) {
        (0..=2, _) => (2.0, "2Ψ"),
        (_, false) => (3.0, "3Ψ"),
        (_, true) => (2.0, "2Ψ (cached)"),
    }
}

fn mb(bytes: f64) -> String {
    format!("{:.2} MB", bytes / 1e6)
}

fn percent(ratio: f64) -> String {
    format!("{:+.2}%", (ratio - 1.0) * 100.0)
}

fn label(name: &str) -> String {
    match name {
        "stage3" => "stage 3 (no gather cache)".into(),
        "stage3_cached" => "stage 3 (gather cache 512 MiB)".into(),
        other => other.replace("stage", "stage "),
    }
}

/// One round of the alternating single-rank comparison.
struct Round {
    plain_ms: f64,
    /// Median step time at N = 1 by configuration.
    zero_ms: Vec<(String, f64)>,
    when: String,
}

struct Report {
    rounds: Vec<Round>,
    /// The single-rank overhead in instructions, if measured.
    instructions: Option<Value>,
    psi: u64,
    preset: String,
    batch: u64,
    seq: u64,
    bucket_mb: f64,
    overlap: bool,
    params: Vec<(String, u64)>,
    runs: Vec<Run>,
    plain_ms: Option<(f64, (f64, f64))>,
    plain_phases: Option<[f64; 3]>,
    phase_steps: u64,
    /// Criterion samples per configuration.
    samples: usize,
    machine: String,
    measured: String,
}

impl Report {
    fn new(scaling: &Value, plain: Option<&Value>) -> Self {
        let machine = &scaling["machine"];
        let cpus = int(&machine["logical_cpus"]);
        let gib = int(&machine["memory_bytes"]) as f64 / (1u64 << 30) as f64;
        let plain_ms = plain.map(|p| {
            let samples: Vec<f64> = p["samples_step_s"]
                .as_array()
                .map(|s| s.iter().map(num).collect())
                .unwrap_or_default();
            let low = samples.iter().copied().fold(f64::INFINITY, f64::min);
            let high = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (num(&p["median_step_s"]) * 1e3, (low * 1e3, high * 1e3))
        });
        let mut measured = format!("burn-zero {}", utc(int(&scaling["unix_time"])));
        if let Some(p) = plain {
            let _ = write!(measured, ", plain Burn {}", utc(int(&p["unix_time"])));
        }
        Self {
            rounds: Vec::new(),
            instructions: None,
            psi: int(&scaling["parameters"]),
            preset: scaling["preset"].as_str().unwrap_or("?").to_string(),
            batch: int(&scaling["global_batch"]),
            seq: int(&scaling["seq_len"]),
            bucket_mb: num(&scaling["bucket_size_mb"]),
            overlap: scaling["overlap_comm"].as_bool().unwrap_or(true),
            params: scaling["params"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .map(|p| (p[0].as_str().unwrap_or("").to_string(), int(&p[1])))
                        .collect()
                })
                .unwrap_or_default(),
            runs: scaling["runs"]
                .as_array()
                .map(|runs| runs.iter().map(Run::new).collect())
                .unwrap_or_default(),
            plain_ms,
            plain_phases: plain.map(|p| phases(&p["phases_fastest_ms"])),
            phase_steps: int(&scaling["phase_steps"]),
            samples: scaling["runs"][0]["samples_step_s"]
                .as_array()
                .map_or(0, Vec::len),
            machine: format!(
                "{}, {cpus} logical CPUs, {gib:.0} GiB RAM, no GPU (all figures are CPU figures)",
                machine["cpu"].as_str().unwrap_or("unknown CPU")
            ),
            measured,
        }
    }

    fn run(&self, name: &str, n: u64) -> Option<&Run> {
        self.runs
            .iter()
            .find(|r| r.name == name && r.world_size == n)
    }

    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for run in &self.runs {
            if !names.contains(&run.name) {
                names.push(run.name.clone());
            }
        }
        names
    }

    fn world_sizes(&self) -> Vec<u64> {
        let mut sizes: Vec<u64> = self.runs.iter().map(|r| r.world_size).collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    /// Elements of the parameters whose path ends with one of `suffixes`.
    fn numel_of(&self, suffixes: &[&str]) -> u64 {
        self.params
            .iter()
            .filter(|(path, _)| suffixes.iter().any(|s| path.ends_with(s)))
            .map(|(_, n)| n)
            .sum()
    }

    /// The whole of `scaling.md`: the preamble, then the step-time, memory and communication
    /// sections, each a table followed by its reading notes.
    fn markdown(&self) -> String {
        let mut md = String::new();
        self.preamble(&mut md);
        self.step_time_table(&mut md);
        self.step_time_notes(&mut md);
        self.rounds_table(&mut md);
        if let Some(instructions) = &self.instructions {
            md.push_str(&instructions_section(instructions));
        }
        self.phases_table(&mut md);
        self.memory_table(&mut md);
        self.memory_ratio_table(&mut md);
        self.memory_notes(&mut md);
        self.comm_table(&mut md);
        self.comm_notes(&mut md);
        md
    }

    /// The title, where the report comes from, and the machine, workload and both sides of
    /// the comparison, so that the figures below can be read without the benches' source.
    fn preamble(&self, md: &mut String) {
        let _ = writeln!(md, "# Scaling benchmarks\n");
        let _ = writeln!(
            md,
            "Generated by `cargo run -p scaling-report` from `target/bench-reports/scaling.json` \
             (`cargo bench --bench scaling`) and `target/bench-reports/plain.json` \
             (`cargo bench --manifest-path benches/plain-burn/Cargo.toml`). Do not edit by hand.\n"
        );
        let _ = writeln!(md, "- **Machine**: {}.", self.machine);
        let _ = writeln!(md, "- **Measured**: {}.", self.measured);
        let _ = writeln!(
            md,
            "- **Workload**: the `train_gpt` model, preset `{}` (Ψ = {} parameters, f32), one \
             training step = forward, cross-entropy loss, backward, Adam step (lr 1e-3) on a \
             global batch of {} sequences × {} characters, split evenly across the N ranks \
             ({} tokens per step at every N).",
            self.preset,
            self.psi,
            self.batch,
            self.seq,
            self.batch * self.seq
        );
        let _ = writeln!(
            md,
            "- **burn-zero**: `Autodiff<Zero<NdArray>>`, `ZeroOptimizer` over Burn's Adam (fp32 \
             master shards), `LocalGroup` (one thread per rank in one process), \
             `persist_below_numel(0)` (every parameter sharded), {} MiB gradient buckets, \
             `overlap_comm` {}. Stage 3 runs twice: with `max_live_gathered_bytes(0)` \
             (backward re-gathers what it needs) and with the default 512 MiB gather cache.",
            self.bucket_mb,
            if self.overlap { "on" } else { "off" }
        );
        let _ = writeln!(
            md,
            "- **plain Burn**: `Autodiff<NdArray>` with Burn's own Adam \
             (`AdamConfig::new().init()`), no burn-zero, the whole batch on one thread; a \
             separate package (`benches/plain-burn`), because the workspace's `distributed` \
             feature does not let `Autodiff<NdArray>` compile. Both benches run the same \
             step function (`benches/common/workload.rs`) and the same NdArray build features \
             (no rayon, no SIMD feature), so NdArray computes on one thread per rank.\n"
        );
    }

    /// The step-time section's heading and table: each configuration's median step (and the
    /// samples' range) at every N, against plain Burn's at N = 1.
    fn step_time_table(&self, md: &mut String) {
        let sizes = self.world_sizes();
        let _ = writeln!(md, "## Step time\n");
        let _ = writeln!(
            md,
            "Median time per step over criterion's {} samples, in milliseconds (rank 0's \
             clock; the ranks step in lockstep); the range of the samples in brackets.\n",
            self.samples
        );
        let mut header = String::from("| configuration |");
        let mut rule = String::from("|---|");
        for n in &sizes {
            let _ = write!(header, " N = {n} |");
            rule.push_str("---|");
        }
        header.push_str(" N = 1 vs plain Burn |");
        rule.push_str("---|");
        let _ = writeln!(md, "{header}\n{rule}");
        if let Some((plain, (lo, hi))) = self.plain_ms {
            let mut row = format!("| plain Burn | {plain:.1} ({lo:.1}–{hi:.1}) |");
            for _ in 1..sizes.len() {
                row.push_str(" – |");
            }
            row.push_str(" – |");
            let _ = writeln!(md, "{row}");
        }
        for name in self.names() {
            let _ = writeln!(md, "{}", self.step_time_row(&name, &sizes));
        }
        let _ = writeln!(md);
    }

    /// One configuration's row of the step-time table: its median (and range) at each of
    /// `sizes`, then its N = 1 median against plain Burn's ("–" where either is missing).
    fn step_time_row(&self, name: &str, sizes: &[u64]) -> String {
        let mut row = format!("| {} |", label(name));
        for n in sizes {
            match self.run(name, *n) {
                Some(r) => {
                    let _ = write!(
                        row,
                        " {:.1} ({:.1}–{:.1}) |",
                        r.step_ms, r.spread_ms.0, r.spread_ms.1
                    );
                }
                None => row.push_str(" – |"),
            }
        }
        match (self.plain_ms, self.run(name, 1)) {
            (Some((plain, _)), Some(r)) => {
                let _ = write!(row, " {} |", percent(r.step_ms / plain));
            }
            _ => row.push_str(" – |"),
        }
        row
    }

    /// The memory section's heading and table: rank 0's model state by part after backward,
    /// against the ZeRO paper's formula, with the buckets' and gathers' peaks (the cached
    /// stage-3 run is left out: its model state equals stage 3's).
    fn memory_table(&self, md: &mut String) {
        let psi = self.psi as f64;
        let sizes = self.world_sizes();
        let _ = writeln!(md, "## Memory per rank\n");
        let _ = writeln!(
            md,
            "Rank 0's model state after backward, before the optimizer step (when gradients and \
             optimizer state coexist), from the module state's memory report \
             (`ZeroState::memory_report`) and, for the gradients, the bytes \
             `GradientsParams` holds. Formula: the ZeRO paper's per-rank model state for f32 \
             parameters (4 bytes), f32 gradients (4), an fp32 master copy (4) and Adam's two fp32 \
             moments (8).\n"
        );
        let _ = writeln!(
            md,
            "| stage | N | parameters | gradients | fp32 master | Adam moments | model state | formula | measured / formula | buckets peak | buckets reduced during backward | gathered peak |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for name in self.names().iter().filter(|n| *n != "stage3_cached") {
            for n in &sizes {
                let Some(r) = self.run(name, *n) else {
                    continue;
                };
                let expected = formula(r.stage, *n as f64) * psi;
                let _ = writeln!(
                    md,
                    "| {} | {n} | {} | {} | {} | {} | {} | {} = {} | {} | {} | {} of {} | {} |",
                    r.stage,
                    mb(r.params as f64),
                    mb(r.grads as f64),
                    mb(r.master as f64),
                    mb(r.state as f64),
                    mb(r.model_state() as f64),
                    formula_text(r.stage),
                    mb(expected),
                    percent(r.model_state() as f64 / expected),
                    mb(r.buckets_peak as f64),
                    r.overlapped,
                    r.collectives,
                    mb(r.gathered_peak as f64),
                );
            }
        }
        let _ = writeln!(md);
    }

    /// The model state per rank at the largest N against the smallest, measured and by the
    /// formula, so that the 1/N scaling of each stage can be read off directly.
    fn memory_ratio_table(&self, md: &mut String) {
        let psi = self.psi as f64;
        let sizes = self.world_sizes();
        let (Some(first), Some(last)) = (sizes.first(), sizes.last()) else {
            return;
        };
        let _ = writeln!(
            md,
            "N = {last} against N = {first}, model state per rank:\n\n| stage | N = {first} | N = {last} | measured ratio | formula ratio | N = {last}: measured / formula |\n|---|---|---|---|---|---|"
        );
        for name in self.names().iter().filter(|n| *n != "stage3_cached") {
            if let (Some(a), Some(b)) = (self.run(name, *first), self.run(name, *last)) {
                let fa = formula(a.stage, *first as f64);
                let fb = formula(b.stage, *last as f64);
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {:.4} | {:.4} | {} |",
                    a.stage,
                    mb(a.model_state() as f64),
                    mb(b.model_state() as f64),
                    b.model_state() as f64 / a.model_state() as f64,
                    fb / fa,
                    percent(b.model_state() as f64 / (fb * psi)),
                );
            }
        }
        let _ = writeln!(md);
    }

    /// The communication section's heading and table: the bytes rank 0 moves per step by
    /// collective, against the analysis' 2Ψ or 3Ψ, with the calls and the padded Ψ.
    fn comm_table(&self, md: &mut String) {
        let psi = self.psi as f64;
        let sizes = self.world_sizes();
        let _ = writeln!(md, "## Communication per step\n");
        let _ = writeln!(
            md,
            "Bytes one rank moves in one training step, counted by a `Communicator` wrapper around \
             the rank's communicator and around the duplicate the gradient-reduction thread uses: \
             an all-gather counts its output (N blocks), a reduce-scatter its input, an all-reduce \
             twice its buffer (a reduce-scatter and an all-gather), a broadcast its buffer; \
             barriers move no data. Theory in Ψ × 4 bytes = {}.\n",
            mb(psi * ELEMENT)
        );
        let _ = writeln!(
            md,
            "| configuration | N | all-gather | reduce-scatter | all-reduce (×2) | total | theory | measured / theory | collectives (barriers) | padded Ψ |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        for name in self.names() {
            for n in &sizes {
                let Some(r) = self.run(&name, *n) else {
                    continue;
                };
                let step = &r.comm["step"];
                let (units, text) = theory(r);
                let expected = units * psi * ELEMENT;
                let calls = int(&step["all_gather_calls"])
                    + int(&step["reduce_scatter_calls"])
                    + int(&step["all_reduce_calls"])
                    + int(&step["broadcast_calls"]);
                let _ = writeln!(
                    md,
                    "| {} | {n} | {} | {} | {} | {} | {} = {} | {:.4} | {calls} ({}) | {} |",
                    label(&name),
                    mb(num(&step["all_gather_bytes"])),
                    mb(num(&step["reduce_scatter_bytes"])),
                    mb(num(&step["all_reduce_bytes"])),
                    mb(r.step_bytes() as f64),
                    text,
                    mb(expected),
                    r.step_bytes() as f64 / expected,
                    int(&step["barrier_calls"]),
                    r.padded,
                );
            }
        }
        let _ = writeln!(md);
    }

    /// Median over the alternating rounds of each configuration's single-rank overhead.
    fn round_overheads(&self) -> Vec<(String, f64)> {
        let mut names: Vec<String> = Vec::new();
        for round in &self.rounds {
            for (name, _) in &round.zero_ms {
                if !names.contains(name) {
                    names.push(name.clone());
                }
            }
        }
        names
            .into_iter()
            .map(|name| {
                let ratios: Vec<f64> = self
                    .rounds
                    .iter()
                    .filter_map(|round| {
                        round
                            .zero_ms
                            .iter()
                            .find(|(n, _)| *n == name)
                            .map(|(_, ms)| ms / round.plain_ms)
                    })
                    .collect();
                (name, median(&ratios))
            })
            .collect()
    }

    fn rounds_table(&self, md: &mut String) {
        if self.rounds.is_empty() {
            return;
        }
        let names: Vec<String> = self.round_overheads().into_iter().map(|(n, _)| n).collect();
        let _ = writeln!(
            md,
            "### Single-rank overhead, alternating runs\n\n\
             The table above comes from two processes run minutes apart, and this shared \
             2-core virtual machine drifts by several percent between runs. \
             `benches/plain-burn/overhead.sh` therefore alternates the baseline with \
             burn-zero's N = 1 runs ({} rounds); median step time in ms per round, and the \
             difference from the plain-Burn run of the same round:\n",
            self.rounds.len()
        );
        let mut header = String::from("| round | plain Burn |");
        let mut rule = String::from("|---|---|");
        for name in &names {
            let _ = write!(header, " {} |", label(name));
            rule.push_str("---|");
        }
        let _ = writeln!(
            md,
            "{header}
{rule}"
        );
        for (i, round) in self.rounds.iter().enumerate() {
            let mut row = format!("| {} ({}) | {:.1} |", i + 1, round.when, round.plain_ms);
            for name in &names {
                match round.zero_ms.iter().find(|(n, _)| n == name) {
                    Some((_, ms)) => {
                        let _ = write!(row, " {ms:.1} ({}) |", percent(ms / round.plain_ms));
                    }
                    None => row.push_str(" – |"),
                }
            }
            let _ = writeln!(md, "{row}");
        }
        let mut row = String::from("| **median overhead** | |");
        for (_, ratio) in self.round_overheads() {
            let _ = write!(row, " **{}** |", percent(ratio));
        }
        let _ = writeln!(md, "{row}\n");
        let plain: Vec<f64> = self
            .plain_ms
            .map(|(ms, _)| ms)
            .into_iter()
            .chain(self.rounds.iter().map(|r| r.plain_ms))
            .collect();
        let low = plain.iter().copied().fold(f64::INFINITY, f64::min);
        let high = plain.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let noise = (high - low) / median(&plain);
        let worst = self
            .round_overheads()
            .iter()
            .map(|(_, ratio)| (ratio - 1.0).abs())
            .fold(0.0, f64::max);
        let _ = writeln!(
            md,
            "For scale: plain Burn alone, the same binary, measured {} times in this run: \
             medians {:.1}–{:.1} ms, a spread of {:.1}% of their median. {}\n",
            plain.len(),
            low,
            high,
            noise * 100.0,
            if worst <= noise {
                "Every configuration's median difference is inside that spread, so this \
                 machine cannot resolve burn-zero's single-rank cost from end-to-end step times. \
                 Negative differences are noise as well: burn-zero runs the same NdArray ops as \
                 plain Burn plus a little extra work, timed on its own in the next table."
            } else {
                "Some configurations differ from plain Burn by more than that spread."
            }
        );
    }

    fn phases_table(&self, md: &mut String) {
        let Some(plain) = self
            .plain_phases
            .filter(|p| p.iter().all(|t| t.is_finite()))
        else {
            return;
        };
        let _ = writeln!(
            md,
            "### Where a single-rank step goes\n\n\
             Before criterion's samples, each bench takes {} steps one phase at a time: forward \
             to the loss; backward into `GradientsParams`, gradient reduction included; the \
             optimizer step. Milliseconds of the fastest step per phase (the machine's noise \
             only adds time), at N = 1, and the difference from plain Burn's same phase; \
             \"reduction\" is the part of backward the training thread spent waiting for the \
             gradient reduction, as the group reports it (`last_reduction().exposed_seconds`, \
             one step):\n\n\
             | configuration | forward | backward | of which reduction | optimizer step | sum |\n\
             |---|---|---|---|---|---|",
            self.phase_steps
        );
        let sum = |p: &[f64; 3]| p.iter().sum::<f64>();
        let _ = writeln!(
            md,
            "| plain Burn | {:.1} | {:.1} | – | {:.1} | {:.1} |",
            plain[0],
            plain[1],
            plain[2],
            sum(&plain)
        );
        let mut optimizer_excess: Vec<f64> = Vec::new();
        let mut reduction: Vec<f64> = Vec::new();
        for name in self.names() {
            let Some(r) = self.run(&name, 1) else {
                continue;
            };
            optimizer_excess.push(r.phases[2] - plain[2]);
            reduction.push(r.reduction_ms);
            let cell = |i: usize| format!("{:.1} ({:+.1})", r.phases[i], r.phases[i] - plain[i]);
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.1} | {} | {:.1} ({}) |",
                label(&name),
                cell(0),
                cell(1),
                r.reduction_ms,
                cell(2),
                sum(&r.phases),
                percent(sum(&r.phases) / sum(&plain)),
            );
        }
        let range = |v: &[f64]| {
            let low = v.iter().copied().fold(f64::INFINITY, f64::min);
            let high = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (low, high)
        };
        let (opt_low, opt_high) = range(&optimizer_excess);
        let (red_low, red_high) = range(&reduction);
        let _ = writeln!(
            md,
            "\nForward and backward run the same NdArray ops in both (the decorator forwards \
             them; at stage 3 it also copies each parameter out of its gather) and take nearly \
             all of the step; between two such runs they move by the machine's noise. The \
             work only burn-zero does is measured on its own: the optimizer step costs \
             {opt_low:+.1} to {opt_high:+.1} ms more than Burn's Adam (Adam on the fp32 master \
             copy, then the parameters written back from it, and all-gathered at stages 1 and \
             2), and the training thread waits {red_low:.1}–{red_high:.1} ms for the gradient \
             reduction (packing into buckets and a one-rank collective): together at most \
             {:.1}% of plain Burn's {:.1} ms step. Not timed apart: the decorator's dispatch, \
             and at stage 3 the gathers, which at one rank copy each parameter at every use \
             (forward and backward gather about 2Ψ × 4 bytes ≈ {} per step without the cache).\n",
            (opt_high + red_high) / sum(&plain) * 100.0,
            sum(&plain),
            mb(2.0 * self.psi as f64 * ELEMENT),
        );
    }

    fn step_time_notes(&self, md: &mut String) {
        let Some((plain, _)) = self.plain_ms else {
            return;
        };
        let at = |name: &str, n: u64| self.run(name, n).map_or(f64::NAN, |r| r.step_ms);
        let overheads: Vec<String> = ["stage0", "stage1", "stage2", "stage3", "stage3_cached"]
            .iter()
            .filter(|name| self.run(name, 1).is_some())
            .map(|name| format!("{} {}", label(name), percent(at(name, 1) / plain)))
            .collect();
        let alternating = if self.rounds.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = self
                .round_overheads()
                .iter()
                .map(|(name, ratio)| format!("{} {}", label(name), percent(*ratio)))
                .collect();
            format!(
                " in this run; median over the {} alternating rounds below: {}",
                self.rounds.len(),
                list.join(", ")
            )
        };
        let _ = writeln!(
            md,
            "Reading it:\n\n- **Single-rank overhead** of `Zero<NdArray>` over plain Burn (goal ≤ 5%): {}{alternating}. \
             At N = 1 burn-zero still runs its whole machinery: it keeps an fp32 master copy and \
             writes the parameters back from it after each Adam step, packs every gradient into \
             buckets and passes them through a (one-rank) collective on a communication thread, \
             and at stage 3 gathers (copies) each parameter at every use.",
            overheads.join(", ")
        );
        let speedup = |name: &str, n: u64| at(name, 1) / at(name, n);
        let sizes = self.world_sizes();
        if sizes.contains(&2) && sizes.contains(&4) {
            let _ = writeln!(
                md,
                "- **More ranks on 2 cores.** The ranks are threads of one process and this \
                 NdArray build computes on one thread per rank, so N = 1 leaves one of the two \
                 cores idle and N = 2 can use both: stage 0 runs {:.2}× faster at N = 2 than at \
                 N = 1 (stage 3 without cache {:.2}×). At N = 4, four rank threads (and four \
                 gradient-reduction threads) share the same two cores, each on a quarter of the \
                 batch, so nothing more is gained: {:.2}× (stage 0) and {:.2}× (stage 3) of the \
                 N = 1 speed. These are not GPU scaling figures; on GPUs each rank has its own \
                 device.",
                speedup("stage0", 2),
                speedup("stage3", 2),
                speedup("stage0", 4),
                speedup("stage3", 4),
            );
        }
        let _ = writeln!(
            md,
            "- **Stages.** Stage 3 without the cache gathers every parameter at each use and \
             re-gathers in backward; on `LocalGroup` a gather is a copy of the full tensor plus a \
             thread rendezvous, so it costs time where a GPU collective would overlap with \
             compute. The gather cache removes backward's re-gathers.\n"
        );
    }

    /// The memory section's reading notes: whether the ranks agree, then what each stage
    /// holds and where the measurement departs from the paper's formula.
    fn memory_notes(&self, md: &mut String) {
        let psi = self.psi as f64;
        let agree = self.runs.iter().all(|r| r.ranks_agree);
        let padded_equal = self.runs.iter().all(|r| r.padded == self.psi);
        let mut notes = String::from("Reading it:\n\n");
        let _ = writeln!(
            notes,
            "- {} {}",
            if agree {
                "Every rank reports the same model state and traffic as rank 0."
            } else {
                "Ranks differ (see scaling.json): the table shows rank 0."
            },
            if padded_equal {
                "Every parameter's size divides by 1, 2 and 4, so no rank holds padding: the \
                 shards add up to Ψ exactly at every N."
            } else {
                "Some parameters do not divide by N: each rank's shard is padded to a whole \
                 block (the padded Ψ column of the communication table)."
            }
        );
        let _ = writeln!(
            notes,
            "- **Stage 0** holds everything: parameters replicated ({}), the all-reduced full \
             gradients in `GradientsParams` ({}), the fp32 master and Adam's moments for the \
             whole model. The master is a copy even though parameters are f32 already: \
             `ZeroOptimizer` always steps an fp32 master (4Ψ that plain Burn's Adam does not hold).",
            mb(4.0 * psi),
            mb(4.0 * psi)
        );
        self.stage1_memory_note(&mut notes);
        self.stage2_memory_note(&mut notes);
        self.stage3_memory_note(&mut notes);
        md.push_str(&notes);
    }

    /// Stage 1's note at the largest N: why it measures below the paper's formula (the full
    /// gradients are freed when backward ends), and what it holds at the end of backward.
    fn stage1_memory_note(&self, notes: &mut String) {
        let psi = self.psi as f64;
        let Some(r) = self.run("stage1", *self.world_sizes().last().unwrap_or(&1)) else {
            return;
        };
        let n = r.world_size as f64;
        let expected = formula(1, n) * psi;
        let _ = writeln!(
            notes,
            "- **Stage 1** differs from the paper's formula by design: the paper keeps the full \
             gradients (4Ψ) until the step; burn-zero reduce-scatters them when backward ends \
             and frees them, so from then to the step a rank holds only its gradient shard \
             (4Ψ/N) — the stage-2 figure. At N = {} that is {} below the formula ({} instead \
             of {}). The full gradients do exist, during backward: the buckets peak \
             ({} = 4Ψ) is every gradient waiting for the reduction at the end of backward, \
             and with it stage 1 holds parameters + full gradients + 12Ψ/N = {} at the end \
             of backward ({} against the formula).",
            r.world_size,
            mb(expected - r.model_state() as f64),
            mb(r.model_state() as f64),
            mb(expected),
            mb(r.buckets_peak as f64),
            mb(r.params as f64 + r.buckets_peak as f64 + r.master as f64 + r.state as f64),
            percent((r.params + r.buckets_peak + r.master + r.state) as f64 / expected),
        );
    }

    /// Stage 2's note: how many buckets were reduced during backward at each N, and whether
    /// the buckets peak shows the full gradients piling up anyway.
    fn stage2_memory_note(&self, notes: &mut String) {
        let psi = self.psi as f64;
        let stage2: Vec<&Run> = self.runs.iter().filter(|r| r.name == "stage2").collect();
        if stage2.is_empty() {
            return;
        }
        let overlapped: Vec<String> = stage2
            .iter()
            .map(|r| {
                format!(
                    "{} of {} at N = {}",
                    r.overlapped, r.collectives, r.world_size
                )
            })
            .collect();
        let low = stage2.iter().map(|r| r.buckets_peak).min().unwrap_or(0);
        let high = stage2.iter().map(|r| r.buckets_peak).max().unwrap_or(0);
        let verdict = if high as f64 > 0.75 * 4.0 * psi {
            "the reduction barely overlaps backward on this model, so the full gradients do \
             pile up: the buckets peak is"
        } else {
            "the buckets peak stays at"
        };
        let _ = writeln!(
            notes,
            "- **Stage 2** reduces each {} MiB bucket on the communication thread as soon as \
             its gradients are final and frees those full gradients, so that the model's full \
             gradients need not all exist at once. The group's `last_reduction()` counts {} \
             buckets reduced before backward ended; {verdict} {}–{} (4Ψ = {}; stage 1 \
             always holds all of them). The model state after backward does not depend on it.",
            self.bucket_mb,
            overlapped.join(", "),
            mb(low as f64),
            mb(high as f64),
            mb(4.0 * psi),
        );
    }

    /// Stage 3's note: its parameter shards' peak during the optimizer step at the largest N,
    /// and the gathered peak with and without the gather cache.
    fn stage3_memory_note(&self, notes: &mut String) {
        let psi = self.psi as f64;
        let stage3_peak = self.run("stage3", *self.world_sizes().last().unwrap_or(&1));
        let _ = writeln!(
            notes,
            "- **Stage 3** also shards the parameters: everything is 1/N. Its parameter shards \
             peak a little above 4Ψ/N during the optimizer step (the new shard is written while \
             the old one is alive, one parameter at a time: {} at N = {}, against 4Ψ/N = {}); \
             the gathered peak is the largest full parameter without the cache, and the whole \
             model ({}) with the 512 MiB cache, which holds forward's gathers until backward \
             ends (the cached run is left out of the table: its model state equals stage 3's).\n",
            stage3_peak.map_or("?".into(), |r| mb(r.param_shards_peak as f64)),
            stage3_peak.map_or(0, |r| r.world_size),
            stage3_peak.map_or("?".into(), |r| mb(4.0 * psi / r.world_size as f64)),
            mb(4.0 * psi)
        );
    }

    fn comm_notes(&self, md: &mut String) {
        let psi = self.psi;
        let tied = self.numel_of(&["tokens.weight"]);
        let no_regather = self.numel_of(&["bias", "beta"]);
        let mut notes = String::from("Reading it:\n\n");
        let exact = self
            .runs
            .iter()
            .filter(|r| r.stage <= 2)
            .all(|r| r.step_bytes() as f64 == theory(r).0 * psi as f64 * ELEMENT);
        let _ = writeln!(
            notes,
            "- **Stage 0**: one all-reduce per bucket of the full gradients, 2Ψ. **Stages 1 and \
             2**: a reduce-scatter of the gradients (Ψ) and, after the step, one all-gather per \
             parameter of the updated shards into the replicated parameters (Ψ). {}",
            if exact {
                "Measured equals theory to the byte at every N."
            } else {
                "Measured differs from theory where padding applies (see the padded Ψ column)."
            }
        );
        if let Some(r) = self.run("stage3", 1) {
            let elements = |phase: &str, what: &str| int(&r.comm[phase][what]) / ELEMENT as u64;
            let forward = elements("forward", "all_gather_bytes");
            let backward = elements("backward", "all_gather_bytes");
            let predicted_forward = psi + tied;
            let predicted_backward = psi - no_regather + tied;
            let predicted = predicted_forward + predicted_backward + psi;
            let _ = writeln!(
                notes,
                "- **Stage 3 without the cache** is {:.4} × 3Ψ; the 3Ψ model assumes every \
                 parameter is gathered exactly once in forward and once in backward. Per step \
                 and rank, in elements: forward gathers {forward} = Ψ + {tied} (the token table \
                 is used twice — the embedding and the tied output head — and gathered for each \
                 use); backward re-gathers {backward} = Ψ − {no_regather} + {tied}: biases and \
                 layer-norm betas ({no_regather} elements) are never re-gathered because their \
                 gradients do not need their values, while the token table is re-gathered twice \
                 (the head's matmul and the embedding's backward both take it); the \
                 reduce-scatter moves Ψ. Predicted from the model's parameter list: {predicted} \
                 elements; measured: {} — {}.",
                r.step_bytes() as f64 / (3.0 * psi as f64 * ELEMENT),
                r.step_bytes() / ELEMENT as u64,
                if predicted * ELEMENT as u64 == r.step_bytes() {
                    "equal"
                } else {
                    "they differ"
                },
            );
        }
        let _ = writeln!(
            notes,
            "- **Stage 3 with the gather cache**: forward gathers each parameter once (the tied \
             table too) and backward finds them all in the cache, so a step is forward all-gather \
             Ψ + reduce-scatter Ψ = 2Ψ, the stage 0–2 volume, at the price of holding the gathered \
             model (the gathered peak in the memory table) until backward ends.\n\
             - Not counted because not issued: no loss all-reduce (the loss is not read), no \
             clipping or loss-scaler all-reduce (neither is used). The one barrier per step at \
             stages 0, 2 and 3 is the end-of-backward fence of the overlapped reduction; it moves \
             no data. At N = 1 the collectives still run (a one-rank `LocalGroup` copies), so \
             the same bytes are counted; they cross no link.\n"
        );
        md.push_str(&notes);
    }
}

/// A UTC date and time ("2026-11-23 04:56 UTC") from seconds since 1970.
const SECTION_START: &str = "<!-- instructions -->";
const SECTION_END: &str = "<!-- /instructions -->";

/// The single-rank overhead in instructions (`benches/plain-burn/instructions.sh`), between
/// markers so that `--instructions-only` can replace it in place.
fn instructions_section(v: &Value) -> String {
    let mut md = String::new();
    let few = int(&v["few_steps"]);
    let many = int(&v["many_steps"]);
    let plain = num(&v["plain"]["per_step"]);
    let _ = writeln!(md, "{SECTION_START}");
    let _ = writeln!(
        md,
        "### Single-rank overhead in instructions

         Wall-clock differences of a few percent drown in this machine's noise; instructions do          not. `benches/plain-burn/instructions.sh` runs GPT `small` training steps (the same          model, batches and Adam as above) on Flex with one rayon thread, under          `valgrind --tool=callgrind`, which counts every instruction of every thread of the          process: plain Burn (`Autodiff<Flex>`, Burn's Adam) and burn-zero at N = 1          (`Autodiff<Zero<Flex>>`, `ZeroOptimizer` with Adam, every parameter sharded). Each          runs once with {few} and once with {many} steps after one untimed step; the          difference divided by {} is one step, start-up and the first step cancelled out.          Measured {} on {} ({}).
",
        many - few,
        utc(int(&v["unix_time"])),
        v["cpu"].as_str().unwrap_or("?"),
        v["valgrind"].as_str().unwrap_or("valgrind"),
    );
    let _ = writeln!(
        md,
        "| side | instructions, {few} step(s) | {many} steps | per step | against plain Burn |
         |---|---|---|---|---|"
    );
    let mut worst: f64 = 0.0;
    for (key, name) in [
        ("plain", "plain Burn"),
        ("stage0", "burn-zero, stage 0"),
        ("stage3", "burn-zero, stage 3"),
    ] {
        let side = &v[key];
        let per_step = num(&side["per_step"]);
        let ratio = per_step / plain;
        if key != "plain" {
            worst = worst.max(ratio);
        }
        let _ = writeln!(
            md,
            "| {name} | {:.3e} | {:.3e} | {:.4e} | {ratio:.4}× |",
            num(&side["few"]),
            num(&side["many"]),
            per_step
        );
    }
    let _ = writeln!(
        md,
        "
The goal is at most 1.05× plain Burn's instructions per step: {} (worst {worst:.4}×).
",
        if worst <= 1.05 { "met" } else { "not met" }
    );
    let _ = writeln!(
        md,
        "{SECTION_END}
"
    );
    // The literals above carry their source indentation: one space between words, and no
    // indentation (an indented table line would be a code block).
    let mut tidy: String = md
        .lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n");
    tidy.push('\n');
    tidy
}

/// `text` with its instruction-count section replaced by `section`, or with `section` added
/// before the memory section when it has none.
fn with_section(text: &str, section: &str) -> String {
    if let (Some(start), Some(end)) = (text.find(SECTION_START), text.find(SECTION_END)) {
        let after = text[end + SECTION_END.len()..].trim_start_matches('\n');
        return format!("{}{section}{after}", &text[..start]);
    }
    match text.find("### Where a single-rank step goes") {
        Some(at) => format!("{}{section}{}", &text[..at], &text[at..]),
        None => format!("{text}\n{section}"),
    }
}

fn utc(seconds: u64) -> String {
    let format = time::macros::format_description!("[year]-[month]-[day] [hour]:[minute] UTC");
    i64::try_from(seconds)
        .ok()
        .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .and_then(|t| t.format(&format).ok())
        .unwrap_or_else(|| format!("{seconds} s after 1970"))
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::{SECTION_END, SECTION_START, utc, with_section};

    #[test]
    fn the_instruction_section_is_replaced_in_place_or_added() {
        let section = format!("{SECTION_START}\nnew\n{SECTION_END}\n\n");
        let want = format!("# A\n\n{section}### Where a single-rank step goes\n");
        let old = format!(
            "# A\n\n{SECTION_START}\nold\n{SECTION_END}\n\n### Where a single-rank step goes\n"
        );
        assert_eq!(with_section(&old, &section), want);
        let none = "# A\n\n### Where a single-rank step goes\n";
        assert_eq!(with_section(none, &section), want);
    }

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01 00:00 UTC");
        // 2024-02-29 12:34:56 UTC, a leap day.
        assert_eq!(utc(1_709_210_096), "2024-02-29 12:34 UTC");
        assert_eq!(utc(1_795_410_960), "2026-11-23 05:16 UTC");
    }
}
