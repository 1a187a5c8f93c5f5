//! ZeRO-sharded training of an MLP regressor on CPU ranks: an ordinary Burn training loop
//! where the burn-zero lines are the backend type, `launch`, `shard` and `ZeroOptimizer`.
//! At the end, every rank's memory accounting and the parameters' agreement across ranks.
//!
//! ```text
//! cargo run --example train_zero -- --world-size 2 --stage 3
//! ```

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Tensor, TensorData, activation::tanh, backend::Backend};
use burn_zero::comm::{ReduceOp, launch};
use burn_zero::{PerTensor, Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard, unshard};
use clap::Parser;

/// The backend every rank computes on, and the training backend.
type Inner = NdArray;
type Train = Autodiff<Zero<Inner>>;

#[derive(Parser, Debug)]
#[command(about = "ZeRO-sharded MLP regression on CPU ranks (burn-zero)")]
struct Args {
    /// Number of ranks (threads).
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// ZeRO stage (0 = plain data parallel, 3 = everything sharded).
    #[arg(long, default_value_t = 3)]
    stage: u8,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Global batch size, split evenly across ranks.
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Hidden width of the MLP.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Learning rate (Adam).
    #[arg(long, default_value_t = 0.005)]
    lr: f64,
    /// Gradient bucket size in MiB (0: one collective per parameter).
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// Parameters with fewer elements stay replicated (stage 3).
    #[arg(long, default_value_t = 1024)]
    persist_below: usize,
}

const FEATURES: usize = 8;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    input: Linear<B>,
    hidden: Linear<B>,
    output: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(width: usize, device: &B::Device) -> Self {
        Self {
            input: LinearConfig::new(FEATURES, width).init(device),
            hidden: LinearConfig::new(width, width).init(device),
            output: LinearConfig::new(width, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = tanh(self.input.forward(x));
        let h = tanh(self.hidden.forward(h));
        self.output.forward(h)
    }
}

/// Deterministic pseudo-random numbers in [-1, 1), independent of any backend RNG.
fn noise(seed: u64, i: u64) -> f32 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// This rank's rows of batch `step` of a fixed task: y = sin(x · w) + 0.5 · x0 · x1.
fn batch<B: Backend>(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let w: Vec<f32> = (0..FEATURES as u64).map(|j| noise(7, j)).collect();
    let x: Vec<f32> = (rows.start * FEATURES..rows.end * FEATURES)
        .map(|i| noise(1000 + step as u64, i as u64))
        .collect();
    let y: Vec<f32> = x
        .chunks(FEATURES)
        .map(|row| {
            let dot: f32 = row.iter().zip(&w).map(|(a, b)| a * b).sum();
            dot.sin() + 0.5 * row[0] * row[1]
        })
        .collect();
    let n = rows.len();
    (
        Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
        Tensor::from_data(TensorData::new(y, [n, 1]), device),
    )
}

/// A tensor's values as f32.
fn values<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data")
}

fn main() {
    let args = Args::parse();
    if args.world_size == 0 || !args.batch_size.is_multiple_of(args.world_size) {
        eprintln!(
            "--batch-size ({}) must be a multiple of --world-size ({})",
            args.batch_size, args.world_size
        );
        std::process::exit(2);
    }
    let local = args.batch_size / args.world_size;
    let config = ZeroConfig::new()
        .with_stage(args.stage)
        .with_bucket_size_mb(args.bucket_mb)
        .with_persist_below_numel(args.persist_below);
    println!(
        "ZeRO stage {} MLP (width {}): {} ranks, global batch {}, {} steps",
        args.stage, args.hidden, args.world_size, args.batch_size, args.steps
    );
    let started = std::time::Instant::now();

    let result = launch::<Inner, _, _, ZeroError>(args.world_size, &[Default::default()], |ctx| {
        let device = ctx.device();
        let (mut model, zero) = shard(Mlp::<Train>::new(args.hidden, device), &ctx, &config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut losses = Vec::with_capacity(args.steps);
        for step in 0..args.steps {
            let rows = ctx.rank() * local..(ctx.rank() + 1) * local;
            let (x, y) = batch::<Train>(step, rows, device);
            let loss = (model.forward(x) - y).powi_scalar(2).mean();
            // The global loss: the mean of the ranks' losses (equal slices).
            let mine = Tensor::<Inner, 1>::from_floats([values(loss.clone())[0]], device);
            losses.push(ctx.comm().all_reduce(mine, ReduceOp::Mean)?.into_scalar());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(args.lr, model, grads);
            if ctx.rank() == 0 && (step % 50 == 0 || step + 1 == args.steps) {
                println!("step {step:>5}  loss {:.5}", losses[step]);
            }
        }
        let memory = Some(zero.memory_report());
        let master_bytes = optimizer.master_bytes();
        // Gather the whole model once: every rank must hold the same parameters.
        let full = unshard(model);
        let weight = values(full.hidden.weight.val());
        let weight = Tensor::<Inner, 1>::from_floats(weight.as_slice(), device);
        let spread = ctx.comm().all_reduce(weight.clone(), ReduceOp::Max)?
            - ctx.comm().all_reduce(weight, ReduceOp::Min)?;
        Ok((
            losses,
            memory,
            master_bytes,
            spread.abs().max().into_scalar(),
        ))
    });

    match result {
        Ok(per_rank) => {
            let (losses, _, _, spread) = &per_rank[0];
            let window = 10.min(losses.len());
            let first = losses[..window].iter().sum::<f32>() / window as f32;
            let last = losses[losses.len() - window..].iter().sum::<f32>() / window as f32;
            println!(
                "loss {first:.5} -> {last:.5} (mean of first/last {window} steps); spread of a parameter across ranks {spread:e}; {:.1}s",
                started.elapsed().as_secs_f64()
            );
            println!(
                "per-rank model data, bytes: parameter shards | replicated parameters | gradient shards (peak) | fp32 master"
            );
            for (rank, (_, memory, master, _)) in per_rank.iter().enumerate() {
                if let Some(m) = memory {
                    println!(
                        "  rank {rank}: {} | {} | {} | {master}",
                        m.parameter_shards.current,
                        m.persistent_parameters.current,
                        m.gradient_shards.peak
                    );
                }
            }
            if *spread != 0.0 {
                eprintln!("ranks disagree on the parameters");
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("training failed: {e}");
            std::process::exit(1);
        }
    }
}
