//! Optimizer state placed between device and host by chunk (`Placement`'s
//! `offload_optim_frac`, Gemini's): with Flex on both sides, every fraction trains the same bits
//! as the optimizer kept whole on the device, at stages 1 and 3, per parameter and with chunks,
//! with gradient accumulation and loss scaling; with clipping the norm is summed per side, so it
//! agrees to rounding. The state really is split (bytes on each side, in the memory report as
//! well), the host chunks' gradients leave the device during backward; a record is the whole
//! state on the host, and resumes bitwise under another placement (the module gathered and
//! sharded again with it), after chunks moved; a fraction outside 0..1 is refused by name.

use burn::backend::Flex;
use burn::optim::{Adam, AdamConfig, GradientsParams, Optimizer};
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, Placement, ZeroConfig, ZeroError, ZeroState, shard, unshard};
use burn_zero_optim::{LossScalerConfig, NormType, OptimizerError, PerTensor, ZeroOptimizer};
use burn_zero_testing::{Block, Train, base_model, micro_batch, param_values, params_bits_equal};

const WORLD: usize = 2;
const STEPS: usize = 4;
const LR: f64 = 1e-2;

/// Burn's Adam, its state placed as `zero`'s module was sharded.
fn adam(zero: &ZeroState<Flex>) -> ZeroOptimizer<Flex, Adam> {
    ZeroOptimizer::new(zero, PerTensor(AdamConfig::new().build())).expect("Burn's Adam")
}

/// Every rank's final parameters after `STEPS` steps with the optimizer `make` builds.
fn train<Opt>(
    base: &Block<Train>,
    config: &ZeroConfig,
    make: impl Fn(&ZeroState<Flex>) -> Opt + Sync,
) -> Vec<Vec<Vec<f32>>>
where
    Opt: Optimizer<Block<Train>, Train>,
{
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer = make(&zero);
        for step in 0..STEPS {
            let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        Ok(param_values(&model))
    })
    .unwrap()
}

fn config(stage: u8, chunks: ChunkSize) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(stage)
        .with_persist_below_numel(12)
        .with_chunk_size(chunks)
}

/// `config` with `frac` of the optimizer state on the host.
fn optim_frac(config: &ZeroConfig, frac: f64) -> ZeroConfig {
    config
        .clone()
        .with_placement(Placement::fractions(0.0, frac))
}

#[test]
fn every_fraction_trains_the_bits_of_the_optimizer_on_the_device() {
    let base = base_model(&Default::default());
    let chunk_sizes = [ChunkSize::PerParameter, ChunkSize::Elements(256)];
    for stage in [1, 3] {
        for chunks in chunk_sizes {
            let config = config(stage, chunks);
            let make = |zero: &ZeroState<Flex>| {
                adam(zero)
                    .with_accumulation(2)
                    .with_loss_scaler(LossScalerConfig::new())
            };
            let whole = train(&base, &config, make);
            for frac in [0.0, 0.5, 1.0] {
                let split = train(&base, &optim_frac(&config, frac), make);
                for rank in 0..WORLD {
                    assert!(
                        params_bits_equal(&whole[rank], &split[rank]),
                        "stage {stage}, {chunks:?}, offload_optim_frac {frac}, rank {rank}"
                    );
                }
            }
        }
    }
}

#[test]
fn clipping_sees_both_sides_and_agrees_to_rounding() {
    let base = base_model(&Default::default());
    let config = config(3, ChunkSize::Elements(256));
    let clipped = |zero: &ZeroState<Flex>| adam(zero).with_clipping(0.05, NormType::L2);
    let whole = train(&base, &config, clipped);
    let split = train(&base, &optim_frac(&config, 0.5), clipped);
    let unclipped = train(&base, &optim_frac(&config, 0.5), adam);
    let difference = |a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]| {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .flat_map(|(x, y)| x.iter().zip(y))
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    // The sides' sums of squares are added in another order than one sum over every chunk, so
    // the global norm, and with it the clipping factor, can differ in its last bits (a few
    // parts in 10^7). Over 4 Adam steps of lr 1e-2 that moves a parameter by about 1e-8, under
    // the rounding of the values themselves (an ulp of a value near 1 is 1.2e-7). Bound: 1e-6.
    // Measured over 40 processes (each draws its own initial model): at most 2.4e-7.
    let rounding = difference(&whole, &split);
    println!("clipped, split against whole: largest difference {rounding:e}");
    assert!(rounding < 1e-6, "{rounding:e}");
    // The clipping acted: without it the values are elsewhere.
    assert!(difference(&whole, &unclipped) > 1e-4);
}

#[test]
fn the_state_is_split_and_host_gradients_leave_the_device_during_backward() {
    let base = base_model(&Default::default());
    let config = config(3, ChunkSize::Elements(256));
    let runs = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let mut per_frac = Vec::new();
        for frac in [0.0, 0.5, 1.0] {
            let (mut model, zero) = shard(base.clone(), &ctx, &optim_frac(&config, frac))?;
            let mut optimizer = adam(&zero);
            let mut backward_reads = 0;
            for step in 0..2 {
                let (tokens, targets) = micro_batch::<Train>(step, ctx.device());
                let loss = model.loss(tokens, targets);
                let before = zero.counts();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                backward_reads = (zero.counts() - before).host_reads;
                model = optimizer.step(LR, model, grads);
            }
            // The memory accounting places each side's bytes where they are.
            let report = zero.memory_report();
            let accounted = (
                (
                    report.master_weights.current as usize,
                    report.optimizer_state.current as usize,
                ),
                (
                    report.host_master_weights.current as usize,
                    report.host_optimizer_state.current as usize,
                ),
            );
            assert_eq!(accounted, optimizer.bytes(), "offload_optim_frac {frac}");
            per_frac.push((frac, optimizer.bytes(), backward_reads));
        }
        Ok(per_frac)
    })
    .unwrap();
    for (rank, per_frac) in runs.iter().enumerate() {
        let (_, ((all_masters, all_state), _), none_read) = per_frac[0];
        assert!(
            all_masters > 0 && all_state == 2 * all_masters,
            "rank {rank}"
        );
        assert_eq!(none_read, 0, "rank {rank}: nothing steps on the host");
        let (_, ((device_masters, _), (host_masters, host_state)), half_read) = per_frac[1];
        assert!(
            device_masters > 0 && host_masters > 0,
            "rank {rank}: {per_frac:?}"
        );
        assert_eq!(device_masters + host_masters, all_masters, "rank {rank}");
        assert_eq!(host_state, 2 * host_masters, "rank {rank}");
        let (_, ((device_masters, _), (host_masters, _)), every_read) = per_frac[2];
        assert_eq!(
            (device_masters, host_masters),
            (0, all_masters),
            "rank {rank}"
        );
        assert!(
            half_read > 0 && half_read < every_read,
            "rank {rank}: gradients read back during backward: {half_read} with half the \
             chunks on the host, {every_read} with all"
        );
    }
}

#[test]
fn records_resume_bitwise_under_any_placement_and_a_fraction_outside_0_to_1_is_refused() {
    let base = base_model(&Default::default());
    let config = config(3, ChunkSize::Elements(256));
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let step = |model: Block<Train>, optimizer: &mut ZeroOptimizer<Flex, Adam>, i: usize| {
            let (tokens, targets) = micro_batch::<Train>(i * WORLD + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            Optimizer::step(optimizer, LR, model, grads)
        };
        let (mut straight, zero) = shard(base.clone(), &ctx, &optim_frac(&config, 0.5))?;
        let mut optimizer = adam(&zero);
        for i in 0..6 {
            straight = step(straight, &mut optimizer, i);
        }

        // Two steps at ½, then half of the host chunks moved to the device, one more step; the
        // record goes on with the module sharded again at 1 (all on the host), then at 0.
        let (mut resumed, zero) = shard(base.clone(), &ctx, &optim_frac(&config, 0.5))?;
        let mut first = adam(&zero);
        for i in 0..2 {
            resumed = step(resumed, &mut first, i);
        }
        let moved: Vec<usize> = first.host_chunks().iter().copied().step_by(2).collect();
        first.place_on_device(&moved).unwrap();
        resumed = step(resumed, &mut first, 2);
        let mut record = Optimizer::<Block<Train>, Train>::to_record(&first);
        for (i, frac) in [(3, 1.0), (4, 0.0), (5, 0.5)] {
            let (model, zero) = shard(unshard(resumed), &ctx, &optim_frac(&config, frac))?;
            let mut optimizer = adam(&zero).restore(record);
            resumed = step(model, &mut optimizer, i);
            if frac == 0.0 {
                assert_eq!(optimizer.host_chunks(), &[] as &[usize]);
            }
            record = optimizer.record();
        }
        assert!(
            params_bits_equal(&param_values(&straight), &param_values(&resumed)),
            "rank {}: the resumed run left the uninterrupted one",
            ctx.rank()
        );
        Ok(())
    })
    .unwrap();

    for frac in [-0.1, 1.5, f64::NAN] {
        let refused = launch::<Flex, _, _, ZeroError>(1, &[Default::default()], |ctx| {
            shard(base.clone(), &ctx, &optim_frac(&config, frac)).map(drop)
        });
        let error = refused.expect_err("a fraction outside 0..1").to_string();
        assert!(
            error.contains("offload_optim_frac must be a fraction"),
            "{error}"
        );
    }
}

#[test]
fn chunks_moved_to_the_device_between_steps_train_the_same_bits() {
    let base = base_model(&Default::default());
    let config = config(3, ChunkSize::Elements(256));
    let whole = train(&base, &config, |zero| adam(zero).with_accumulation(2));
    let moved = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &optim_frac(&config, 1.0))?;
        let mut optimizer = adam(&zero).with_accumulation(2);
        let all = optimizer.host_chunks().to_vec();
        let mut reads = Vec::new();
        for step in 0..STEPS {
            if step == 1 {
                assert_eq!(
                    optimizer.place_on_device(&all[..1]),
                    Err(OptimizerError::InsideAccumulation(1))
                );
            }
            if step == 2 {
                assert_eq!(
                    optimizer.place_on_device(&[usize::MAX]),
                    Err(OptimizerError::NotOnHost(usize::MAX))
                );
                optimizer.place_on_device(&all[..all.len() / 2]).unwrap();
            }
            let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
            let loss = model.loss(tokens, targets);
            let before = zero.counts();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            reads.push((zero.counts() - before).host_reads);
            model = optimizer.step(LR, model, grads);
        }
        let report = zero.memory_report();
        Ok((
            param_values(&model),
            optimizer.bytes(),
            (
                report.master_weights.current as usize,
                report.host_master_weights.current as usize,
            ),
            optimizer.host_chunks() == &all[all.len() / 2..],
            reads,
        ))
    })
    .unwrap();
    for (rank, (params, ((device, _), (host, _)), accounted, halved, reads)) in
        moved.iter().enumerate()
    {
        assert!(params_bits_equal(&whole[rank], params), "rank {rank}");
        assert!(
            *device > 0 && *host > 0,
            "rank {rank}: {device} and {host} bytes"
        );
        assert_eq!(*accounted, (*device, *host), "rank {rank}");
        assert!(halved, "rank {rank}");
        // Fewer gradients are read back once half the chunks step on the device.
        assert!(
            reads[3] < reads[1],
            "rank {rank}: host reads per backward {reads:?}"
        );
    }
}
