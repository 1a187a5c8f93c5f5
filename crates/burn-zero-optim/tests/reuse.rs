//! `reuse_fp16_shard`: at stage 3 with half-precision parameters, a parameter's shard is freed
//! once its gradient shard arrives (its fp32 master holds the values) and rewritten by the
//! step. Training is bitwise unchanged, the memory between backward and step drops by the
//! parameter shards, and reading a parameter in that window is a clear error. All of it holds
//! with the parameters packed into chunks (a chunk's shard is its members' blocks, each freed
//! and rewritten as without chunks).

use burn::backend::Flex;
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::DType;
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, MemoryReport, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{
    Block, CastParams, Train, base_model, micro_batch, param_values, params_bits_equal,
};

const WORLD: usize = 2;
const STEPS: usize = 4;

fn half_model() -> Block<Train> {
    base_model(&Default::default()).map(&mut CastParams(DType::F16))
}

/// One parameter per chunk, and chunks of 256 elements (several f16 parameters each).
const CHUNK_SIZES: [ChunkSize; 2] = [ChunkSize::PerParameter, ChunkSize::Elements(256)];

fn config(reuse: bool, chunk_size: ChunkSize) -> ZeroConfig {
    ZeroConfig::new()
        .with_persist_below_numel(0)
        .with_reuse_fp16_shard(reuse)
        .with_chunk_size(chunk_size)
}

/// Final parameters, and rank 0's memory after each backward and after each step.
type Run = (Vec<Vec<f32>>, Vec<(MemoryReport, MemoryReport)>);

fn train(base: &Block<Train>, reuse: bool, accumulation: usize, chunk_size: ChunkSize) -> Vec<Run> {
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config(reuse, chunk_size))?;
        let packed = zero
            .store()
            .chunks()
            .chunks()
            .iter()
            .any(|c| c.members.len() > 1);
        assert_eq!(
            packed,
            chunk_size != ChunkSize::PerParameter,
            "{chunk_size:?}"
        );
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))
            .unwrap()
            .with_accumulation(accumulation);
        let mut memory = Vec::new();
        for step in 0..STEPS {
            let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            let after_backward = zero.memory_report();
            model = optimizer.step(1e-2, model, grads);
            memory.push((after_backward, zero.memory_report()));
        }
        Ok((param_values(&model), memory))
    })
    .unwrap()
}

#[test]
fn reusing_the_half_shard_frees_it_between_backward_and_step_and_changes_nothing() {
    let base = half_model();
    let reference = train(&base, false, 1, ChunkSize::PerParameter);
    for chunk_size in CHUNK_SIZES {
        frees_and_changes_nothing(&base, &reference, chunk_size);
    }
}

/// Trains `base` with and without reuse under `chunk_size` and checks both against
/// `reference`, the per-parameter run without reuse: bitwise, and with the same memory (a
/// chunk holds its members' blocks and nothing past them).
fn frees_and_changes_nothing(base: &Block<Train>, reference: &[Run], chunk_size: ChunkSize) {
    let plain = train(base, false, 1, chunk_size);
    let reused = train(base, true, 1, chunk_size);
    for rank in 0..WORLD {
        assert!(
            params_bits_equal(&plain[rank].0, &reused[rank].0),
            "{chunk_size:?}, rank {rank}: training changed"
        );
        assert!(
            params_bits_equal(&reference[rank].0, &reused[rank].0),
            "{chunk_size:?}, rank {rank}: training differs from one parameter per chunk"
        );
    }
    for (step, ((want, _), (got, _))) in reference[0].1.iter().zip(&plain[0].1).enumerate() {
        assert_eq!(
            got.parameter_shards.current, want.parameter_shards.current,
            "{chunk_size:?}, step {step}: parameter shards"
        );
    }
    let (_, plain_memory) = &plain[0];
    let (_, reused_memory) = &reused[0];
    let shards = plain_memory[0].1.parameter_shards.current;
    assert!(shards > 0);
    // Step 0 creates the masters: nothing can be freed before it.
    assert_eq!(reused_memory[0].0.parameter_shards.current, shards);
    for step in 1..STEPS {
        let (after_backward, after_step) = &reused_memory[step];
        assert_eq!(
            after_backward.parameter_shards.current, 0,
            "{chunk_size:?}, step {step}: every sharded parameter freed for its gradient"
        );
        assert_eq!(
            after_backward.gradient_shards.current, shards,
            "{chunk_size:?}: same size"
        );
        assert_eq!(
            after_step.parameter_shards.current, shards,
            "{chunk_size:?}, step {step}: rewritten"
        );
        assert_eq!(
            plain_memory[step].0.parameter_shards.current, shards,
            "without reuse both are held"
        );
    }
}

#[test]
fn micro_steps_refill_freed_shards_from_the_masters() {
    let base = half_model();
    let plain = train(&base, false, 2, ChunkSize::PerParameter);
    for chunk_size in CHUNK_SIZES {
        let reused = train(&base, true, 2, chunk_size);
        for rank in 0..WORLD {
            assert!(
                params_bits_equal(&plain[rank].0, &reused[rank].0),
                "{chunk_size:?}, rank {rank}"
            );
        }
    }
}

#[test]
fn reading_a_freed_parameter_before_the_step_is_a_clear_error() {
    for chunk_size in CHUNK_SIZES {
        freed_parameter_read(chunk_size);
    }
}

fn freed_parameter_read(chunk_size: ChunkSize) {
    let base = half_model();
    let result = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config(true, chunk_size))?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        for step in 0..2 {
            let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            if step == 1 {
                // Forward again before stepping: the parameters are gone.
                let (tokens, targets) = micro_batch::<Train>(ctx.rank(), ctx.device());
                let _ = model.loss(tokens, targets);
            }
            model = optimizer.step(1e-2, model, grads);
        }
        Ok(())
    });
    let message = result.expect_err("must fail").to_string();
    assert!(
        message.contains("reuse_fp16_shard") && message.contains("step before the next forward"),
        "{chunk_size:?}: {message}"
    );
}

#[test]
fn reuse_below_stage_3_is_refused() {
    let error = ZeroConfig::new()
        .with_stage(2)
        .with_reuse_fp16_shard(true)
        .validate()
        .expect_err("stage 2 keeps parameters whole");
    assert!(error.contains("reuse_fp16_shard needs stage 3"), "{error}");
}
