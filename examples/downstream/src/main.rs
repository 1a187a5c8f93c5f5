//! burn-zero as a project outside this repository uses it: Burn's own backend aliases
//! (`burn::backend::Flex`, `NdArray`, `Wgpu`, and with `--features cuda` `Cuda`, fused by
//! default), `Autodiff<Zero<…>>`, `shard`, `ZeroOptimizer`.
//!
//! It trains a small regressor at ZeRO stage 3 on two ranks and on one rank with the same
//! global batch, and fails unless the loss falls, the two ranks hold bitwise the same
//! parameters, and the two-rank losses follow the one-rank ones.
//!
//! ```text
//! cargo run --release -- --backend flex
//! cargo run --release -- --backend wgpu         # Burn's default Wgpu: fusion on
//! torchrun-style, one process per GPU:          # with --features cuda
//! zero-run --nproc-per-node 2 -- target/release/burn-zero-downstream --backend cuda-nccl
//! ```

use burn::backend::{Autodiff, Flex, NdArray, Wgpu};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, activation::gelu};
use burn_zero::comm::{RankContext, ReduceOp, launch};
use burn_zero::{Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard, unshard};
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendChoice {
    /// `burn::backend::Flex` (CPU).
    Flex,
    /// `burn::backend::NdArray` (CPU).
    Ndarray,
    /// `burn::backend::Wgpu`: `Fusion<CubeBackend<WgpuRuntime>>` with Burn's default features.
    Wgpu,
    /// `burn::backend::Cuda` with NCCL, one process per GPU started by `zero-run`.
    #[cfg(feature = "cuda")]
    CudaNccl,
}

#[derive(Parser, Debug)]
#[command(about = "burn-zero from a crate outside its repository: 2-rank ZeRO-3 against 1 rank")]
struct Args {
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendChoice,
    /// Optimizer steps.
    #[arg(long, default_value_t = 40)]
    steps: usize,
}

const FEATURES: usize = 8;
const HIDDEN: usize = 64;
const BATCH: usize = 64;
const LR: f64 = 0.01;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    /// Hidden layers (GELU after each), then a linear read-out.
    layers: Vec<Linear<B>>,
    head: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        let widths = [FEATURES, HIDDEN, HIDDEN];
        Self {
            layers: widths
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
            head: LinearConfig::new(HIDDEN, 1).init(device),
        }
    }

    /// A model with its values drawn now: Burn initialises parameters lazily, on first use,
    /// so clones of a fresh model (one per rank and per run here) would each draw their own.
    fn materialised(device: &B::Device) -> Self {
        let model = Self::new(device);
        let values = model.clone().into_record();
        model.load_record(values)
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let hidden = self
            .layers
            .iter()
            .fold(x, |h, layer| gelu(layer.forward(h)));
        self.head.forward(hidden)
    }
}

/// Feature `j` of global row `row` of batch `step`: a fixed quasi-random point in [-1, 1)
/// (Weyl sequence), the same on every backend and rank.
fn feature(step: usize, row: usize, j: usize) -> f32 {
    let n = (step * 7919 + row * FEATURES + j) as f64;
    ((n * 0.618_033_988_749_895).fract() * 2.0 - 1.0) as f32
}

/// Rows `rows` of batch `step`: y = cos(x0 + x1) · x2 + 0.25 · Σ x.
fn batch<B: Backend>(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let n = rows.len();
    let mut x = Vec::with_capacity(n * FEATURES);
    let mut y = Vec::with_capacity(n);
    for row in rows {
        let point: Vec<f32> = (0..FEATURES).map(|j| feature(step, row, j)).collect();
        y.push((point[0] + point[1]).cos() * point[2] + 0.25 * point.iter().sum::<f32>());
        x.extend(point);
    }
    let x = Tensor::<B, 1>::from_floats(x.as_slice(), device).reshape([n, FEATURES]);
    let y = Tensor::<B, 1>::from_floats(y.as_slice(), device).reshape([n, 1]);
    (x, y)
}

/// The tensor's elements, read back as f32 whatever the backend stores.
fn values<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor.into_data().iter::<f32>().collect()
}

/// What one rank saw: the global loss of every step and its final parameters.
struct RankRun {
    losses: Vec<f32>,
    parameters: Vec<f32>,
}

/// One rank's ZeRO-3 training on `Autodiff<Zero<B>>`, from the same initial model on every
/// rank and every world size (`initial`).
fn train_rank<B: Backend>(
    ctx: RankContext<B>,
    initial: &Mlp<Autodiff<Zero<B>>>,
    steps: usize,
) -> Result<RankRun, ZeroError> {
    let device = ctx.device().clone();
    let config = ZeroConfig::new().with_stage(3).with_persist_below_numel(0);
    let (mut model, zero) = shard(initial.clone(), &ctx, &config)?;
    let mut optimizer = ZeroOptimizer::new(&zero, AdamConfig::new())?;
    let local = BATCH / ctx.world_size();
    let rows = ctx.rank() * local..(ctx.rank() + 1) * local;
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let (x, y) = batch::<Autodiff<Zero<B>>>(step, rows.clone(), &device);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let mine = Tensor::<B, 1>::from_floats([values(loss.clone())[0]], &device);
        losses.push(values(ctx.comm().all_reduce(mine, ReduceOp::Mean)?)[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(LR, model, grads);
    }
    let full = unshard(model);
    let parameters = [full.layers[0].weight.val(), full.head.weight.val()]
        .into_iter()
        .flat_map(values)
        .collect();
    Ok(RankRun { losses, parameters })
}

/// Trains on `world_size` threads of this process (`LocalGroup`).
fn train_local<B: Backend>(
    world_size: usize,
    device: &B::Device,
    initial: &Mlp<Autodiff<Zero<B>>>,
    steps: usize,
) -> Result<Vec<RankRun>, String> {
    launch::<B, _, _, ZeroError>(world_size, std::slice::from_ref(device), |ctx| {
        train_rank(ctx, initial, steps)
    })
    .map_err(|e| e.to_string())
}

/// The checks every backend must pass; returns a line to print.
fn verify(two: &[RankRun], one: &RankRun, tolerance: f32) -> Result<String, String> {
    let losses = &two[0].losses;
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    if last.is_nan() || last >= 0.5 * first {
        return Err(format!("the loss did not fall enough: {first} -> {last}"));
    }
    if two[0].parameters != two[1].parameters {
        return Err("the two ranks hold different parameters".into());
    }
    let worst = losses
        .iter()
        .zip(&one.losses)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
        .fold(0.0f32, f32::max);
    if worst > tolerance {
        return Err(format!(
            "2-rank losses leave the 1-rank ones by {worst:e} (relative), more than {tolerance:e}"
        ));
    }
    Ok(format!(
        "loss {first:.4} -> {last:.4}; ranks agree bitwise; 2 ranks vs 1 rank: {worst:.1e} relative"
    ))
}

fn run_local<B: Backend>(name: &str, device: B::Device, steps: usize, tolerance: f32) -> bool {
    B::seed(&device, 42);
    let initial = Mlp::<Autodiff<Zero<B>>>::materialised(&device);
    let outcome = train_local::<B>(2, &device, &initial, steps).and_then(|two| {
        let one = train_local::<B>(1, &device, &initial, steps)?;
        verify(&two, &one[0], tolerance)
    });
    match outcome {
        Ok(line) => {
            println!("{name}: {line}");
            true
        }
        Err(error) => {
            eprintln!("{name}: {error}");
            false
        }
    }
}

/// One rank per process on Burn's default `Cuda` (fused) with NCCL; the job is started by
/// `zero-run`. Every rank checks that the ranks end with the same parameters.
#[cfg(feature = "cuda")]
fn nccl_rank(steps: usize) -> Result<String, String> {
    use burn::backend::Cuda;
    use burn_zero::comm::{Communicator, NcclGroup, NcclOptions};
    use std::sync::Arc;

    let group = NcclGroup::from_env(&NcclOptions::default()).map_err(|e| e.to_string())?;
    let device = group.device().clone();
    let comm: Arc<dyn Communicator<Cuda>> = Arc::new(group);
    let ctx = RankContext::<Cuda>::new(device.clone(), comm.clone());
    <Cuda as Backend>::seed(&device, 42);
    let initial = Mlp::<Autodiff<Zero<Cuda>>>::materialised(&device);
    let run = train_rank(ctx, &initial, steps).map_err(|e| e.to_string())?;
    let mine = Tensor::<Cuda, 1>::from_floats(run.parameters.as_slice(), &device);
    let high = comm
        .all_reduce(mine.clone(), ReduceOp::Max)
        .map_err(|e| e.to_string())?;
    let low = comm
        .all_reduce(mine, ReduceOp::Min)
        .map_err(|e| e.to_string())?;
    if values(high) != values(low) {
        return Err("the ranks hold different parameters".into());
    }
    Ok(format!(
        "rank {}: loss {:.4} -> {:.4}; ranks agree bitwise",
        comm.rank(),
        run.losses[0],
        run.losses[run.losses.len() - 1]
    ))
}

#[cfg(feature = "cuda")]
fn run_nccl(steps: usize) -> bool {
    match nccl_rank(steps) {
        Ok(line) => {
            println!("cuda (NCCL): {line}");
            true
        }
        Err(error) => {
            eprintln!("cuda (NCCL): {error}");
            false
        }
    }
}

fn main() {
    let args = Args::parse();
    // Flex is bitwise reproducible and splits the batch exactly: the two runs differ only by
    // the order of the gradient sums (~1e-6). NdArray and wgpu are noisier.
    let ok = match args.backend {
        BackendChoice::Flex => run_local::<Flex>("flex", Default::default(), args.steps, 1e-4),
        BackendChoice::Ndarray => {
            run_local::<NdArray>("ndarray", Default::default(), args.steps, 1e-3)
        }
        BackendChoice::Wgpu => run_local::<Wgpu>("wgpu", Default::default(), args.steps, 1e-3),
        #[cfg(feature = "cuda")]
        BackendChoice::CudaNccl => run_nccl(args.steps),
    };
    if !ok {
        std::process::exit(1);
    }
}
