//! When ranks fail, the error the launcher returns is the one that caused the others, with its
//! rank; the ranks that stopped because of it are listed as consequences. Checked for a save
//! failure, a load failure and a panic, each on rank 0 and on rank 1.
//!
//! The failing rank is made to return last (it sleeps before returning its error), so a
//! launcher that reported whichever rank returned first would name a consequence.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_checkpoint::{SaveOptions, latest, load, read_metadata, save};
use burn_zero_comm::{LaunchError, launch};
use burn_zero_core::shard;
use burn_zero_testing::{Train, base_model};
use common::{Failure, adam, config, scratch};

const WORLD: usize = 2;

/// The failing rank's head start for the others: they return well before it.
const LATE: Duration = Duration::from_millis(200);

/// The launcher's error: the rank it names first, its message, and the ranks it lists as
/// consequences.
fn cause(result: Result<Vec<()>, LaunchError>) -> (usize, String, Vec<usize>) {
    match result {
        Err(LaunchError::RankFailed {
            rank,
            failure,
            others,
        }) => (
            rank,
            failure.to_string(),
            others.into_iter().map(|(r, _)| r).collect(),
        ),
        other => panic!("expected a rank failure, got {other:?}"),
    }
}

/// Trains one step on both ranks and saves to `root`, except that rank `failing` saves to
/// `elsewhere` (a path under a plain file, where no directory can be made).
fn save_with_one_bad_root(
    root: &Path,
    elsewhere: &Path,
    failing: usize,
) -> Result<Vec<()>, LaunchError> {
    launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(base_model(ctx.device()), &ctx, &config(3))?;
        let mut optim = adam(&zero);
        let model = common::train(model, &mut optim, ctx.rank(), WORLD, 0..1);
        let target = if ctx.rank() == failing {
            elsewhere
        } else {
            root
        };
        let saved = save(target, 1, &model, &optim, &SaveOptions::default());
        if saved.is_err() && ctx.rank() == failing {
            std::thread::sleep(LATE);
        }
        saved?;
        Ok(())
    })
}

#[test]
fn a_save_failure_is_reported_by_the_rank_it_happened_on() {
    for failing in [0, 1] {
        let root = scratch(&format!("cause-save-{failing}"));
        let file = root.join("not-a-directory");
        std::fs::write(&file, b"a file").unwrap();
        let (rank, message, others) = cause(save_with_one_bad_root(&root, &file, failing));
        assert_eq!(rank, failing, "{message}");
        assert!(
            !message.contains("failed on rank"),
            "the cause's own error, not a consequence: {message}"
        );
        assert!(message.contains("not-a-directory"), "{message}");
        assert_eq!(others, vec![1 - failing]);
        std::fs::remove_dir_all(&root).ok();
    }
}

/// A model large enough that a rank's piece of one tensor spans checksum pages (1 MiB) no
/// other rank reads: a corrupt byte there fails only the rank that owns it.
#[derive(Module, Debug)]
struct Wide<B: Backend> {
    fc: Linear<B>,
}

fn wide(device: &burn::backend::flex::FlexDevice) -> Wide<Train> {
    Wide {
        fc: LinearConfig::new(1024, 1024).init(device),
    }
}

/// A checkpoint of one trained step of [`Wide`] saved by both ranks into a fresh directory.
fn saved_wide(name: &str) -> PathBuf {
    let root = scratch(name);
    launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(wide(ctx.device()), &ctx, &config(3))?;
        let mut optim = adam(&zero);
        let x = Tensor::<Train, 2>::ones([2, 1024], ctx.device());
        let grads = GradientsParams::from_grads(model.fc.forward(x).mean().backward(), &model);
        let model = optim.step(1e-3, model, grads);
        save(&root, 1, &model, &optim, &SaveOptions::default())?;
        Ok(())
    })
    .unwrap();
    root
}

/// Flips the middle byte of rank `rank`'s piece of the weight's first Adam moment.
fn corrupt_optimizer_state(root: &Path, rank: usize) {
    let step = latest(root).unwrap().unwrap().path;
    let meta = read_metadata(&step).unwrap();
    let piece = meta.tensors["optim/fc.weight/momentum.moment_1"]
        .pieces
        .iter()
        .find(|p| p.rank == rank)
        .expect("the rank's piece")
        .clone();
    let file = step.join(&meta.files[rank].name);
    let mut bytes = std::fs::read(&file).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let middle = (piece.data_offsets.0 + piece.data_offsets.1) / 2;
    bytes[8 + header + middle] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
}

#[test]
fn a_load_failure_is_reported_by_the_rank_whose_file_is_corrupt() {
    for failing in [0, 1] {
        let root = saved_wide(&format!("cause-load-{failing}"));
        corrupt_optimizer_state(&root, failing);
        let result = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(wide(ctx.device()), &ctx, &config(3))?;
            let loaded = load(&root, model, adam(&zero));
            if loaded.is_err() && ctx.rank() == failing {
                std::thread::sleep(LATE);
            }
            loaded?;
            Ok(())
        });
        let (rank, message, others) = cause(result);
        assert_eq!(rank, failing, "{message}");
        assert!(
            message.contains("checksum") && message.contains("moment_1"),
            "{message}"
        );
        assert_eq!(others, vec![1 - failing]);
        std::fs::remove_dir_all(&root).ok();
    }
}

#[test]
fn a_panic_is_reported_by_the_rank_that_panicked() {
    for failing in [0, 1] {
        let result = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(base_model(ctx.device()), &ctx, &config(3))?;
            let mut optim = adam(&zero);
            let model = common::train(model, &mut optim, ctx.rank(), WORLD, 0..1);
            if ctx.rank() == failing {
                panic!("rank {failing} ran out of patience");
            }
            // The other rank's next step gathers and reduces: it stops on the panic.
            common::train(model, &mut optim, ctx.rank(), WORLD, 1..2);
            Ok(())
        });
        let (rank, message, others) = cause(result);
        assert_eq!(rank, failing, "{message}");
        assert!(message.contains("ran out of patience"), "{message}");
        assert_eq!(others, vec![1 - failing]);
    }
}
