//! End-to-end training parity on any backend: the transformer block of `burn-zero-testing`
//! trained with its global batch split across ranks (`ZeroOptimizer`, Adam) against one rank
//! training unsharded with Burn's Adam on the same micro-batches, their gradients averaged in
//! rank order.
//!
//! Bitwise where the backend is deterministic; where it is not, within a tolerance fixed here
//! from the measured run-to-run difference of the single-rank reference itself (see
//! [`Tolerance`]), never from the result being checked.

#![allow(dead_code)]

use burn::backend::Autodiff;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer, SgdConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn_zero_comm::{LaunchOptions, launch_with};
use burn_zero_core::{Zero, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{OptimizerConfig, PerTensor, StateBytes, ZeroOptimizer};
use burn_zero_testing::{Block, micro_batch, param_values, step_mean_grads};

pub const LR: f64 = 1e-2;

/// The training backend of ranks that compute on `X`.
pub type Train<X> = Autodiff<Zero<X>>;

/// The optimizer both sides train with: Burn's own on the single rank; on the ranks, Burn's
/// Adam inside `ZeroOptimizer` (`PerTensor`), or the fused SGD, which is bitwise Burn's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    Adam,
    /// SGD with momentum 0.9.
    SgdMomentum,
}

fn sgd_momentum() -> SgdConfig {
    SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
}

/// Single rank, no sharding, Burn's Adam: each of `steps` steps averages the gradients of
/// `world_size` micro-batches in rank order. Returns every parameter's final values.
pub fn reference<X: Backend>(
    base: &Block<Train<X>>,
    world_size: usize,
    steps: usize,
    device: &X::Device,
) -> Vec<Vec<f32>> {
    reference_with::<X>(base, world_size, steps, device, Rule::Adam)
}

/// [`reference`] with Burn's optimizer for `rule`.
pub fn reference_with<X: Backend>(
    base: &Block<Train<X>>,
    world_size: usize,
    steps: usize,
    device: &X::Device,
    rule: Rule,
) -> Vec<Vec<f32>> {
    fn run<X: Backend, O: Optimizer<Block<Train<X>>, Train<X>>>(
        base: &Block<Train<X>>,
        world_size: usize,
        steps: usize,
        device: &X::Device,
        mut optim: O,
    ) -> Vec<Vec<f32>> {
        let mut model = base.clone();
        for step in 0..steps {
            let (mean, _) = step_mean_grads::<X>(&model, step, world_size, device);
            model = optim.step(LR, model, mean);
        }
        param_values(&model)
    }
    match rule {
        Rule::Adam => run(base, world_size, steps, device, AdamConfig::new().init()),
        Rule::SgdMomentum => run(base, world_size, steps, device, sgd_momentum().init()),
    }
}

/// `world_size` ranks on `device` (threads of this process, `LocalGroup`), each training its
/// micro-batches with `ZeroOptimizer` over Adam. Returns each rank's final parameters.
pub fn sharded<X: Backend>(
    base: &Block<Train<X>>,
    world_size: usize,
    steps: usize,
    config: &ZeroConfig,
    device: &X::Device,
) -> Vec<Vec<Vec<f32>>> {
    sharded_with::<X>(base, world_size, steps, config, device, Rule::Adam)
}

/// [`sharded`] with `ZeroOptimizer` over the optimizer of `rule`.
pub fn sharded_with<X: Backend>(
    base: &Block<Train<X>>,
    world_size: usize,
    steps: usize,
    config: &ZeroConfig,
    device: &X::Device,
    rule: Rule,
) -> Vec<Vec<Vec<f32>>> {
    sharded_on::<X>(base, world_size, steps, config, device, rule, |ctx| ctx)
}

/// [`sharded_with`] on the rank context `engine` makes of each rank's own (another engine
/// around `LocalGroup`'s, say).
pub fn sharded_on<X: Backend>(
    base: &Block<Train<X>>,
    world_size: usize,
    steps: usize,
    config: &ZeroConfig,
    device: &X::Device,
    rule: Rule,
    engine: impl Fn(burn_zero_comm::RankContext<X>) -> burn_zero_comm::RankContext<X> + Sync,
) -> Vec<Vec<Vec<f32>>> {
    fn train<X: Backend, C>(
        base: &Block<Train<X>>,
        ctx: &burn_zero_comm::RankContext<X>,
        steps: usize,
        config: &ZeroConfig,
        optim: C,
    ) -> Result<Vec<Vec<f32>>, ZeroError>
    where
        C: OptimizerConfig,
        C::Optimizer: SimpleOptimizer<X> + SimpleOptimizer<burn::backend::Flex>,
        <C::Optimizer as SimpleOptimizer<X>>::State<1>: StateBytes,
        <C::Optimizer as SimpleOptimizer<burn::backend::Flex>>::State<1>: StateBytes,
    {
        let world_size = ctx.world_size();
        let (mut model, zero) = shard(base.clone(), ctx, config)?;
        let mut optimizer = ZeroOptimizer::new(&zero, optim)?;
        for step in 0..steps {
            let (tokens, targets) =
                micro_batch::<Train<X>>(step * world_size + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        Ok(param_values(&model))
    }
    let options = LaunchOptions::with_timeout(std::time::Duration::from_secs(300));
    launch_with::<X, _, _, ZeroError>(world_size, std::slice::from_ref(device), &options, |ctx| {
        let ctx = engine(ctx);
        match rule {
            Rule::Adam => train(
                base,
                &ctx,
                steps,
                config,
                PerTensor(AdamConfig::new().build()),
            ),
            // The fused SGD: Burn's `Sgd<B>` steps on its own backend only, and the optimizer
            // needs one it can step on the host too.
            Rule::SgdMomentum => train(base, &ctx, steps, config, sgd_momentum()),
        }
    })
    .unwrap_or_else(|e| panic!("world {world_size}, stage {}: {e}", config.stage))
}

/// The configurations checked: stages 0–3, small buckets, most parameters sharded at stage 3.
pub fn configs() -> Vec<ZeroConfig> {
    (0..=3)
        .map(|stage| {
            ZeroConfig::new()
                .with_stage(stage)
                .with_persist_below_numel(12)
                .with_bucket_size_mb(0.001)
        })
        .collect()
}

/// How close the sharded runs must come to the reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tolerance {
    /// The reference is bitwise reproducible: bit for bit.
    Bitwise,
    /// The reference is not: within this absolute difference, [`NOISE_FACTOR`] times the
    /// largest difference measured between its runs.
    Absolute(f32),
}

/// How many times the reference's own run-to-run difference the sharded runs may differ by.
/// Fixed before any sharded run was compared: the sharded ranks run the same kernels on the
/// same micro-batches, so their only other source of difference is that same noise.
pub const NOISE_FACTOR: f32 = 10.0;

/// What the README says of a backend's training parity, which its tests must show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Bit for bit: the single-rank reference must repeat itself exactly, else the test fails.
    Bitwise,
    /// Within [`NOISE_FACTOR`] times the reference's own run-to-run difference (bitwise when
    /// its runs agree).
    WithinNoise,
}

/// Runs the Adam reference `runs` times and derives the tolerance from how much its runs
/// differ, which `claim` must allow. Returns the first run's values with it.
pub fn measure_reference<X: Backend>(
    base: &Block<Train<X>>,
    world_size: usize,
    steps: usize,
    device: &X::Device,
    runs: usize,
    claim: Claim,
) -> (Vec<Vec<f32>>, Tolerance) {
    measure_reference_with::<X>(base, world_size, steps, device, runs, Rule::Adam, claim)
}

/// [`measure_reference`] with Burn's optimizer for `rule`.
pub fn measure_reference_with<X: Backend>(
    base: &Block<Train<X>>,
    world_size: usize,
    steps: usize,
    device: &X::Device,
    runs: usize,
    rule: Rule,
    claim: Claim,
) -> (Vec<Vec<f32>>, Tolerance) {
    let first = reference_with::<X>(base, world_size, steps, device, rule);
    let (mut noise, mut bitwise) = (0f32, true);
    for _ in 1..runs {
        let again = reference_with::<X>(base, world_size, steps, device, rule);
        noise = noise.max(max_difference(&first, &again));
        bitwise &= bitwise_same(&first, &again);
    }
    assert!(
        bitwise || claim == Claim::WithinNoise,
        "the single-rank reference did not repeat itself bit for bit (its runs differ by up to \
         {noise:e}), so bitwise parity cannot hold on this backend"
    );
    let tolerance = if bitwise {
        Tolerance::Bitwise
    } else {
        Tolerance::Absolute(NOISE_FACTOR * noise)
    };
    (first, tolerance)
}

/// The largest absolute difference between two runs' parameters.
pub fn max_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

fn bitwise_same(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Asserts every rank's parameters against the reference under `tolerance`.
pub fn assert_close(got: &[Vec<Vec<f32>>], want: &[Vec<f32>], tolerance: Tolerance, what: &str) {
    for (rank, params) in got.iter().enumerate() {
        match tolerance {
            Tolerance::Bitwise => assert!(
                bitwise_same(params, want),
                "{what}, rank {rank}: not bitwise equal to single-rank training (largest \
                 difference {})",
                max_difference(params, want)
            ),
            Tolerance::Absolute(limit) => {
                let difference = max_difference(params, want);
                assert!(
                    difference <= limit,
                    "{what}, rank {rank}: differs from single-rank training by {difference}, \
                     more than {limit} ({NOISE_FACTOR} × the reference's own run-to-run \
                     difference)"
                );
            }
        }
    }
}

/// The whole check at 2 and 4 ranks, stages 0–3, with Adam; says which mode each world size
/// was checked in, on the test's output even when the harness captures it.
pub fn check_parity<X: Backend>(
    base: &Block<Train<X>>,
    steps: usize,
    device: &X::Device,
    name: &str,
    claim: Claim,
) -> Vec<(usize, Tolerance)> {
    check_parity_with::<X>(
        base,
        steps,
        device,
        name,
        Rule::Adam,
        &[2, 4],
        &[0, 1, 2, 3],
        claim,
    )
}

/// [`check_parity`] with the optimizer of `rule`, at `worlds` and `stages`.
#[allow(clippy::too_many_arguments)]
pub fn check_parity_with<X: Backend>(
    base: &Block<Train<X>>,
    steps: usize,
    device: &X::Device,
    name: &str,
    rule: Rule,
    worlds: &[usize],
    stages: &[u8],
    claim: Claim,
) -> Vec<(usize, Tolerance)> {
    let mut used = Vec::new();
    for &world_size in worlds {
        let (want, tolerance) =
            measure_reference_with::<X>(base, world_size, steps, device, 3, rule, claim);
        for config in configs()
            .into_iter()
            .filter(|config| stages.contains(&config.stage))
        {
            let got = sharded_with::<X>(base, world_size, steps, &config, device, rule);
            let what = format!(
                "{name}, {rule:?}, world {world_size}, stage {}",
                config.stage
            );
            assert_close(&got, &want, tolerance, &what);
        }
        let mode = match tolerance {
            Tolerance::Bitwise => "bitwise".to_string(),
            Tolerance::Absolute(limit) => {
                format!("within {NOISE_FACTOR}x the measured run-to-run difference ({limit:e})")
            }
        };
        burn_zero_testing::skip::note(format!(
            "{name}, {rule:?}, {world_size} ranks, {steps} steps: checked {mode}"
        ));
        used.push((world_size, tolerance));
    }
    used
}

/// The chunk layout `shard` makes for `base` on 2 ranks of backend `X` with the default chunk
/// size (stage 3), and the number of parameters it lays out.
#[allow(dead_code)]
pub fn default_layout<X: Backend>(
    base: &Block<Train<X>>,
    device: &X::Device,
) -> (burn_zero_core::chunk::ChunkLayout, usize) {
    let config = ZeroConfig::new().with_stage(3).with_persist_below_numel(12);
    let options = LaunchOptions::with_timeout(std::time::Duration::from_secs(300));
    let mut ranks =
        launch_with::<X, _, _, ZeroError>(2, std::slice::from_ref(device), &options, |ctx| {
            let (model, zero) = shard(base.clone(), &ctx, &config)?;
            let layout = zero.store().chunks().clone();
            let params = zero.store().params().len();
            drop(model);
            Ok((layout, params))
        })
        .unwrap();
    ranks.swap_remove(0)
}
