//! The optimizer reaches the sharded module's state through the `ZeroState` it was built from,
//! not through the thread that sharded: it can be moved to another thread (as a training
//! framework's learner does) and stepped there, and it refuses a module another `shard` call
//! sharded.

use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn_zero_comm::{CommError, launch};
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{
    Block, Train, base_model, micro_batch, param_values, params_bits_equal, step_mean_grads,
};

const STEPS: usize = 4;
const LR: f64 = 1e-2;
const WORLD: usize = 2;

/// Single rank, no sharding, Burn's Adam: each step averages `WORLD` micro-batches in rank order.
fn reference(base: &Block<Train>) -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut optim = AdamConfig::new().init();
    let mut model = base.clone();
    for step in 0..STEPS {
        let (mean, _) = step_mean_grads(&model, step, WORLD, &device);
        model = Optimizer::<Block<Train>, Train>::step(&mut optim, LR, model, mean);
    }
    param_values(&model)
}

#[test]
fn an_optimizer_stepped_on_another_thread_trains_bitwise_like_single_rank_burn() {
    let base = base_model(&Default::default());
    let want = reference(&base);
    for stage in [1, 3] {
        let config = ZeroConfig::new()
            .with_stage(stage)
            .with_persist_below_numel(12)
            .with_bucket_size_mb(0.001);
        let per_rank = launch::<_, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
            let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
            let mut optimizer =
                ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
            for step in 0..STEPS {
                // Forward and backward on the rank's thread (autodiff's hooks run here) ...
                let (tokens, targets) =
                    micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
                let grads =
                    GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
                // ... the step on a thread of its own, which never sharded anything.
                (model, optimizer) = std::thread::scope(|scope| {
                    scope
                        .spawn(move || {
                            let model = optimizer.step(LR, model, grads);
                            (model, optimizer)
                        })
                        .join()
                        .expect("the stepping thread")
                });
            }
            Ok(param_values(&model))
        })
        .unwrap_or_else(|e| panic!("stage {stage}: {e}"));
        for (rank, got) in per_rank.iter().enumerate() {
            assert!(
                params_bits_equal(got, &want),
                "stage {stage}, rank {rank}: differs from single-rank Burn"
            );
        }
    }
}

#[test]
fn an_optimizer_refuses_a_module_another_shard_call_sharded() {
    let base = base_model(&Default::default());
    let config = ZeroConfig::new().with_persist_below_numel(0);
    let result = launch::<_, _, _, CommError>(1, &[Default::default()], |ctx| {
        let (_first, zero) = shard(base.clone(), &ctx, &config).expect("sharded");
        let (second, _second_zero) = shard(base.clone(), &ctx, &config).expect("sharded");
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let (tokens, targets) = micro_batch::<Train>(0, ctx.device());
        let grads = GradientsParams::from_grads(second.loss(tokens, targets).backward(), &second);
        optimizer.step(LR, second, grads);
        Ok(())
    });
    let message = result.expect_err("the step must refuse").to_string();
    assert!(
        message.contains("was sharded by another `shard` call"),
        "{message}"
    );
}

#[test]
fn an_unbound_optimizer_bound_through_a_record_trains_bitwise_like_single_rank_burn() {
    use burn_zero_optim::ZeroOptimizerRecord;

    let base = base_model(&Default::default());
    let want = reference(&base);
    let config = ZeroConfig::new().with_stage(3).with_persist_below_numel(12);
    // Made before sharding, as a training framework takes it; bound on each rank afterwards.
    let unbound = ZeroOptimizer::unbound(PerTensor(AdamConfig::new().build())).unwrap();
    let per_rank = launch::<_, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer = unbound.clone().restore(ZeroOptimizerRecord::binding(&zero));
        for step in 0..STEPS {
            let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        Ok(param_values(&model))
    })
    .unwrap();
    for (rank, got) in per_rank.iter().enumerate() {
        assert!(
            params_bits_equal(got, &want),
            "rank {rank}: differs from single-rank Burn"
        );
    }
}

#[test]
fn an_unbound_optimizer_refuses_to_step_and_says_how_to_bind_it() {
    let base = base_model(&Default::default());
    let config = ZeroConfig::new().with_persist_below_numel(0);
    let result = launch::<_, _, _, CommError>(1, &[Default::default()], |ctx| {
        let (model, _zero) = shard(base.clone(), &ctx, &config).expect("sharded");
        let mut optimizer = ZeroOptimizer::unbound(PerTensor(AdamConfig::new().build())).unwrap();
        let (tokens, targets) = micro_batch::<Train>(0, ctx.device());
        let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
        optimizer.step(LR, model, grads);
        Ok(())
    });
    let message = result.expect_err("the step must refuse").to_string();
    assert!(
        message.contains("never bound") && message.contains("ZeroOptimizerRecord::binding"),
        "{message}"
    );
}

/// A backward pass uses up the parameters' gradient marks and the step renews them: the
/// gradients of a second backward pass before a step were never reduced, and at the stages
/// that reduce them to shards the step refuses them by name instead of stepping with one
/// rank's gradient.
#[test]
fn a_second_backward_before_a_step_is_refused_by_name() {
    for stage in [1, 2, 3] {
        let base = base_model(&Default::default());
        let config = ZeroConfig::new()
            .with_stage(stage)
            .with_persist_below_numel(0);
        let messages =
            launch::<burn::backend::Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
                let (model, zero) = shard(base.clone(), &ctx, &config)?;
                let mut optimizer =
                    ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
                let (tokens, targets) = micro_batch::<Train>(ctx.rank(), ctx.device());
                let first = model.loss(tokens.clone(), targets.clone()).backward();
                drop(first);
                let second = model.loss(tokens, targets).backward();
                let grads = GradientsParams::from_grads(second, &model);
                let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    optimizer.step(LR, model, grads);
                }))
                .expect_err("the step is refused");
                Ok(panic.downcast_ref::<String>().cloned().unwrap_or_default())
            })
            .unwrap();
        for message in messages {
            assert!(
                message.contains("it was not reduced")
                    && message.contains("`embed.weight`")
                    && message.contains("call `step` after every backward"),
                "stage {stage}: {message}"
            );
        }
    }
}
