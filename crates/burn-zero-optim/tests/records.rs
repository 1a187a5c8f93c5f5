//! `ZeroOptimizer` as Burn's `Optimizer`: its record is each rank's own part, saved to a file
//! per rank with Burn's recorders and loaded into a fresh optimizer, after which training goes
//! on exactly as if it had never stopped.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::record::{BinFileRecorder, FullPrecisionSettings, Recorder};
use burn_zero_comm::{RankContext, launch};
use burn_zero_core::{ZeroConfig, ZeroError, ZeroState, shard, unshard};
use burn_zero_optim::{LossScalerConfig, PerTensor, ZeroOptimizer};
use burn_zero_testing::{Block, Train, base_model, micro_batch, param_values, params_bits_equal};

const WORLD: usize = 2;
const LR: f64 = 1e-2;

type Recorded = BinFileRecorder<FullPrecisionSettings>;

/// An ordinary Burn training loop, generic over the optimizer: steps `from..to`.
fn train<O: Optimizer<Block<Train>, Train>>(
    mut model: Block<Train>,
    optim: &mut O,
    ctx: &RankContext<Flex>,
    steps: std::ops::Range<usize>,
) -> Block<Train> {
    for step in steps {
        let (tokens, targets) = micro_batch::<Train>(step * WORLD + ctx.rank(), ctx.device());
        let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
        model = optim.step(LR, model, grads);
    }
    model
}

fn optimizer(zero: &ZeroState<Flex>) -> ZeroOptimizer<Flex, burn::optim::Adam> {
    ZeroOptimizer::new(zero, PerTensor(AdamConfig::new().build()))
        .unwrap()
        .with_accumulation(2)
        .with_loss_scaler(
            LossScalerConfig::new()
                .with_initial_scale(1024.0)
                .with_growth_interval(2),
        )
}

fn config() -> ZeroConfig {
    ZeroConfig::new().with_persist_below_numel(12)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-zero-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn rank_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("optimizer-rank{rank}"))
}

#[test]
fn a_saved_and_reloaded_optimizer_trains_on_bitwise_unchanged() {
    let base = base_model(&Default::default());
    let dir = scratch("records");

    let straight = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &config())?;
        let mut optim = optimizer(&zero);
        let model = train(model, &mut optim, &ctx, 0..7);
        Ok(param_values(&model))
    })
    .unwrap();

    let resumed = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &config())?;
        let mut optim = optimizer(&zero);
        // Stop in the middle of an accumulation window (3 micro-steps: one step, one pending).
        let model = train(model, &mut optim, &ctx, 0..3);
        let record = Optimizer::<Block<Train>, Train>::to_record(&optim);
        assert_eq!(record.placement, Some((ctx.rank(), WORLD)));
        assert_eq!(record.micro_steps, 1);
        assert!(!record.accumulated.is_empty());
        Recorder::<Train>::record(&Recorded::new(), record, rank_file(&dir, ctx.rank()))
            .expect("record saved");
        drop(optim);

        let loaded =
            Recorder::<Train>::load(&Recorded::new(), rank_file(&dir, ctx.rank()), ctx.device())
                .expect("record loaded");
        let mut optim = Optimizer::<Block<Train>, Train>::load_record(optimizer(&zero), loaded);
        let model = train(model, &mut optim, &ctx, 3..7);
        Ok(param_values(&model))
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();

    for rank in 0..WORLD {
        assert!(
            params_bits_equal(&straight[rank], &resumed[rank]),
            "rank {rank}: resumed training differs from uninterrupted training"
        );
    }
}

#[test]
fn a_record_loaded_on_another_rank_is_refused_by_name() {
    let base = base_model(&Default::default());
    let dir = scratch("swapped");
    let result = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &config())?;
        let mut optim = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let model = train(model, &mut optim, &ctx, 0..1);
        let record = Optimizer::<Block<Train>, Train>::to_record(&optim);
        Recorder::<Train>::record(&Recorded::new(), record, rank_file(&dir, ctx.rank())).unwrap();
        ctx.comm().barrier()?;
        // Each rank loads the other rank's file.
        let other = (ctx.rank() + 1) % WORLD;
        let loaded =
            Recorder::<Train>::load(&Recorded::new(), rank_file(&dir, other), ctx.device())
                .unwrap();
        let mut optim = Optimizer::<Block<Train>, Train>::load_record(
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap(),
            loaded,
        );
        train(model, &mut optim, &ctx, 1..2);
        Ok(())
    });
    std::fs::remove_dir_all(&dir).ok();
    let message = result
        .expect_err("a swapped record must be refused")
        .to_string();
    assert!(
        message.contains("belongs to rank") && message.contains("of 2 but it steps rank"),
        "{message}"
    );
}

/// Records stay per parameter whatever the chunk layout: a chunked optimizer's record (each
/// chunk's flat master and Adam state split at its parameters' boundaries) loads into an
/// optimizer of another layout — one parameter per chunk, or other chunks — and training goes
/// on bitwise as if it had never stopped; and the other way round.
#[test]
fn records_move_between_chunk_layouts_bitwise() {
    use burn_zero_core::ChunkSize;

    let base = base_model(&Default::default());
    let with = |chunk_size| config().with_stage(3).with_chunk_size(chunk_size);
    let straight = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &with(ChunkSize::PerParameter))?;
        let mut optim = optimizer(&zero);
        Ok(param_values(&train(model, &mut optim, &ctx, 0..7)))
    })
    .unwrap();
    let layouts = [
        (ChunkSize::Elements(256), ChunkSize::PerParameter),
        (ChunkSize::PerParameter, ChunkSize::Elements(256)),
        (ChunkSize::Elements(256), ChunkSize::default_search()),
    ];
    for (before, after) in layouts {
        let resumed = launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(base.clone(), &ctx, &with(before))?;
            let mut optim = optimizer(&zero);
            let model = train(model, &mut optim, &ctx, 0..3);
            let record = Optimizer::<Block<Train>, Train>::to_record(&optim);
            // The same module, gathered and sharded again with the other layout.
            let model = unshard(model);
            drop((optim, zero));
            let (model, zero) = shard(model, &ctx, &with(after))?;
            let optim = optimizer(&zero);
            let mut optim = Optimizer::<Block<Train>, Train>::load_record(optim, record);
            Ok(param_values(&train(model, &mut optim, &ctx, 3..7)))
        })
        .unwrap();
        for (rank, (got, want)) in resumed.iter().zip(&straight).enumerate() {
            assert!(
                params_bits_equal(got, want),
                "{before:?} → {after:?}, rank {rank}: differs from uninterrupted training"
            );
        }
    }
}
