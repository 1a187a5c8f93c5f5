//! Data-parallel training over `LocalGroup`: each rank trains a replica of a small MLP on its
//! slice of every batch, gradients are averaged with `all_reduce`, and the replicas stay
//! identical. This exercises the collective layer end to end until the sharded-transformer
//! example lands.
//!
//! ```text
//! cargo run --release --example data_parallel -- --world-size 2 --steps 300
//! ```

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{Tensor, TensorData, activation::tanh, backend::Backend};
use burn_zero::Zero;
use burn_zero::comm::{CommError, Communicator, ReduceOp, launch};
use clap::Parser;

// `Zero<NdArray>` with nothing sharded is plain NdArray; burn-zero's `distributed` feature
// makes `Autodiff` require a backend with gradient hooks, which `Zero` provides.
type Inner = Zero<NdArray>;
type Train = Autodiff<Inner>;

#[derive(Parser, Debug)]
#[command(about = "Data-parallel MLP regression over burn-zero's LocalGroup (CPU)")]
struct Args {
    /// Number of ranks (threads).
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 500)]
    steps: usize,
    /// Global batch size, split evenly across ranks.
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
}

const FEATURES: usize = 8;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    hidden: Linear<B>,
    out: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            hidden: LinearConfig::new(FEATURES, 32).init(device),
            out: LinearConfig::new(32, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.out.forward(tanh(self.hidden.forward(x)))
    }
}

/// Deterministic pseudo-random numbers in [-1, 1), independent of any backend RNG.
fn noise(seed: u64, i: u64) -> f32 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Batch `step` of a fixed regression task: y = sin(x · w) + 0.5 · x0 · x1.
fn batch(step: usize, size: usize) -> (Vec<f32>, Vec<f32>) {
    let w: Vec<f32> = (0..FEATURES as u64).map(|j| noise(7, j)).collect();
    let x: Vec<f32> = (0..(size * FEATURES) as u64)
        .map(|i| noise(1000 + step as u64, i))
        .collect();
    let y = x
        .chunks(FEATURES)
        .map(|row| {
            let dot: f32 = row.iter().zip(&w).map(|(a, b)| a * b).sum();
            dot.sin() + 0.5 * row[0] * row[1]
        })
        .collect();
    (x, y)
}

/// Copies rank 0's parameters to every rank, as DDP does when it wraps a model.
struct BroadcastFromRankZero<'a> {
    comm: &'a dyn Communicator<Inner>,
    error: Option<CommError>,
}

impl ModuleMapper<Train> for BroadcastFromRankZero<'_> {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Train, D>>,
    ) -> Param<Tensor<Train, D>> {
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let shape = tensor.shape();
        let flat = tensor.clone().inner().reshape([shape.num_elements()]);
        let tensor = match self.comm.broadcast(flat, 0) {
            Ok(flat) => {
                Tensor::from_inner(flat.reshape::<D, _>(shape)).set_require_grad(require_grad)
            }
            Err(e) => {
                self.error.get_or_insert(e);
                tensor
            }
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Replaces every gradient by its mean over ranks.
struct AverageGradients<'a> {
    comm: &'a dyn Communicator<Inner>,
    grads: &'a mut GradientsParams,
    error: Option<CommError>,
}

impl ModuleVisitor<Train> for AverageGradients<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
        let Some(grad) = self.grads.remove::<Inner, D>(param.id) else {
            return;
        };
        let shape = grad.shape();
        match self
            .comm
            .all_reduce(grad.reshape([shape.num_elements()]), ReduceOp::Mean)
        {
            Ok(mean) => self.grads.register(param.id, mean.reshape::<D, _>(shape)),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }
}

/// Every parameter, flattened, in visit order.
struct FlatParams(Vec<Tensor<Inner, 1>>);

impl ModuleVisitor<Inner> for FlatParams {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Inner, D>>) {
        let value = param.val();
        let numel = value.shape().num_elements();
        self.0.push(value.reshape([numel]));
    }
}

fn main() {
    let args = Args::parse();
    assert!(
        args.batch_size % args.world_size == 0,
        "--batch-size must be divisible by --world-size"
    );
    let local = args.batch_size / args.world_size;
    println!(
        "data-parallel MLP: {} ranks, global batch {}, {} steps",
        args.world_size, args.batch_size, args.steps
    );
    let started = std::time::Instant::now();

    let result = launch::<Inner, _, _, CommError>(args.world_size, &[Default::default()], |ctx| {
        let comm = ctx.comm().as_ref();
        let device = ctx.device();
        let mut sync = BroadcastFromRankZero { comm, error: None };
        let mut model = Mlp::<Train>::new(device).map(&mut sync);
        if let Some(e) = sync.error {
            return Err(e);
        }
        let mut optim = AdamConfig::new().init::<Train, Mlp<Train>>();
        let mut losses = Vec::new();
        for step in 0..args.steps {
            let (x, y) = batch(step, args.batch_size);
            let rows = ctx.rank() * local..(ctx.rank() + 1) * local;
            let x = Tensor::<Train, 2>::from_data(
                TensorData::new(
                    x[rows.start * FEATURES..rows.end * FEATURES].to_vec(),
                    [local, FEATURES],
                ),
                device,
            );
            let y = Tensor::<Train, 2>::from_data(
                TensorData::new(y[rows].to_vec(), [local, 1]),
                device,
            );
            let loss = (model.forward(x) - y).powi_scalar(2).mean();
            // The global loss is the mean of the ranks' losses (equal slices).
            let global = comm.all_reduce(loss.clone().inner().reshape([1]), ReduceOp::Mean)?;
            losses.push(global.into_scalar());
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            let mut average = AverageGradients {
                comm,
                grads: &mut grads,
                error: None,
            };
            model.visit(&mut average);
            if let Some(e) = average.error {
                return Err(e);
            }
            model = optim.step(args.lr, model, grads);
            if ctx.rank() == 0 && (step % 100 == 0 || step + 1 == args.steps) {
                println!("step {step:>5}  loss {:.5}", losses[step]);
            }
        }
        // Replicas must be identical: the spread (max − min over ranks) of every parameter is 0.
        let mut flat = FlatParams(Vec::new());
        model.valid().visit(&mut flat);
        let params = Tensor::cat(flat.0, 0);
        let spread = comm.all_reduce(params.clone(), ReduceOp::Max)?
            - comm.all_reduce(params, ReduceOp::Min)?;
        Ok((losses, spread.abs().max().into_scalar()))
    });

    match result {
        Ok(per_rank) => {
            let (losses, spread) = &per_rank[0];
            let first =
                losses[..10.min(losses.len())].iter().sum::<f32>() / 10f32.min(losses.len() as f32);
            let last = losses[losses.len().saturating_sub(10)..]
                .iter()
                .sum::<f32>()
                / 10f32.min(losses.len() as f32);
            println!(
                "loss {first:.5} -> {last:.5} (mean of first/last 10 steps); replica spread {spread:e}; {:.1}s",
                started.elapsed().as_secs_f64()
            );
            assert_eq!(*spread, 0.0, "replicas diverged");
        }
        Err(e) => {
            eprintln!("training failed: {e}");
            std::process::exit(1);
        }
    }
}
