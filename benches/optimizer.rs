//! One Adam step over a flat f32 shard (the piece of the model a rank steps), at 1M, 10M and
//! 50M parameters, all in one run, with one thread count on every side:
//!
//! - **fused**: `FusedAdam` (burn-zero's one-pass step) through `SimpleOptimizer::step` on a
//!   Flex tensor, its state kept from step to step, as `ZeroOptimizer::adam` steps a shard;
//! - **pass alone**: `burn_zero_kernels::host::adam_step` on `Vec<f32>`s, without tensors
//!   around it;
//! - **Burn per-tensor**: Burn's `Adam` (`AdamConfig::new().build()`) on the same Flex tensor;
//! - **bound**: 28 bytes per parameter (read p, g, m, v; write p, m, v) over the streaming
//!   bandwidth of a triad loop (`a[i] = b[i] + s·c[i]`, STREAM's count of 12 bytes an element)
//!   over three arrays of the same length, split over the same threads, measured in the same
//!   rounds;
//! - **PyTorch**: `torch.optim.Adam(foreach=True)` and `(fused=True)` from
//!   `benches/optimizer_torch.py`, run with `python3` when torch imports (otherwise the bench
//!   says how to get that row and goes on);
//! - **wgpu**: Burn's `Adam` and `FusedAdam` on `burn::backend::Wgpu`, which in this workspace
//!   (Burn without its `fusion` feature) is the plain `CubeBackend<WgpuRuntime>` (Mesa's
//!   lavapipe on a machine without a GPU): `FusedAdam` there is one launch of burn-zero's Adam
//!   kernel per step, Burn's `Adam` a dozen element-wise kernels.
//!
//! Threads: `available_parallelism()` (the CPUs this process may run on; `taskset` narrows
//! it), which is what `FusedAdam` splits its pass over; `RAYON_NUM_THREADS` (Flex's pool) and
//! PyTorch's `set_num_threads` are set to the same number.
//!
//! Every side is created and warmed up first (`WARM_UP` steps: the first allocates and touches
//! the moments), then the sides alternate, `ROUNDS` times: one more untimed step, then a fixed
//! number of steps, each timed on its own. Reported: the median step, the Adam traffic rate
//! (28 B/param over it), its share of the bandwidth bound, speed-ups, and the heap bytes
//! allocated and minor page faults per timed step (both 0 for a step in place). The fused,
//! pass-alone and Burn sides take the same steps from the same start, so their parameters are
//! compared bit for bit at the end. Medians go to stdout and to
//! `target/bench-reports/optimizer.md` and `.json`, with PASS/FAIL for the targets.
//!
//! Environment: `OPTIMIZER_SIZES` (`1M,10M,50M`), `OPTIMIZER_ROUNDS` (5), `OPTIMIZER_WGPU`
//! (`0` skips wgpu), `OPTIMIZER_WGPU_MAX` (the largest size run on wgpu, `10M`: lavapipe
//! refuses a 200 MB buffer, and takes a second a step at 10M), `OPTIMIZER_TORCH` (`0` skips
//! PyTorch). Not a criterion benchmark: sides
//! alternate within each round so drift on a shared machine falls on all of them alike.
//! `cargo bench --bench optimizer`.

#[path = "common/adapter.rs"]
mod adapter;
#[path = "common/report.rs"]
mod report;
#[path = "common/workload.rs"]
mod workload;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Flex, Wgpu};
use burn::optim::{AdamConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_zero::optim::FusedAdam;
use burn_zero_kernels::host::{AdamRule, AdamStep, adam_step};
use workload::median;

/// Counts the heap bytes requested, to show which steps allocate.
struct Counting;

static ALLOCATED: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let grown = new_size.saturating_sub(layout.size());
        ALLOCATED.fetch_add(grown as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const LR: f64 = 1e-3;
/// Burn's `AdamConfig` defaults (its fields are private; `FusedAdam` reads the same).
const BETA_1: f32 = 0.9;
const BETA_2: f32 = 0.999;
const EPSILON: f32 = 1e-5;
/// Bytes an Adam step moves per parameter: reads p, g, m, v; writes p, m, v.
const ADAM_BYTES: f64 = 28.0;
/// Bytes a triad moves per element, as STREAM counts them: reads b, c; writes a.
const TRIAD_BYTES: f64 = 12.0;
const WARM_UP: usize = 3;
const DEFAULT_ROUNDS: usize = 5;
const TORCH_SCRIPT: &str = "benches/optimizer_torch.py";
const TORCH_INSTALL: &str = "pip install torch --index-url https://download.pytorch.org/whl/cpu";

/// Timed steps per side and round: about 100M parameters a round, at least 5, at most 50
/// (`optimizer_torch.py` chooses the same).
fn steps_for(n: usize) -> usize {
    (100_000_000 / n).clamp(5, 50)
}

/// Minor page faults of this process so far (`/proc/self/stat`, field 10).
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    after
        .split_whitespace()
        .nth(7)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// One side of the comparison: a step, and its parameters afterwards.
trait Side {
    fn step(&mut self);
    fn params(&mut self) -> Option<Vec<f32>>;
}

/// The triad loop, split over `threads` like `adam_step`.
struct Triad {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    threads: usize,
}

fn triad_part(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
        *a = b + s * c;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn triad_avx2(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    triad_part(a, b, c, s);
}

fn triad(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2, `triad_avx2`'s only requirement; its body is safe.
        unsafe { triad_avx2(a, b, c, s) };
        return;
    }
    triad_part(a, b, c, s);
}

impl Side for Triad {
    fn step(&mut self) {
        let per = self.a.len().div_ceil(self.threads);
        std::thread::scope(|scope| {
            let parts = self
                .a
                .chunks_mut(per)
                .zip(self.b.chunks(per))
                .zip(self.c.chunks(per));
            for ((a, b), c) in parts {
                scope.spawn(move || triad(a, b, c, 0.5));
            }
        });
        std::hint::black_box(&self.a);
    }
    fn params(&mut self) -> Option<Vec<f32>> {
        None
    }
}

/// `adam_step` on plain vectors.
struct Pass {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    time: i32,
    threads: usize,
}

impl Side for Pass {
    fn step(&mut self) {
        self.time += 1;
        let step = AdamStep {
            rule: AdamRule::Adam { weight_decay: None },
            lr: LR as f32,
            beta_1: BETA_1,
            beta_2: BETA_2,
            epsilon: EPSILON,
            time: self.time,
            factor: None,
        };
        adam_step(
            &step,
            &mut self.p,
            &self.g,
            &mut self.m,
            &mut self.v,
            self.threads,
        );
    }
    fn params(&mut self) -> Option<Vec<f32>> {
        Some(self.p.clone())
    }
}

/// A Burn `SimpleOptimizer` stepping one flat tensor; the tensor and state are moved in and
/// out of each step, so nothing else holds their buffers.
struct Optimizer<B: Backend, O: SimpleOptimizer<B>> {
    optimizer: O,
    p: Option<Tensor<B, 1>>,
    g: Tensor<B, 1>,
    state: Option<O::State<1>>,
    device: B::Device,
}

impl<B: Backend, O: SimpleOptimizer<B>> Side for Optimizer<B, O> {
    fn step(&mut self) {
        let p = self.p.take().expect("parameters");
        let (p, state) = self
            .optimizer
            .step(LR, p, self.g.clone(), self.state.take());
        self.p = Some(p);
        self.state = state;
        B::sync(&self.device).expect("sync");
    }
    fn params(&mut self) -> Option<Vec<f32>> {
        let p = self.p.clone().expect("parameters");
        Some(p.into_data().to_vec::<f32>().expect("f32"))
    }
}

fn flat<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// The starting parameters and the (fixed) gradient: reproducible, of mixed sign and scale.
fn inputs(n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let p: Vec<f32> = (0..n).map(|_| next()).collect();
    let g: Vec<f32> = (0..n).map(|_| next() * 1e-2).collect();
    (p, g)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Fused,
    Pass,
    Burn,
    Triad,
    WgpuBurn,
    WgpuFused,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Fused => "FusedAdam, Flex (one pass)",
            Kind::Pass => "adam_step on Vec<f32> (the pass alone)",
            Kind::Burn => "Burn Adam per-tensor, Flex",
            Kind::Triad => "triad a = b + s·c",
            Kind::WgpuBurn => "Burn Adam per-tensor, wgpu",
            Kind::WgpuFused => "FusedAdam, wgpu (one kernel launch)",
        }
    }
    fn key(self) -> &'static str {
        match self {
            Kind::Fused => "fused_flex",
            Kind::Pass => "pass_alone",
            Kind::Burn => "burn_flex",
            Kind::Triad => "triad",
            Kind::WgpuBurn => "burn_wgpu",
            Kind::WgpuFused => "fused_wgpu",
        }
    }
}

#[derive(Default, Clone)]
struct Samples {
    ms: Vec<f64>,
    bytes_allocated: u64,
    faults: u64,
    steps: u64,
}

impl Samples {
    fn median(&self) -> f64 {
        median(&self.ms)
    }
    fn alloc_per_step(&self) -> f64 {
        self.bytes_allocated as f64 / self.steps.max(1) as f64
    }
    fn faults_per_step(&self) -> f64 {
        self.faults as f64 / self.steps.max(1) as f64
    }
}

/// One round of one side: an untimed step, then `steps` timed ones.
fn round(side: &mut dyn Side, steps: usize, into: &mut Samples) {
    side.step();
    let (bytes, faults) = (ALLOCATED.load(Ordering::Relaxed), minor_faults());
    for _ in 0..steps {
        let started = Instant::now();
        side.step();
        into.ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    into.bytes_allocated += ALLOCATED.load(Ordering::Relaxed) - bytes;
    into.faults += minor_faults() - faults;
    into.steps += steps as u64;
}

/// PyTorch's two sides for one round at `n`, or why there are none.
struct TorchRound {
    version: String,
    threads: usize,
    foreach: Vec<f64>,
    fused: Vec<f64>,
}

fn torch_round(n: usize, steps: usize, threads: usize) -> Result<TorchRound, String> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(TORCH_SCRIPT);
    let output = std::process::Command::new("python3")
        .arg(&script)
        .args(["--sizes", &n.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--rounds", "1", "--warmup", &WARM_UP.to_string()])
        .args(["--steps", &steps.to_string()])
        .env("OMP_NUM_THREADS", threads.to_string())
        .output()
        .map_err(|e| format!("python3 could not be run: {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().last().unwrap_or("").to_string();
        return Err(format!(
            "{} exited with {}: {last}",
            TORCH_SCRIPT, output.status
        ));
    }
    let json: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| format!("{TORCH_SCRIPT} printed no JSON: {e}"))?;
    let size = &json["sizes"][0];
    let samples = |mode: &str| -> Vec<f64> {
        size[mode]["samples_ms"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
            .unwrap_or_default()
    };
    Ok(TorchRound {
        version: json["torch"].as_str().unwrap_or("?").to_string(),
        threads: json["threads"].as_u64().unwrap_or(0) as usize,
        foreach: samples("foreach"),
        fused: samples("fused"),
    })
}

fn torch_available() -> Result<(), String> {
    let status = std::process::Command::new("python3")
        .args(["-c", "import torch"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("python3 could not be run ({e})"))?;
    if status.success() {
        Ok(())
    } else {
        Err("PyTorch does not import in python3".into())
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn parse_size(s: &str) -> usize {
    let s = s.trim();
    let (digits, scale) = match s.strip_suffix(['M', 'm']) {
        Some(d) => (d, 1_000_000),
        None => match s.strip_suffix(['K', 'k']) {
            Some(d) => (d, 1_000),
            None => (s, 1),
        },
    };
    digits
        .parse::<usize>()
        .expect("OPTIMIZER_SIZES: counts like 1M,10M,50M")
        * scale
}

fn label(n: usize) -> String {
    if n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else {
        n.to_string()
    }
}

/// Everything measured at one size.
struct SizeResult {
    n: usize,
    steps: usize,
    sides: Vec<(Kind, Samples)>,
    torch_foreach: Vec<f64>,
    torch_fused: Vec<f64>,
    bitwise: Option<bool>,
    wgpu_bitwise: Option<bool>,
}

impl SizeResult {
    fn side(&self, kind: Kind) -> Option<&Samples> {
        self.sides.iter().find(|(k, _)| *k == kind).map(|(_, s)| s)
    }
    fn median(&self, kind: Kind) -> f64 {
        self.side(kind).map_or(f64::NAN, Samples::median)
    }
    /// Streaming bandwidth from the triad, bytes per second.
    fn bandwidth(&self) -> f64 {
        TRIAD_BYTES * self.n as f64 / (self.median(Kind::Triad) * 1e-3)
    }
    /// The bandwidth bound on an Adam step, ms.
    fn bound_ms(&self) -> f64 {
        ADAM_BYTES * self.n as f64 / self.bandwidth() * 1e3
    }
    fn traffic(&self, ms: f64) -> f64 {
        ADAM_BYTES * self.n as f64 / (ms * 1e-3) / 1e9
    }
}

/// Measures every side at `n` parameters: builds and warms them up, alternates them (and
/// PyTorch, when `torch`) for `rounds` rounds, then checks that the sides agree bit for bit.
fn measure_size(
    n: usize,
    rounds: usize,
    threads: usize,
    torch: bool,
    wgpu: Option<&WgpuDevice>,
) -> SizeResult {
    let steps = steps_for(n);
    let (start, grad) = inputs(n);
    let mut sides = build_sides(&start, &grad, threads, wgpu);
    drop((start, grad));
    warm_up(&mut sides, n);
    let mut samples = vec![Samples::default(); sides.len()];
    let (mut torch_foreach, mut torch_fused) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        for ((kind, side), into) in sides.iter_mut().zip(&mut samples) {
            let before = into.ms.len();
            round(side.as_mut(), steps, into);
            eprintln!(
                "{} round {r}: {} {:.3} ms",
                label(n),
                kind.name(),
                median(&into.ms[before..])
            );
        }
        if torch {
            torch_side(n, r, steps, threads, &mut torch_foreach, &mut torch_fused);
        }
    }
    let (bitwise, wgpu_bitwise) = compare_params(&mut sides, wgpu);
    SizeResult {
        n,
        steps,
        sides: sides.iter().map(|(k, _)| *k).zip(samples).collect(),
        torch_foreach,
        torch_fused,
        bitwise,
        wgpu_bitwise,
    }
}

/// Every side of the comparison, all from the same parameters `start` and gradient `grad`:
/// the triad, the pass alone, `FusedAdam` and Burn's Adam on Flex, and with a `wgpu` device
/// Burn's Adam and `FusedAdam` there too.
fn build_sides(
    start: &[f32],
    grad: &[f32],
    threads: usize,
    wgpu: Option<&WgpuDevice>,
) -> Vec<(Kind, Box<dyn Side>)> {
    let n = start.len();
    let flex = Default::default();
    let fused = FusedAdam::new(&AdamConfig::new()).expect("Burn's default Adam fuses");
    assert!(
        fused.fuses::<Flex>(),
        "FusedAdam takes the one-pass path on Flex"
    );
    let mut sides: Vec<(Kind, Box<dyn Side>)> = vec![
        (
            Kind::Triad,
            Box::new(Triad {
                a: vec![0.0; n],
                b: start.to_vec(),
                c: grad.to_vec(),
                threads,
            }),
        ),
        (
            Kind::Pass,
            Box::new(Pass {
                p: start.to_vec(),
                g: grad.to_vec(),
                m: vec![0.0; n],
                v: vec![0.0; n],
                time: 0,
                threads,
            }),
        ),
        (
            Kind::Fused,
            Box::new(Optimizer::<Flex, _> {
                optimizer: fused.clone(),
                p: Some(flat(start, &flex)),
                g: flat(grad, &flex),
                state: None,
                device: flex,
            }),
        ),
        (
            Kind::Burn,
            Box::new(Optimizer::<Flex, _> {
                optimizer: AdamConfig::new().build(),
                p: Some(flat(start, &flex)),
                g: flat(grad, &flex),
                state: None,
                device: flex,
            }),
        ),
    ];
    if let Some(device) = wgpu {
        sides.push((
            Kind::WgpuBurn,
            Box::new(Optimizer::<Wgpu, _> {
                optimizer: AdamConfig::new().build(),
                p: Some(flat(start, device)),
                g: flat(grad, device),
                state: None,
                device: device.clone(),
            }),
        ));
        sides.push((
            Kind::WgpuFused,
            Box::new(Optimizer::<Wgpu, _> {
                optimizer: fused.clone(),
                p: Some(flat(start, device)),
                g: flat(grad, device),
                state: None,
                device: device.clone(),
            }),
        ));
    }
    sides
}

/// `WARM_UP` untimed steps of every side (the first allocates and touches the moments), each
/// side's time reported, so that the timed rounds see steady-state steps only.
fn warm_up(sides: &mut [(Kind, Box<dyn Side>)], n: usize) {
    for (kind, side) in sides {
        let started = Instant::now();
        for _ in 0..WARM_UP {
            side.step();
        }
        eprintln!(
            "{}: {} warmed up ({WARM_UP} steps, {:.1} s)",
            label(n),
            kind.name(),
            started.elapsed().as_secs_f64()
        );
    }
}

/// PyTorch's round `r` at `n`: its foreach and fused samples appended to `foreach` and
/// `fused`, or why it failed reported (the bench goes on without them).
fn torch_side(
    n: usize,
    r: usize,
    steps: usize,
    threads: usize,
    foreach: &mut Vec<f64>,
    fused: &mut Vec<f64>,
) {
    match torch_round(n, steps, threads) {
        Ok(t) => {
            assert_eq!(t.threads, threads, "PyTorch's thread count");
            eprintln!(
                "{} round {r}: PyTorch {} foreach {:.3} ms, fused {:.3} ms",
                label(n),
                t.version,
                median(&t.foreach),
                median(&t.fused)
            );
            foreach.extend(t.foreach);
            fused.extend(t.fused);
        }
        Err(e) => eprintln!("{} round {r}: PyTorch failed: {e}", label(n)),
    }
}

/// Whether the host sides (pass alone, fused and Burn on Flex) and, with `wgpu`, the two wgpu
/// sides ended with the same parameters bit for bit: they took the same steps from the same
/// start with the same gradient.
fn compare_params(
    sides: &mut [(Kind, Box<dyn Side>)],
    wgpu: Option<&WgpuDevice>,
) -> (Option<bool>, Option<bool>) {
    let mut params = |kind: Kind| {
        sides
            .iter_mut()
            .find(|(k, _)| *k == kind)
            .and_then(|(_, s)| s.params())
    };
    let bits = |v: Option<Vec<f32>>| v.map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>());
    let (pass, fused_p, burn_p) = (
        bits(params(Kind::Pass)),
        bits(params(Kind::Fused)),
        bits(params(Kind::Burn)),
    );
    let bitwise = Some(pass == fused_p && fused_p == burn_p);
    let wgpu_bitwise = wgpu.map(|_| bits(params(Kind::WgpuBurn)) == bits(params(Kind::WgpuFused)));
    (bitwise, wgpu_bitwise)
}

fn main() {
    // `cargo test --benches` runs bench targets without `--bench`; only `cargo bench` measures.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Before Flex's rayon pool starts (on its first parallel op), and before any other thread.
    // SAFETY: no other thread runs yet, so nothing reads the environment concurrently.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.to_string()) };
    let sizes: Vec<usize> = env_or("OPTIMIZER_SIZES", "1M,10M,50M")
        .split(',')
        .map(parse_size)
        .collect();
    let rounds: usize = env_or("OPTIMIZER_ROUNDS", &DEFAULT_ROUNDS.to_string())
        .parse()
        .expect("OPTIMIZER_ROUNDS: a number");
    let avx2 = {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    };
    let torch = if env_or("OPTIMIZER_TORCH", "1") == "0" {
        Err("skipped (OPTIMIZER_TORCH=0)".to_string())
    } else {
        torch_available()
    };
    if let Err(why) = &torch {
        eprintln!(
            "PyTorch row: {why}. To get it: `{TORCH_INSTALL}` (or `pip install torch`), then rerun; \
             or run `python3 {TORCH_SCRIPT} --threads {threads}` on its own."
        );
    }
    let adapter = if env_or("OPTIMIZER_WGPU", "1") == "0" {
        Err("skipped (OPTIMIZER_WGPU=0)".to_string())
    } else {
        adapter::wgpu_adapter()
    };
    if let Err(why) = &adapter {
        eprintln!("wgpu rows: no adapter: {why}");
    }
    let wgpu = WgpuDevice::default();
    let wgpu_max = parse_size(&env_or("OPTIMIZER_WGPU_MAX", "10M"));
    let results: Vec<SizeResult> = sizes
        .iter()
        .map(|&n| {
            measure_size(
                n,
                rounds,
                threads,
                torch.is_ok(),
                (adapter.is_ok() && n <= wgpu_max).then_some(&wgpu),
            )
        })
        .collect();
    report(&results, threads, avx2, rounds, &torch, &adapter);
}

fn torch_version() -> Option<String> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import torch; print(torch.__version__)"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn report(
    results: &[SizeResult],
    threads: usize,
    avx2: bool,
    rounds: usize,
    torch: &Result<(), String>,
    adapter: &Result<String, String>,
) {
    let (cpu, cpus, mem, _) = workload::machine();
    let torch_version = torch.as_ref().ok().and_then(|_| torch_version());
    let mut md = format!(
        "One Adam step over one flat f32 shard; {cpu}, {cpus} CPUs, {:.0} GiB; {threads} threads \
         on every side (FusedAdam's pass and the triad: `available_parallelism`; Flex: \
         RAYON_NUM_THREADS={threads}; PyTorch: set_num_threads({threads})); AVX2 {}; medians of \
         {rounds} alternating rounds after {WARM_UP} warm-up steps; PyTorch: {}.\n\n\
         Traffic = 28 B/param / step time; bound = 28 B/param / triad bandwidth (12 B/element, \
         STREAM's count); heap and faults are per timed step.\n\n\
         | size | side | median step ms | Adam traffic GB/s | % of bound | × Burn per-tensor | × torch fused | heap allocated / step | minor faults / step |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        mem as f64 / (1u64 << 30) as f64,
        if avx2 {
            "used"
        } else {
            "absent (baseline x86-64 loop)"
        },
        torch_version.as_deref().unwrap_or("not run"),
    );
    for r in results {
        host_rows(&mut md, r);
    }
    let json_sizes: Vec<serde_json::Value> = results.iter().map(size_json).collect();
    md.push_str("\nFused, pass-alone and Burn per-tensor parameters after the run, bit for bit: ");
    md.push_str(
        &results
            .iter()
            .map(|r| format!("{} {}", label(r.n), yes_no(r.bitwise)))
            .collect::<Vec<_>>()
            .join(", "),
    );
    md.push_str(".\n\n");

    let targets = targets(results, threads);
    md.push_str("Targets:\n\n");
    for (what, pass, detail) in &targets {
        let verdict = match pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "NOT RUN",
        };
        md.push_str(&format!("- {verdict}: {what}: {detail}\n"));
    }

    md.push_str(&wgpu_section(results, adapter));
    if let Err(why) = torch {
        md.push_str(&format!(
            "\nPyTorch: not measured ({why}). To get the row: `{TORCH_INSTALL}`, then rerun, or \
             `python3 {TORCH_SCRIPT} --threads {threads}`.\n"
        ));
    }
    let json = serde_json::json!({
        "cpu": cpu,
        "cpus": cpus,
        "memory_bytes": mem,
        "threads": threads,
        "avx2": avx2,
        "rounds": rounds,
        "warm_up_steps": WARM_UP,
        "torch": torch_version,
        "wgpu_adapter": adapter.as_ref().ok(),
        "adam_bytes_per_param": ADAM_BYTES,
        "triad_bytes_per_element": TRIAD_BYTES,
        "sizes": json_sizes,
        "targets": targets.iter().map(|(what, pass, detail)| serde_json::json!({
            "target": what, "pass": pass, "detail": detail,
        })).collect::<Vec<_>>(),
    });
    report::publish("optimizer", &md, Some(&json));
}

/// The host table's rows of one size: each host side, PyTorch's where it ran, and the bound.
fn host_rows(md: &mut String, r: &SizeResult) {
    let burn = r.median(Kind::Burn);
    let torch_fused = median(&r.torch_fused);
    let bound = r.bound_ms();
    let row = |md: &mut String, name: &str, ms: f64, samples: Option<&Samples>| {
        let heap = samples.map_or("—".into(), |s| bytes(s.alloc_per_step()));
        let faults = samples.map_or("—".into(), |s| format!("{:.0}", s.faults_per_step()));
        md.push_str(&format!(
            "| {} | {name} | {} | {} | {} | {} | {} | {heap} | {faults} |\n",
            label(r.n),
            fmt(ms, 3),
            fmt(r.traffic(ms), 1),
            pct(bound / ms),
            times(burn / ms),
            times(torch_fused / ms),
        ));
    };
    for kind in [Kind::Fused, Kind::Pass, Kind::Burn] {
        row(md, kind.name(), r.median(kind), r.side(kind));
    }
    if !r.torch_foreach.is_empty() {
        row(
            md,
            "PyTorch Adam(foreach=True)",
            median(&r.torch_foreach),
            None,
        );
        row(md, "PyTorch Adam(fused=True)", torch_fused, None);
    }
    row(
        md,
        &format!(
            "bound: 28 B/param at the triad's {:.1} GB/s",
            r.bandwidth() / 1e9
        ),
        bound,
        None,
    );
}

/// One size's results for the JSON report.
fn size_json(r: &SizeResult) -> serde_json::Value {
    let mut sides = serde_json::Map::new();
    for (kind, s) in &r.sides {
        sides.insert(
            kind.key().into(),
            serde_json::json!({
                "name": kind.name(),
                "median_ms": s.median(),
                "adam_traffic_gbs": if *kind == Kind::Triad { f64::NAN } else { r.traffic(s.median()) },
                "heap_bytes_per_step": s.alloc_per_step(),
                "minor_faults_per_step": s.faults_per_step(),
                "samples_ms": s.ms,
            }),
        );
    }
    for (key, ms) in [
        ("torch_foreach", &r.torch_foreach),
        ("torch_fused", &r.torch_fused),
    ] {
        if !ms.is_empty() {
            sides.insert(
                key.into(),
                serde_json::json!({ "median_ms": median(ms), "adam_traffic_gbs": r.traffic(median(ms)), "samples_ms": ms }),
            );
        }
    }
    serde_json::json!({
        "n": r.n,
        "steps_per_round": r.steps,
        "triad_gbs": r.bandwidth() / 1e9,
        "bound_ms": r.bound_ms(),
        "host_sides_bitwise_equal": r.bitwise,
        "wgpu_sides_bitwise_equal": r.wgpu_bitwise,
        "sides": sides,
    })
}

/// The targets, at the largest size measured (they are set at 50M): what, PASS or FAIL (`None`:
/// not run) and the figures.
fn targets(results: &[SizeResult], threads: usize) -> Vec<(String, Option<bool>, String)> {
    let mut targets = Vec::new();
    if let Some(r) = results.iter().max_by_key(|r| r.n) {
        let fused = r.median(Kind::Fused);
        let share = r.bound_ms() / fused;
        targets.push((
            format!(
                "fused host step ≥ 60% of the bandwidth bound at {}",
                label(r.n)
            ),
            Some(share >= 0.6),
            format!(
                "{} ({} ms against a bound of {} ms)",
                pct(share),
                fmt(fused, 2),
                fmt(r.bound_ms(), 2)
            ),
        ));
        let speedup = r.median(Kind::Burn) / fused;
        targets.push((
            format!("≥ 5× Burn's per-tensor Adam on Flex at {}", label(r.n)),
            Some(speedup >= 5.0),
            format!(
                "{} ({} ms against {} ms)",
                times(speedup),
                fmt(fused, 2),
                fmt(r.median(Kind::Burn), 2)
            ),
        ));
        let torch_fused = median(&r.torch_fused);
        targets.push((
            format!(
                "faster than PyTorch's fused CPU Adam at {}, {threads} threads",
                label(r.n)
            ),
            (!r.torch_fused.is_empty()).then_some(fused < torch_fused),
            if r.torch_fused.is_empty() {
                format!("not measured: PyTorch absent (`{TORCH_INSTALL}`)")
            } else {
                format!(
                    "{} ms against {} ms ({})",
                    fmt(fused, 2),
                    fmt(torch_fused, 2),
                    times(torch_fused / fused)
                )
            },
        ));
    }
    targets
}

/// The wgpu table, or why it was not measured.
fn wgpu_section(results: &[SizeResult], adapter: &Result<String, String>) -> String {
    let mut md = String::new();
    match adapter {
        Ok(name) => {
            md.push_str(&format!(
                "\nwgpu ({name}; the plain `CubeBackend`, Burn's fusion off): `FusedAdam` is one \
                 launch of the Adam kernel per step, Burn's Adam a dozen element-wise kernels.\n\n\
                 | size | side | median step ms | Adam traffic GB/s | vs Burn per-tensor, wgpu |\n\
                 |---|---|---|---|---|\n"
            ));
            for r in results.iter().filter(|r| r.wgpu_bitwise.is_some()) {
                for kind in [Kind::WgpuBurn, Kind::WgpuFused] {
                    let ms = r.median(kind);
                    md.push_str(&format!(
                        "| {} | {} | {} | {} | {} |\n",
                        label(r.n),
                        kind.name(),
                        fmt(ms, 2),
                        fmt(r.traffic(ms), 2),
                        times(r.median(Kind::WgpuBurn) / ms)
                    ));
                }
            }
            md.push_str(&format!(
                "\nBoth wgpu sides' parameters after the run, bit for bit: {}.\n",
                results
                    .iter()
                    .filter(|r| r.wgpu_bitwise.is_some())
                    .map(|r| format!("{} {}", label(r.n), yes_no(r.wgpu_bitwise)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            let left: Vec<String> = results
                .iter()
                .filter(|r| r.wgpu_bitwise.is_none())
                .map(|r| label(r.n))
                .collect();
            if !left.is_empty() {
                md.push_str(&format!(
                    "Not run on wgpu: {} (above `OPTIMIZER_WGPU_MAX`; lavapipe refuses buffers \
                 that large).\n",
                    left.join(", ")
                ));
            }
        }
        Err(why) => md.push_str(&format!("\nwgpu: not measured ({why}).\n")),
    }
    md
}

fn fmt(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "—".into()
    }
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.0}%", x * 100.0)
    } else {
        "—".into()
    }
}

fn times(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}×")
    } else {
        "—".into()
    }
}

fn yes_no(x: Option<bool>) -> &'static str {
    match x {
        Some(true) => "equal",
        Some(false) => "DIFFER",
        None => "—",
    }
}

fn bytes(b: f64) -> String {
    if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}
