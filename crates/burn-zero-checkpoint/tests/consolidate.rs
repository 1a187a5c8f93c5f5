//! Consolidation: the sharded checkpoint of a 2-rank stage-3 run becomes one safetensors file
//! that plain Burn (burn-store, no burn-zero) loads into the model, giving the trained values
//! and the same loss; and a world-size-1 checkpoint that loads at another world size. With the
//! parameters packed into chunks nothing changes: the same files, byte for byte.

mod common;

use burn::backend::Flex;
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn_store::{ModuleSnapshot, SafetensorsStore};
use burn_zero_checkpoint::{
    OutputDtype, SaveOptions, consolidate, consolidate_checkpoint, load, save,
};
use burn_zero_comm::launch;
use burn_zero_core::{ChunkSize, shard};
use burn_zero_testing::{
    Block, Inner, Train, base_model, micro_batch, param_values, params_bits_equal,
};
use common::{Failure, adam, config, scratch, train};

const WORLD: usize = 2;
const PROBE: usize = 99;

fn loss<B: Backend>(model: &Block<B>, device: &B::Device) -> f32 {
    let (tokens, targets) = micro_batch::<B>(PROBE, device);
    model
        .loss(tokens, targets)
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap()[0]
}

#[test]
fn a_consolidated_checkpoint_loads_in_plain_burn_with_the_trained_values_and_loss() {
    let base = base_model(&Default::default());
    let per_parameter = consolidates(&base, ChunkSize::PerParameter, "param");
    // Chunks of 256 elements pack several parameters together (checked in `consolidates`); the
    // checkpoint stays keyed by parameter, so consolidation writes the same bytes.
    let chunked = consolidates(&base, ChunkSize::Elements(256), "chunks");
    assert!(
        per_parameter == chunked,
        "the consolidated files of the chunked run differ from the per-parameter run's"
    );
}

/// Trains `base`, saves, consolidates and checks the consolidated files with the parameters
/// packed by `chunk_size`; returns the fp32 consolidated file and the world-size-1 checkpoint's rank
/// file (parameters, masters and Adam's moments, whole).
fn consolidates(base: &Block<Train>, chunk_size: ChunkSize, tag: &str) -> (Vec<u8>, Vec<u8>) {
    let config = |stage| config(stage).with_chunk_size(chunk_size);
    let dir = scratch(&format!("consolidate-{tag}"));
    let saved = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, &config(3))?;
        let packed = zero
            .store()
            .chunks()
            .chunks()
            .iter()
            .any(|c| c.members.len() > 1);
        assert_eq!(
            packed,
            chunk_size != ChunkSize::PerParameter,
            "{chunk_size:?}: chunks of several parameters"
        );
        let mut optim = adam(&zero);
        let model = train(model, &mut optim, ctx.rank(), WORLD, 0..3);
        save(&dir, 3, &model, &optim, &SaveOptions::default())?;
        // The loss without autodiff, as plain Burn computes it below: Burn's autodiff composes
        // softmax from elementary ops where Flex has its own kernel, so a loss taken through
        // `Autodiff` may differ from plain Flex's in the last bits.
        let eval = model.valid();
        Ok((param_values(&model), loss::<Inner>(&eval, ctx.device())))
    })
    .unwrap()
    .remove(0);

    let device = Default::default();
    for dtype in [OutputDtype::F32, OutputDtype::Training] {
        let out = dir.join(format!("model-{dtype:?}.safetensors"));
        consolidate(&dir, &out, dtype).unwrap();
        // Plain Burn: a freshly initialised model of the inner backend, loaded by burn-store.
        let mut plain = Block::<Flex>::new(&device);
        let applied = plain
            .load_from(&mut SafetensorsStore::from_file(&out))
            .unwrap();
        assert!(
            applied.is_success() && applied.missing.is_empty() && applied.unused.is_empty(),
            "{dtype:?}: {applied:?}"
        );
        assert!(
            params_bits_equal(&param_values(&plain), &saved.0),
            "{dtype:?}: the consolidated values differ from the trained model's"
        );
        let plain_loss = loss::<Flex>(&plain, &device);
        assert_eq!(
            plain_loss.to_bits(),
            saved.1.to_bits(),
            "{dtype:?}: plain Burn's loss {plain_loss} differs from the trained model's {}",
            saved.1
        );
    }

    // The command-line tool writes the same file.
    let out = dir.join("cli.safetensors");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_zero-consolidate"))
        .arg(&dir)
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(dir.join("model-F32.safetensors")).unwrap()
    );

    // A world-size-1 checkpoint with the optimizer state loads at 3 ranks like the original.
    let single = scratch(&format!("consolidate-single-{tag}"));
    consolidate_checkpoint(&dir, &single).unwrap();
    let resumed = |from: std::path::PathBuf| {
        launch::<Flex, _, _, Failure>(3, &[Default::default()], |ctx| {
            let (model, zero) = shard(base_model(ctx.device()), &ctx, &config(3))?;
            let (model, mut optim, _) = load(&from, model, adam(&zero))?;
            let model = train(model, &mut optim, ctx.rank(), 3, 3..5);
            Ok(param_values(&model))
        })
        .unwrap()
        .remove(0)
    };
    assert!(params_bits_equal(
        &resumed(dir.clone()),
        &resumed(single.clone())
    ));
    let files = (
        std::fs::read(dir.join("model-F32.safetensors")).unwrap(),
        std::fs::read(single.join("rank-00000-of-00001.safetensors")).unwrap(),
    );
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&single).ok();
    files
}
