//! Model-state memory measured outside the library: a counting global allocator sees every
//! heap byte of this test process, and the bytes freed when the ranks drop their sharded model
//! and optimizer are what those held — parameter shards, fp32 master copies and Adam's two
//! moments. That figure is compared with the library's own accounting (`memory_report`,
//! `master_bytes`, `state_bytes`) and with the ZeRO formula, at N = 1, 2, 4 ranks (threads of
//! this process, so the process total is the sum over the ranks).

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{DType, Tensor, activation::relu};
use burn_zero_comm::launch;
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::alloc::CountingAllocator;
use burn_zero_testing::{CastParams, Train};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

const WIDTH: usize = 256;
const LAYERS: usize = 4;

/// A stack of `LAYERS` linear layers of `WIDTH`²: Ψ = 4 · (256² + 256) = 263,168, large
/// enough that the handful of small allocations around the tensors is far below 5%.
#[derive(Module, Debug)]
struct Stack<B: burn::tensor::backend::Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: burn::tensor::backend::Backend> Stack<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            layers: (0..LAYERS)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
                .collect(),
        }
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            x = relu(layer.forward(x));
        }
        x
    }
}

/// What one rank saw: bytes the library accounts for, and the formula's share.
struct RankFigures {
    tracer: usize,
    formula: usize,
}

#[test]
fn model_state_measured_by_the_allocator_matches_the_tracer_and_the_formula() {
    // f16 parameters and Adam: after a step each rank holds 2 + 4 + 8 = 14 bytes per element
    // of its share (f16 shard, fp32 master, two fp32 moments); gradients are gone.
    let base = Stack::<Train>::new(&Default::default()).map(&mut CastParams(DType::F16));
    // Each layer's weight and bias.
    let numels: Vec<usize> = (0..LAYERS).flat_map(|_| [WIDTH * WIDTH, WIDTH]).collect();
    let psi: usize = numels.iter().sum();
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(0)
        .with_overlap_comm(false);
    for world_size in [1, 2, 4] {
        let freed = AtomicUsize::new(0);
        let per_rank = launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
            let (model, zero) = shard(base.clone(), &ctx, &config)?;
            let mut optimizer =
                ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
            let x = Tensor::<Train, 2>::ones([2, WIDTH], ctx.device()).cast(DType::F16);
            let grads = GradientsParams::from_grads(model.forward(x).mean().backward(), &model);
            let model = optimizer.step(1e-3, model, grads);
            let report = zero.memory_report();
            let tracer = report.parameter_shards.current as usize
                + optimizer.master_bytes()
                + optimizer.state_bytes();
            let share: usize = numels.iter().map(|n| n.div_ceil(world_size)).sum();

            // Every rank is idle between the barriers but for dropping its model and optimizer:
            // the process's live bytes fall by exactly what they held.
            let comm = zero.comm().clone();
            comm.barrier()?;
            let before = ALLOCATOR.live();
            comm.barrier()?;
            drop(model);
            drop(optimizer);
            comm.barrier()?;
            if ctx.rank() == 0 {
                freed.store(before - ALLOCATOR.live(), Ordering::SeqCst);
            }
            comm.barrier()?;
            Ok(RankFigures {
                tracer,
                formula: 14 * share,
            })
        })
        .unwrap();
        let measured = freed.load(Ordering::SeqCst) as f64;
        let tracer: usize = per_rank.iter().map(|r| r.tracer).sum();
        let formula: usize = per_rank.iter().map(|r| r.formula).sum();
        let unpadded = 14.0 * psi as f64;
        println!(
            "N = {world_size}: freed {measured} B; tracer {tracer} B; formula 14·Ψ = {unpadded} B \
             ({formula} B with each rank's share padded)"
        );
        for (what, expected) in [
            ("the library's accounting", tracer as f64),
            ("the formula", formula as f64),
        ] {
            let off = (measured - expected).abs() / expected;
            assert!(
                off <= 0.05,
                "N = {world_size}: the allocator saw {measured} B freed, {what} says {expected} \
                 B ({:.1}% apart)",
                100.0 * off
            );
        }
    }
}
