//! Sharding's memory accounting, its failure when ranks' modules differ, and gradients of
//! parameters that only some ranks use.

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_zero_comm::launch;
use burn_zero_core::{Zero, ZeroConfig, ZeroError, shard};

type Inner = Zero<Flex>;
type Train = Autodiff<Inner>;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    a: Linear<B>,
    b: Linear<B>,
    extra: Option<Linear<B>>,
}

impl<B: Backend> Mlp<B> {
    fn new(hidden: usize, extra: bool, device: &B::Device) -> Self {
        Self {
            a: LinearConfig::new(9, hidden).init(device),
            b: LinearConfig::new(hidden, 3).init(device),
            extra: extra.then(|| LinearConfig::new(3, 3).init(device)),
        }
    }

    fn forward(&self, x: Tensor<B, 2>, use_b: bool) -> Tensor<B, 2> {
        let h = self.a.forward(x).tanh();
        if use_b {
            self.b.forward(h)
        } else {
            h.slice([0..4, 0..3])
        }
    }
}

fn input<B: Backend>(rank: usize, device: &B::Device) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..36)
        .map(|i| ((i * 7 + rank * 5) % 11) as f32 / 11.0 - 0.5)
        .collect();
    Tensor::from_data(TensorData::new(values, [4, 9]), device)
}

#[test]
fn parameter_bytes_are_the_padded_share_and_gathers_stay_bounded() {
    // a.weight 9×17 = 153, a.bias 17, b.weight 17×3 = 51, b.bias 3 (f32).
    let bound = 300; // bytes: b.weight (204 B) fits in the cache, a.weight (612 B) does not.
    let config = ZeroConfig::new()
        .with_persist_below_numel(20)
        .with_max_live_gathered_bytes(bound);
    for world_size in [1, 2, 4] {
        let reports = launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
            let (model, zero) = shard(Mlp::<Train>::new(17, false, ctx.device()), &ctx, &config)?;
            let after_shard = zero.memory_report();
            let loss = model
                .forward(input(ctx.rank(), ctx.device()), true)
                .powi_scalar(2)
                .mean();
            let after_forward = zero.memory_report();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let after_backward = zero.memory_report();
            drop(grads);
            let grads_dropped = zero.memory_report();
            Ok((after_shard, after_forward, after_backward, grads_dropped))
        })
        .unwrap();
        let block = |numel: usize| numel.div_ceil(world_size) * 4;
        let sharded = (block(153) + block(51)) as u64;
        let persistent = ((17 + 3) * 4) as u64;
        for (after_shard, after_forward, after_backward, grads_dropped) in reports {
            assert_eq!(
                after_shard.parameter_shards.current, sharded,
                "world {world_size}"
            );
            assert_eq!(after_shard.persistent_parameters.current, persistent);
            assert_eq!(after_shard.gathered.current, 0);
            // After forward the cache holds at most the bound (here: b.weight).
            assert!(after_forward.gathered.current <= bound as u64);
            assert_eq!(after_forward.gathered.current, 204);
            // The peak never exceeds the bound plus the one gather in flight.
            assert!(after_backward.gathered.peak <= (bound + 612) as u64);
            // After backward nothing gathered is left; gradient shards are the padded share.
            assert_eq!(after_backward.gathered.current, 0);
            assert_eq!(after_backward.gradient_shards.current, sharded);
            assert_eq!(grads_dropped.gradient_shards.current, 0);
            assert_eq!(grads_dropped.parameter_shards.current, sharded);
        }
    }
}

#[test]
fn differing_shapes_fail_on_every_rank_before_training() {
    let result = launch::<Flex, _, _, ZeroError>(3, &[Default::default()], |ctx| {
        let hidden = if ctx.rank() == 2 { 18 } else { 17 };
        let outcome = shard(
            Mlp::<Train>::new(hidden, false, ctx.device()),
            &ctx,
            &ZeroConfig::new(),
        );
        Ok(outcome.map(drop).expect_err("shapes differ"))
    })
    .unwrap();
    for (rank, error) in result.iter().enumerate() {
        assert!(
            matches!(error, ZeroError::ModuleMismatch(_)),
            "rank {rank}: {error}"
        );
    }
    assert_eq!(
        result[0].to_string(),
        "ranks disagree on the model's parameters: rank 0 has parameter #0 `a.weight` of \
         shape [9, 17] f32 (trainable), rank 2 has parameter #0 of shape [9, 18] f32 (trainable)"
    );
    assert!(result[2].to_string().starts_with("ranks disagree on the model's parameters: rank 2 has parameter #0 `a.weight` of shape [9, 18] f32 (trainable), rank 0 has"));
}

#[test]
fn differing_parameter_counts_fail_on_every_rank() {
    let result = launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let model = Mlp::<Train>::new(5, ctx.rank() == 1, ctx.device());
        Ok(shard(model, &ctx, &ZeroConfig::new())
            .map(drop)
            .expect_err("counts differ"))
    })
    .unwrap();
    assert!(
        result[0]
            .to_string()
            .contains("rank 0 has no more parameters, rank 1 has parameter #4"),
        "{}",
        result[0]
    );
    assert!(
        result[1]
            .to_string()
            .contains("rank 1 has parameter #4 `extra.weight`"),
        "{}",
        result[1]
    );
}

/// This rank's shard of a sharded tensor, read without a collective.
fn local_shard(tensor: burn_zero_core::ZeroTensor<Flex>) -> Vec<f32> {
    let view = tensor.as_sharded().expect("a sharded tensor").clone();
    Tensor::<Flex, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
        view.param().shard().clone(),
    ))
    .into_data()
    .to_vec::<f32>()
    .unwrap()
}

#[test]
fn parameters_unused_in_a_step_keep_the_ranks_in_lockstep() {
    // No rank touches `b` in the first step: its gradients are reduced (as zeros) on every rank
    // in the same order, autodiff has no entry for them, and each rank finds its shard among the
    // orphan gradients. The next step, which uses `b`, runs normally.
    let config = ZeroConfig::new().with_persist_below_numel(0);
    let per_rank = launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let (model, zero) = shard(Mlp::<Train>::new(6, false, ctx.device()), &ctx, &config)?;
        let loss = model
            .forward(input(ctx.rank(), ctx.device()), false)
            .powi_scalar(2)
            .mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let b_grad = grads.get::<Inner, 2>(model.b.weight.id).is_some();
        let orphans = zero.take_orphan_gradients();
        let b_orphan = orphans.get(&2).cloned().map(local_shard);
        let loss = model
            .forward(input(ctx.rank(), ctx.device()), true)
            .powi_scalar(2)
            .mean();
        let second = GradientsParams::from_grads(loss.backward(), &model);
        let b_second = second
            .get::<Inner, 2>(model.b.weight.id)
            .map(|g| local_shard(g.into_primitive().tensor()));
        Ok((
            b_grad,
            orphans.keys().copied().collect::<Vec<_>>(),
            b_orphan,
            b_second,
        ))
    })
    .unwrap();
    for (rank, (b_grad, orphan_keys, b_orphan, b_second)) in per_rank.into_iter().enumerate() {
        assert!(
            !b_grad,
            "rank {rank}: autodiff has no gradient for an unused parameter"
        );
        assert_eq!(orphan_keys, vec![2, 3], "rank {rank}");
        assert_eq!(
            b_orphan,
            Some(vec![0.0; 9]),
            "rank {rank}: 18 elements over 2 ranks, all zero"
        );
        let b_second = b_second.expect("b is used in the second step");
        assert_eq!(b_second.len(), 9);
        assert!(b_second.iter().any(|v| *v != 0.0), "rank {rank}");
    }
}

#[test]
fn rank_dependent_parameter_use_is_a_clear_error_not_a_hang() {
    // Under stage 3 every rank gathers the parameters it computes with; a parameter only rank 0
    // uses makes the ranks' collective schedules diverge, which both ranks report.
    let config = ZeroConfig::new().with_persist_below_numel(0);
    let result = launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let (model, _zero) = shard(Mlp::<Train>::new(6, false, ctx.device()), &ctx, &config)?;
        let loss = model
            .forward(input(0, ctx.device()), ctx.rank() == 0)
            .powi_scalar(2)
            .mean();
        let _ = loss.backward();
        Ok(())
    });
    let error = result.expect_err("schedules diverge").to_string();
    assert!(error.contains("collective schedules diverged"), "{error}");
}

/// Counts the all-gathers a rank issues, delegating to the real communicator.
struct CountingComm<B: Backend> {
    inner: std::sync::Arc<dyn burn_zero_comm::Communicator<B>>,
    gathers: std::sync::atomic::AtomicUsize,
}

impl<B: Backend> burn_zero_comm::Communicator<B> for CountingComm<B> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, burn_zero_comm::CommError> {
        self.gathers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.all_gather(block)
    }
    fn reduce_scatter(
        &self,
        input: Tensor<B, 1>,
        op: burn_zero_comm::ReduceOp,
    ) -> Result<Tensor<B, 1>, burn_zero_comm::CommError> {
        self.inner.reduce_scatter(input, op)
    }
    fn all_reduce(
        &self,
        input: Tensor<B, 1>,
        op: burn_zero_comm::ReduceOp,
    ) -> Result<Tensor<B, 1>, burn_zero_comm::CommError> {
        self.inner.all_reduce(input, op)
    }
    fn broadcast(
        &self,
        buffer: Tensor<B, 1>,
        root: usize,
    ) -> Result<Tensor<B, 1>, burn_zero_comm::CommError> {
        self.inner.broadcast(buffer, root)
    }
    fn barrier(&self) -> Result<(), burn_zero_comm::CommError> {
        self.inner.barrier()
    }
    fn duplicate(
        &self,
    ) -> Result<std::sync::Arc<dyn burn_zero_comm::Communicator<B>>, burn_zero_comm::CommError>
    {
        self.inner.duplicate()
    }
    fn split(
        &self,
        color: usize,
    ) -> Result<std::sync::Arc<dyn burn_zero_comm::Communicator<B>>, burn_zero_comm::CommError>
    {
        self.inner.split(color)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

#[derive(Module, Debug)]
struct Tied<B: Backend> {
    embed: burn::nn::Embedding<B>,
}

impl<B: Backend> Tied<B> {
    fn logits(&self, tokens: Tensor<B, 2, burn::tensor::Int>) -> Tensor<B, 3> {
        let x = self.embed.forward(tokens);
        x.matmul(self.embed.weight.val().transpose().unsqueeze::<3>())
    }
}

#[test]
fn a_tied_embedding_is_gathered_once_per_forward_when_it_fits_the_cache() {
    let count = |max_live_gathered_bytes: usize| {
        let config = ZeroConfig::new()
            .with_persist_below_numel(0)
            .with_max_live_gathered_bytes(max_live_gathered_bytes);
        launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
            let counting = std::sync::Arc::new(CountingComm {
                inner: ctx.comm().clone(),
                gathers: Default::default(),
            });
            let ctx = burn_zero_comm::RankContext::new(*ctx.device(), counting.clone());
            let model = Tied::<Train> {
                embed: burn::nn::EmbeddingConfig::new(11, 6).init(ctx.device()),
            };
            let (model, _zero) = shard(model, &ctx, &config)?;
            let before = counting.gathers.load(std::sync::atomic::Ordering::Relaxed);
            let tokens =
                Tensor::from_data(TensorData::new(vec![1i64, 4, 7, 10], [2, 2]), ctx.device());
            let logits = model.logits(tokens);
            let after_forward = counting.gathers.load(std::sync::atomic::Ordering::Relaxed);
            drop(logits);
            Ok(after_forward - before)
        })
        .unwrap()
    };
    assert_eq!(
        count(1 << 20),
        vec![1, 1],
        "cached: one gather for both uses"
    );
    assert_eq!(count(0), vec![2, 2], "no cache: one gather per use");
}

#[test]
fn unshard_restores_the_full_parameters() {
    let config = ZeroConfig::new().with_persist_below_numel(4);
    let per_rank = launch::<Flex, _, _, ZeroError>(3, &[Default::default()], |ctx| {
        let model = Mlp::<Train>::new(7, false, ctx.device());
        let (model, _zero) = shard(model, &ctx, &config)?;
        let full = burn_zero_core::unshard(model.clone());
        let weight = full.a.weight.val().inner().into_primitive().tensor();
        assert!(
            weight.as_sharded().is_none(),
            "unsharded parameters are local"
        );
        Ok((
            full.a.weight.val().into_data().to_vec::<f32>().unwrap(),
            model.a.weight.val().into_data().to_vec::<f32>().unwrap(),
        ))
    })
    .unwrap();
    for (unsharded, gathered) in &per_rank {
        assert_eq!(unsharded.len(), 63);
        assert_eq!(unsharded, gathered);
        assert_eq!(
            unsharded, &per_rank[0].0,
            "every rank holds rank 0's values"
        );
    }
}

#[test]
fn zero_config_round_trips_through_json() {
    let config = ZeroConfig::new()
        .with_persist_below_numel(12)
        .with_max_live_gathered_bytes(34)
        .with_sync_module_states(false);
    let path = std::env::temp_dir().join(format!("zero-config-{}.json", std::process::id()));
    burn::config::Config::save(&config, &path).unwrap();
    let loaded: ZeroConfig = burn::config::Config::load(&path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(loaded, config);
    assert_eq!(ZeroConfig::new().stage, 3);
    for (bad, message) in [
        (ZeroConfig::new().with_stage(4), "stage 4 does not exist"),
        (
            ZeroConfig::new().with_gradient_predivide_factor(0.0),
            "gradient_predivide_factor must be a positive number",
        ),
        (
            ZeroConfig::new().with_reduce_dtype(Some(burn::tensor::DType::I32)),
            "reduce_dtype must be a float type",
        ),
    ] {
        let error = launch::<Flex, _, _, ZeroError>(1, &[Default::default()], |ctx| {
            let model = Mlp::<Train>::new(3, false, ctx.device());
            Ok(shard(model, &ctx, &bad).map(drop).expect_err("invalid"))
        })
        .unwrap();
        assert!(error[0].to_string().contains(message), "{}", error[0]);
    }
}

#[test]
fn rank_dependent_parameter_use_works_below_stage_3() {
    // Stages 1 and 2 keep parameters whole, so nothing is gathered: a parameter only rank 0
    // uses is reduced with rank 1's zeros, and rank 1 gets its shard as an orphan.
    for stage in [1, 2] {
        let config = ZeroConfig::new().with_stage(stage);
        let per_rank = launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
            let (model, zero) = shard(Mlp::<Train>::new(6, false, ctx.device()), &ctx, &config)?;
            let use_b = ctx.rank() == 0;
            let loss = model
                .forward(input(0, ctx.device()), use_b)
                .powi_scalar(2)
                .mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let own = grads
                .get::<Inner, 2>(model.b.weight.id)
                .map(|g| local_shard(g.into_primitive().tensor()));
            let orphans = zero.take_orphan_gradients();
            let orphan = orphans.get(&2).cloned().map(local_shard);
            Ok((own, orphan))
        })
        .unwrap_or_else(|e| panic!("stage {stage}: {e}"));
        let (own0, orphan0) = &per_rank[0];
        let (own1, orphan1) = &per_rank[1];
        assert!(orphan0.is_none() && own1.is_none(), "stage {stage}");
        let (own0, orphan1) = (own0.as_ref().unwrap(), orphan1.as_ref().unwrap());
        assert_eq!(
            (own0.len(), orphan1.len()),
            (9, 9),
            "18 elements over 2 ranks"
        );
        assert!(
            own0.iter().chain(orphan1).any(|v| *v != 0.0),
            "stage {stage}: the mean carries rank 0's gradient"
        );
    }
}

/// Reductions in rank order on an engine without an all-to-all are refused by name while
/// sharding, on every rank, rather than failing the first reduction of training.
#[test]
fn reductions_in_rank_order_need_an_engine_with_an_all_to_all() {
    use burn_zero_comm::RankContext;
    use burn_zero_testing::engines::WithoutAllToAll;

    let errors = launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let engine = std::sync::Arc::new(WithoutAllToAll(ctx.engine().clone()));
        let ctx = RankContext::new(*ctx.device(), engine);
        let config = ZeroConfig::new().with_reduce_in_rank_order(true);
        let model = Mlp::<Train>::new(5, false, ctx.device());
        Ok(shard(model, &ctx, &config)
            .map(drop)
            .expect_err("no all-to-all"))
    })
    .unwrap();
    for error in errors {
        let said = error.to_string();
        assert!(
            said.contains("reduce_in_rank_order") && said.contains("all_to_all"),
            "{said}"
        );
    }
}
