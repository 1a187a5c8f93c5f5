//! Resuming from a checkpoint: at the same world size training goes on bitwise as if it had
//! never stopped (every stage, mid accumulation window, with the loss scaler); at another world
//! size it goes on bitwise like a single-rank run that averaged the old number of micro-batches
//! per step up to the checkpoint and the new number after it; a split optimizer's state resumes
//! under another split.

mod common;

use burn::backend::Flex;
use burn::optim::Adam;
use burn_zero_checkpoint::{SaveOptions, load, load_record, save, save_record};
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, Placement, ZeroConfig, ZeroState, shard};
use burn_zero_optim::LossScalerConfig;
use burn_zero_testing::{Block, Train, base_model, param_values, params_bits_equal};
use common::{Failure, adam, config, scratch, train, train_on};

#[test]
fn resume_at_the_same_world_size_is_bitwise_uninterrupted_training_at_every_stage() {
    const WORLD: usize = 2;
    let optimizer = |zero: &ZeroState<Flex>| {
        adam(zero).with_accumulation(2).with_loss_scaler(
            LossScalerConfig::new()
                .with_initial_scale(1024.0)
                .with_growth_interval(2),
        )
    };
    let base = base_model(&Default::default());
    let other = base_model(&Default::default());
    assert!(
        !params_bits_equal(&param_values(&base), &param_values(&other)),
        "the resumed model must start from other values than the saved one"
    );
    for stage in 0..=3 {
        let dir = scratch(&format!("same-{stage}"));
        let straight = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(base.clone(), &ctx, &config(stage))?;
            let mut optim = optimizer(&zero);
            let model = train(model, &mut optim, ctx.rank(), WORLD, 0..7);
            Ok((param_values(&model), optim.loss_scale()))
        })
        .unwrap();
        let resumed = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(base.clone(), &ctx, &config(stage))?;
            let mut optim = optimizer(&zero);
            // Three micro-steps: one optimizer step done, one micro-step accumulated.
            let model = train(model, &mut optim, ctx.rank(), WORLD, 0..3);
            save(&dir, 3, &model, &optim, &SaveOptions::default())?;
            drop((model, optim));

            let (model, zero) = shard(other.clone(), &ctx, &config(stage))?;
            let (model, mut optim, loaded) = load(&dir, model, optimizer(&zero))?;
            assert_eq!(loaded.step, 3);
            let model = train(model, &mut optim, ctx.rank(), WORLD, 3..7);
            Ok((param_values(&model), optim.loss_scale()))
        })
        .unwrap_or_else(|e| panic!("stage {stage}: {e}"));
        for rank in 0..WORLD {
            assert!(
                params_bits_equal(&straight[rank].0, &resumed[rank].0),
                "stage {stage}, rank {rank}: resumed training differs from uninterrupted training"
            );
            assert_eq!(
                straight[rank].1, resumed[rank].1,
                "loss scale, stage {stage}"
            );
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Trains `steps_before` steps at `saved` ranks (stage `saved_stage`), saves, resumes at
/// `resumed` ranks (stage `resumed_stage`) for `steps_after` steps; checks the result against
/// one rank that averages `saved` micro-batches per step, then `resumed`.
fn reshard(saved: usize, saved_stage: u8, resumed: usize, resumed_stage: u8) {
    reshard_with(
        &base_model(&Default::default()),
        saved,
        &config(saved_stage),
        resumed,
        &config(resumed_stage),
        "stages",
    );
}

/// [`reshard`] from `base` with the saving and the resuming run's whole configurations (`tag`
/// tells the scratch directories of concurrent tests apart). Returns each resumed rank's final
/// parameters.
fn reshard_with(
    base: &Block<Train>,
    saved: usize,
    saved_config: &ZeroConfig,
    resumed: usize,
    resumed_config: &ZeroConfig,
    tag: &str,
) -> Vec<Vec<Vec<f32>>> {
    const BEFORE: usize = 3;
    const AFTER: usize = 3;
    let other = base_model(&Default::default());
    let dir = scratch(&format!("reshard-{tag}-{saved}-{resumed}"));

    let at_save = launch::<Flex, _, _, Failure>(saved, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, saved_config)?;
        let mut optim = adam(&zero);
        let model = train(model, &mut optim, ctx.rank(), saved, 0..BEFORE);
        save(&dir, BEFORE as u64, &model, &optim, &SaveOptions::default())?;
        Ok(param_values(&model))
    })
    .unwrap();

    let got = launch::<Flex, _, _, Failure>(resumed, &[Default::default()], |ctx| {
        let (model, zero) = shard(other.clone(), &ctx, resumed_config)?;
        let (model, mut optim, loaded) = load(&dir, model, adam(&zero))?;
        assert_eq!(loaded.saved_world_size, saved);
        let after_load = param_values(&model);
        let model = train(
            model,
            &mut optim,
            ctx.rank(),
            resumed,
            BEFORE..BEFORE + AFTER,
        );
        Ok((after_load, param_values(&model)))
    })
    .unwrap();

    // One rank: the same micro-batches, averaged in rank order by gradient accumulation.
    let want = launch::<Flex, _, _, Failure>(1, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &config(3))?;
        let mut optim = adam(&zero).with_accumulation(saved);
        let model = train_on(model, &mut optim, 0..BEFORE * saved);
        let before = param_values(&model);
        let mut optim = optim.with_accumulation(resumed);
        let model = train_on(
            model,
            &mut optim,
            BEFORE * resumed..(BEFORE + AFTER) * resumed,
        );
        Ok((before, param_values(&model)))
    })
    .unwrap()
    .remove(0);
    std::fs::remove_dir_all(&dir).ok();

    assert!(
        params_bits_equal(&at_save[0], &want.0),
        "the single-rank reference does not reproduce {saved}-rank training"
    );
    for (rank, (after_load, end)) in got.iter().enumerate() {
        assert!(
            params_bits_equal(after_load, &at_save[0]),
            "rank {rank} of {resumed}: loaded parameters differ from the saved ones"
        );
        assert!(
            params_bits_equal(end, &want.1),
            "rank {rank} of {resumed}: training resumed from {saved} ranks differs from the \
             single-rank reference"
        );
    }
    got.into_iter().map(|(_, end)| end).collect()
}

#[test]
fn two_ranks_resume_on_three_bitwise() {
    reshard(2, 3, 3, 1);
}

#[test]
fn four_ranks_resume_on_one_bitwise() {
    reshard(4, 2, 1, 3);
}

/// Chunks do not leak into the format: a checkpoint saved by 2 ranks whose parameters are
/// packed into chunks of 256 elements (stage 3) resumes on 3 ranks under the searched chunk
/// size and under one parameter per chunk, bitwise like the single-rank reference, and like
/// the same resume from a checkpoint saved with one parameter per chunk.
#[test]
fn a_checkpoint_saved_in_chunks_resumes_in_other_chunks_on_other_ranks_bitwise() {
    let chunked = |size: ChunkSize| config(3).with_chunk_size(size);
    // The layouts really pack: several parameters share a chunk in both chunked runs.
    for (ranks, size) in [
        (2, ChunkSize::Elements(256)),
        (3, ChunkSize::default_search()),
    ] {
        let packed = launch::<Flex, _, _, Failure>(ranks, &[Default::default()], |ctx| {
            let (_model, zero) = shard(base_model(ctx.device()), &ctx, &chunked(size))?;
            let chunks = zero.store().chunks();
            Ok(chunks.chunks().iter().map(|c| c.members.len()).max())
        })
        .unwrap();
        assert!(
            packed.iter().all(|&most| most > Some(1)),
            "{size:?} at {ranks} ranks packs one parameter per chunk: {packed:?}"
        );
    }
    let base = base_model(&Default::default());
    let from_chunks = chunked(ChunkSize::Elements(256));
    for (tag, size) in [
        ("search", ChunkSize::default_search()),
        ("param", ChunkSize::PerParameter),
    ] {
        let resumed = chunked(size);
        let got = reshard_with(
            &base,
            2,
            &from_chunks,
            3,
            &resumed,
            &format!("chunks-{tag}"),
        );
        let from_parameters = reshard_with(
            &base,
            2,
            &chunked(ChunkSize::PerParameter),
            3,
            &resumed,
            &format!("params-{tag}"),
        );
        for (rank, (a, b)) in got.iter().zip(&from_parameters).enumerate() {
            assert!(
                params_bits_equal(a, b),
                "rank {rank}, resumed under {size:?}: the chunked save resumes otherwise than \
                 the per-parameter one"
            );
        }
    }
}

/// Hybrid sharding, 4 ranks in 2 shard groups of 2: only the first group writes (one copy, two
/// rank files); resuming with the same groups is bitwise uninterrupted training, and one rank
/// without hybrid sharding loads the same values.
#[test]
fn hybrid_sharding_saves_one_copy_and_resumes_bitwise() {
    const BEFORE: usize = 3;
    const AFTER: usize = 2;
    let (world, group) = (4, 2);
    let hybrid = config(3).with_shard_group_size(group);
    let base = base_model(&Default::default());
    let other = base_model(&Default::default());
    let dir = scratch("hybrid");

    let straight = launch::<Flex, _, _, Failure>(world, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &hybrid)?;
        let mut optim = adam(&zero);
        let model = train(model, &mut optim, ctx.rank(), world, 0..BEFORE + AFTER);
        Ok(param_values(&model))
    })
    .unwrap();

    let saved = launch::<Flex, _, _, Failure>(world, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &hybrid)?;
        let mut optim = adam(&zero);
        let model = train(model, &mut optim, ctx.rank(), world, 0..BEFORE);
        let written = save(&dir, BEFORE as u64, &model, &optim, &SaveOptions::default())?;
        Ok((written, param_values(&model)))
    })
    .unwrap();
    let written = &saved[0].0;
    let mut rank_files: Vec<String> = std::fs::read_dir(written)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".safetensors"))
        .collect();
    rank_files.sort();
    assert_eq!(
        rank_files,
        [
            "rank-00000-of-00002.safetensors",
            "rank-00001-of-00002.safetensors"
        ],
        "one copy, written by the first shard group"
    );

    let resumed = launch::<Flex, _, _, Failure>(world, &[Default::default()], |ctx| {
        let (model, zero) = shard(other.clone(), &ctx, &hybrid)?;
        let (model, mut optim, loaded) = load(&dir, model, adam(&zero))?;
        assert_eq!(loaded.saved_world_size, group);
        let after_load = param_values(&model);
        let model = train(model, &mut optim, ctx.rank(), world, BEFORE..BEFORE + AFTER);
        Ok((after_load, param_values(&model)))
    })
    .unwrap();
    let flat = launch::<Flex, _, _, Failure>(1, &[Default::default()], |ctx| {
        let (model, zero) = shard(other.clone(), &ctx, &config(3))?;
        let (model, _, _) = load(&dir, model, adam(&zero))?;
        Ok(param_values(&model))
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();

    for (rank, (after_load, end)) in resumed.iter().enumerate() {
        assert!(
            params_bits_equal(after_load, &saved[rank].1),
            "rank {rank}: loaded parameters differ from the saved ones"
        );
        assert!(
            params_bits_equal(end, &straight[rank]),
            "rank {rank}: resumed hybrid training differs from uninterrupted training"
        );
    }
    assert!(
        params_bits_equal(&flat[0], &saved[0].1),
        "one rank without hybrid sharding loads other values"
    );
}

/// The optimizer's record is its whole state on the host backend whatever the placement, so a
/// checkpoint saved by 2 ranks with half the chunks' state on the host resumes on 1 rank with a
/// quarter there, bitwise like the same save and resume with the optimizer whole on the
/// device.
#[test]
fn a_placed_optimizer_resumes_on_other_ranks_with_another_fraction_bitwise() {
    const BEFORE: usize = 3;
    const AFTER: usize = 3;
    let base = base_model(&Default::default());
    let config = config(3).with_chunk_size(ChunkSize::Elements(256));
    let want = reshard_with(&base, 2, &config, 1, &config, "split-reference");
    let placed = |frac: f64| {
        config
            .clone()
            .with_placement(Placement::fractions(0.0, frac))
    };
    let dir = scratch("split");
    launch::<Flex, _, _, Failure>(2, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &placed(0.5))?;
        let mut optim = adam(&zero);
        assert!(!optim.host_chunks().is_empty());
        let model = train(model, &mut optim, ctx.rank(), 2, 0..BEFORE);
        let options = SaveOptions::default();
        save_record::<Train, Flex, _, Adam, Flex>(
            &dir,
            BEFORE as u64,
            &model,
            &zero,
            optim.record(),
            &options,
        )?;
        Ok(())
    })
    .unwrap();
    let got = launch::<Flex, _, _, Failure>(1, &[Default::default()], |ctx| {
        let (model, zero) = shard(base_model(&Default::default()), &ctx, &placed(0.25))?;
        let (model, record, _) = load_record::<Train, Flex, _, Adam, Flex>(&dir, model, &zero)?;
        let mut optim = adam(&zero).restore(record);
        let model = train(model, &mut optim, 0, 1, BEFORE..BEFORE + AFTER);
        Ok(param_values(&model))
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        params_bits_equal(&got[0], &want[0]),
        "the placed optimizer resumed differently from the optimizer whole on the device"
    );
}
