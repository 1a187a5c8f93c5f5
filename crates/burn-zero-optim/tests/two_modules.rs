//! Two modules sharded separately (an encoder and a head, each with its own `shard` call,
//! `ZeroState` and `ZeroOptimizer`) and used in one backward pass share the rank's one issuing
//! thread: their gathers, prefetches and gradient buckets keep one order of collectives on
//! every rank. On rank 0 every reduction is delayed before it reaches the engine, so without
//! that one order the two modules' collectives would interleave differently on the ranks (a
//! schedule mismatch here, a hang under NCCL). Training ends bitwise equal to single-rank
//! training with Burn's Adam on the same micro-batches, their gradients averaged in rank order.

use std::sync::Arc;
use std::time::Duration;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_zero_comm::{LaunchOptions, RankContext, launch_with};
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::recording::{CallLog, RecordingComm};
use burn_zero_testing::{Materialise, Train, average_grads, param_values, params_bits_equal};

const STEPS: usize = 3;
const LR: f64 = 1e-2;
const WIDTH: usize = 12;
const ROWS: usize = 3;

#[derive(Module, Debug)]
struct Encoder<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
}

#[derive(Module, Debug)]
struct Head<B: Backend> {
    out: Linear<B>,
}

fn encoder(device: &FlexDevice) -> Encoder<Train> {
    let encoder = Encoder {
        first: LinearConfig::new(WIDTH, 2 * WIDTH + 1).init(device),
        second: LinearConfig::new(2 * WIDTH + 1, WIDTH).init(device),
    };
    encoder.visit(&mut Materialise);
    encoder
}

fn head(device: &FlexDevice) -> Head<Train> {
    let head = Head {
        out: LinearConfig::new(WIDTH, 5).init(device),
    };
    head.visit(&mut Materialise);
    head
}

/// Micro-batch `index`: inputs and regression targets of a fixed pseudo-random pattern.
fn micro_batch(index: usize, device: &FlexDevice) -> (Tensor<Train, 2>, Tensor<Train, 2>) {
    let value = |i: usize, salt: usize| ((i * 37 + index * 101 + salt) % 17) as f32 / 8.0 - 1.0;
    let x: Vec<f32> = (0..ROWS * WIDTH).map(|i| value(i, 3)).collect();
    let y: Vec<f32> = (0..ROWS * 5).map(|i| value(i, 11)).collect();
    (
        Tensor::from_data(TensorData::new(x, [ROWS, WIDTH]), device),
        Tensor::from_data(TensorData::new(y, [ROWS, 5]), device),
    )
}

/// Both modules in one graph: the head reads the encoder's output.
fn loss(encoder: &Encoder<Train>, head: &Head<Train>, index: usize) -> Tensor<Train, 1> {
    let (x, y) = micro_batch(index, &Default::default());
    let hidden = encoder.second.forward(gelu(encoder.first.forward(x)));
    (head.out.forward(gelu(hidden)) - y).powi_scalar(2).mean()
}

/// Single rank, unsharded, Burn's Adam on each module: each step averages the gradients of
/// `world_size` micro-batches in rank order.
fn reference(world_size: usize, base: &(Encoder<Train>, Head<Train>)) -> Vec<Vec<f32>> {
    let (mut enc, mut hd) = base.clone();
    let mut enc_optim = AdamConfig::new().init();
    let mut head_optim = AdamConfig::new().init();
    for step in 0..STEPS {
        let (mut enc_grads, mut head_grads) = (Vec::new(), Vec::new());
        for rank in 0..world_size {
            let mut grads = loss(&enc, &hd, step * world_size + rank).backward();
            enc_grads.push(GradientsParams::from_module(&mut grads, &enc));
            head_grads.push(GradientsParams::from_module(&mut grads, &hd));
        }
        let enc_mean = average_grads(&enc, &enc_grads);
        let head_mean = average_grads(&hd, &head_grads);
        enc = enc_optim.step(LR, enc, enc_mean);
        hd = head_optim.step(LR, hd, head_mean);
    }
    let mut values = param_values(&enc);
    values.extend(param_values(&hd));
    values
}

/// Each rank shards the two modules separately and trains them in one backward per step.
/// Returns each rank's final parameters and the calls its engine saw.
fn sharded(
    world_size: usize,
    config: &ZeroConfig,
    base: &(Encoder<Train>, Head<Train>),
) -> Vec<(Vec<Vec<f32>>, Vec<String>)> {
    let options = LaunchOptions::with_timeout(Duration::from_secs(60));
    launch_with::<Flex, _, _, ZeroError>(world_size, &[Default::default()], &options, |ctx| {
        let log = CallLog::default();
        let mut recorder = RecordingComm::new(ctx.engine().clone(), log.clone());
        // Rank 0's reductions are slow (a slow packer or link): without one issuing thread
        // for both modules, the other module's collectives overtake them on rank 0 only.
        if ctx.rank() == 0 {
            recorder = recorder.with_reduction_delay(Duration::from_millis(2));
        }
        let ctx = RankContext::new(*ctx.device(), Arc::new(recorder));
        let (mut enc, enc_zero) = shard(base.0.clone(), &ctx, config)?;
        let (mut hd, head_zero) = shard(base.1.clone(), &ctx, config)?;
        let mut enc_optim =
            ZeroOptimizer::new(&enc_zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut head_optim =
            ZeroOptimizer::new(&head_zero, PerTensor(AdamConfig::new().build())).unwrap();
        for step in 0..STEPS {
            let mut grads = loss(&enc, &hd, step * world_size + ctx.rank()).backward();
            let enc_grads = GradientsParams::from_module(&mut grads, &enc);
            let head_grads = GradientsParams::from_module(&mut grads, &hd);
            enc = enc_optim.step(LR, enc, enc_grads);
            hd = head_optim.step(LR, hd, head_grads);
        }
        let mut values = param_values(&enc);
        values.extend(param_values(&hd));
        let calls = log.lock().unwrap().iter().map(|(c, _)| c.clone()).collect();
        Ok((values, calls))
    })
    .unwrap_or_else(|e| panic!("world {world_size}, stage {}: {e}", config.stage))
}

#[test]
fn two_modules_sharded_separately_train_in_one_backward_bitwise() {
    let device = Default::default();
    let base = (encoder(&device), head(&device));
    for world_size in [2, 4] {
        let want = reference(world_size, &base);
        for stage in [2, 3] {
            let config = ZeroConfig::new()
                .with_stage(stage)
                .with_persist_below_numel(0)
                .with_bucket_size_mb(0.0005)
                .with_overlap_comm(true)
                .with_prefetch(2);
            let ranks = sharded(world_size, &config, &base);
            let first = &ranks[0].1;
            let reductions = first
                .iter()
                .filter(|c| c.starts_with("reduce_scatter") || c.starts_with("all_reduce"))
                .count();
            assert!(
                reductions >= 2 * STEPS,
                "world {world_size}, stage {stage}: both modules reduce every step: {first:?}"
            );
            for (rank, (values, calls)) in ranks.iter().enumerate() {
                assert_eq!(
                    calls, first,
                    "world {world_size}, stage {stage}: rank {rank}'s engine saw another order"
                );
                assert!(
                    params_bits_equal(values, &want),
                    "world {world_size}, stage {stage}, rank {rank}: parameters differ from \
                     single-rank training"
                );
            }
        }
    }
}
