//! Shared by the checkpoint tests: training loops over the testing crate's transformer block,
//! configurations and scratch directories.
#![allow(dead_code)]

use std::path::PathBuf;

use burn::backend::Flex;
use burn::optim::{Adam, AdamConfig, GradientsParams, Optimizer};
use burn_zero_core::{ZeroConfig, ZeroState};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{Block, Train, micro_batch};

pub const LR: f64 = 1e-2;

/// What a rank of a test returns on failure.
pub type Failure = Box<dyn std::error::Error + Send + Sync>;

/// One optimizer call per micro-batch index, in order.
pub fn train_on<O: Optimizer<Block<Train>, Train>>(
    mut model: Block<Train>,
    optim: &mut O,
    indices: impl IntoIterator<Item = usize>,
) -> Block<Train> {
    let device = Default::default();
    for index in indices {
        let (tokens, targets) = micro_batch::<Train>(index, &device);
        let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
        model = optim.step(LR, model, grads);
    }
    model
}

/// Data-parallel steps `steps` of `rank` in a group of `world`: micro-batch
/// `step · world + rank` each.
pub fn train<O: Optimizer<Block<Train>, Train>>(
    model: Block<Train>,
    optim: &mut O,
    rank: usize,
    world: usize,
    steps: std::ops::Range<usize>,
) -> Block<Train> {
    train_on(model, optim, steps.map(|step| step * world + rank))
}

pub fn config(stage: u8) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(stage)
        .with_persist_below_numel(12)
        .with_bucket_size_mb(0.001)
}

/// Burn's own Adam inside `ZeroOptimizer`, placed as `zero`'s module was sharded.
pub fn adam(zero: &ZeroState<Flex>) -> ZeroOptimizer<Flex, Adam> {
    ZeroOptimizer::new(zero, PerTensor(AdamConfig::new().build())).expect("Burn's Adam")
}

/// A fresh, empty directory under the system's temporary directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "burn-zero-checkpoint-{name}-{}",
        std::process::id()
    ));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
