//! Nothing is lost: a save killed midway leaves the previous checkpoint loadable and the partial
//! one reported incomplete; a full disk is a clear error with the previous checkpoint intact,
//! both on a small filesystem that really fills up (a tmpfs, where this process may mount one;
//! skipped by name elsewhere) and under a file-size limit;
//! corrupted and truncated files and mismatched models are refused by name; old checkpoints
//! are rotated out.
//!
//! The kill and the file-size limit run in a child process (this test binary, re-run on one
//! test).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_checkpoint::format::METADATA_FILE;
use burn_zero_checkpoint::{
    CheckpointError, SaveOptions, latest, list, load, read_metadata, resolve, save,
};
use burn_zero_comm::launch;
use burn_zero_core::shard;
use burn_zero_testing::{Train, param_values, params_bits_equal};
use common::{Failure, LR, adam, config, scratch};

const WORLD: usize = 2;
const CHILD: &str = "BURN_ZERO_CHECKPOINT_TEST_CHILD";

/// A model whose checkpoint files take a few MB, so that writing them takes a while.
#[derive(Module, Debug)]
struct Wide<B: Backend> {
    fc: Linear<B>,
    head: Linear<B>,
}

impl<B: Backend> Wide<B> {
    fn new(inputs: usize, device: &B::Device) -> Self {
        Self {
            fc: LinearConfig::new(inputs, 256).init(device),
            head: LinearConfig::new(256, 2).init(device),
        }
    }

    fn loss(&self, step: usize, device: &B::Device) -> Tensor<B, 1> {
        let inputs = self.fc.weight.dims()[0];
        let x = Tensor::<B, 2>::ones([2, inputs], device).mul_scalar(step as f64 + 1.0);
        self.head.forward(self.fc.forward(x)).mean()
    }
}

fn step(
    model: Wide<Train>,
    optim: &mut impl Optimizer<Wide<Train>, Train>,
    n: usize,
) -> Wide<Train> {
    let device = Default::default();
    let grads = GradientsParams::from_grads(model.loss(n, &device).backward(), &model);
    optim.step(LR, model, grads)
}

/// Re-runs this test binary on `test` alone with `CHILD=dir`.
fn child(test: &str, dir: &Path) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, dir);
    command
}

#[test]
fn a_save_killed_midway_leaves_the_previous_checkpoint_loadable() {
    if let Ok(dir) = std::env::var(CHILD) {
        // The child: saves after every step until killed.
        launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (mut model, zero) =
                shard(Wide::<Train>::new(2048, ctx.device()), &ctx, &config(3))?;
            let mut optim = adam(&zero);
            for n in 1.. {
                model = step(model, &mut optim, n);
                let options = SaveOptions {
                    keep_last: 2,
                    ..Default::default()
                };
                save(Path::new(&dir), n as u64, &model, &optim, &options)?;
            }
            Ok(())
        })
        .unwrap();
        return;
    }
    let dir = scratch("killed");
    let mut process = child(
        "a_save_killed_midway_leaves_the_previous_checkpoint_loadable",
        &dir,
    )
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    // Kill it while a rank file is being written after a first checkpoint was committed.
    let started = Instant::now();
    let writing = |dirs: &[burn_zero_checkpoint::CheckpointDir]| {
        dirs.iter().any(|d| d.complete)
            && dirs.iter().any(|d| {
                !d.complete
                    && std::fs::read_dir(&d.path).is_ok_and(|entries| {
                        entries.flatten().any(|e| {
                            let name = e.file_name().to_string_lossy().into_owned();
                            name.ends_with(".safetensors.tmp")
                        })
                    })
            })
    };
    loop {
        if writing(&list(&dir).unwrap()) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the child never got to write a second checkpoint"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    process.kill().unwrap(); // SIGKILL
    process.wait().unwrap();

    let dirs = list(&dir).unwrap();
    let partial = dirs
        .iter()
        .rev()
        .find(|d| !d.complete)
        .expect("a partial checkpoint");
    assert!(matches!(
        resolve(&partial.path),
        Err(CheckpointError::Incomplete(_))
    ));
    assert!(matches!(
        read_metadata(&partial.path),
        Err(CheckpointError::Incomplete(_))
    ));
    let last = latest(&dir).unwrap().expect("a complete checkpoint");
    assert!(last.step < partial.step);
    let loaded = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(Wide::<Train>::new(2048, ctx.device()), &ctx, &config(3))?;
        let (_, _, loaded) = load(&dir, model, adam(&zero))?;
        Ok(loaded.step)
    })
    .unwrap();
    assert_eq!(loaded, vec![last.step; WORLD]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_full_disk_is_a_clear_error_and_the_previous_checkpoint_stays_loadable() {
    if let Ok(dir) = std::env::var(CHILD) {
        let dir = Path::new(&dir);
        let values = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(Wide::<Train>::new(512, ctx.device()), &ctx, &config(3))?;
            let mut optim = adam(&zero);
            let model = step(model, &mut optim, 1);
            save(dir, 1, &model, &optim, &SaveOptions::default())?;
            Ok(param_values(&model))
        })
        .unwrap();
        // A file-size limit stands in for a full disk: writes past it fail with EFBIG once
        // SIGXFSZ (which would kill the process) is ignored.
        // SAFETY: setting a signal disposition and a resource limit of this process; no other
        // thread is inside a signal handler or depends on the limit.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: libc::RLIM_INFINITY,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
        let errors = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(Wide::<Train>::new(512, ctx.device()), &ctx, &config(3))?;
            let (model, mut optim, _) = load(dir, model, adam(&zero))?;
            let model = step(model, &mut optim, 2);
            let error = save(dir, 2, &model, &optim, &SaveOptions::default())
                .expect_err("the save must fail");
            Ok(error.to_string())
        })
        .unwrap();
        // SAFETY: as above, lifting the limit again.
        unsafe {
            let limit = libc::rlimit {
                rlim_cur: libc::RLIM_INFINITY,
                rlim_max: libc::RLIM_INFINITY,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
        for error in &errors {
            assert!(
                error.contains("no space left") || error.contains("failed on another rank"),
                "{error}"
            );
        }
        assert!(
            errors.iter().any(|e| e.contains("no space left")),
            "{errors:?}"
        );
        let dirs = list(dir).unwrap();
        assert_eq!(latest(dir).unwrap().map(|d| d.step), Some(1), "{dirs:?}");
        assert!(!dir.join("step-00000002").join(METADATA_FILE).exists());
        let reloaded = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(Wide::<Train>::new(512, ctx.device()), &ctx, &config(3))?;
            let (model, _, _) = load(dir, model, adam(&zero))?;
            Ok(param_values(&model))
        })
        .unwrap();
        assert!(params_bits_equal(&values[0], &reloaded[0]));
        println!("CHILD OK: {}", errors[0]);
        return;
    }
    let dir = scratch("full");
    let output = child(
        "a_full_disk_is_a_clear_error_and_the_previous_checkpoint_stays_loadable",
        &dir,
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("CHILD OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A small filesystem of its own, unmounted when dropped.
struct SmallDisk {
    path: std::path::PathBuf,
}

impl SmallDisk {
    /// A tmpfs of `bytes` mounted at a fresh folder; `None` where this process may not mount
    /// one (not root, or a container without the capability).
    fn mount(name: &str, bytes: u64) -> Option<Self> {
        let path = scratch(name);
        std::fs::create_dir_all(&path).ok()?;
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&path)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if !mounted {
            std::fs::remove_dir_all(&path).ok();
            return None;
        }
        Some(SmallDisk { path })
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
        std::fs::remove_dir_all(&self.path).ok();
    }
}

/// The bytes of every file under `dir`.
fn bytes_under(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| match entry.metadata() {
                    Ok(meta) if meta.is_dir() => bytes_under(&entry.path()),
                    Ok(meta) => meta.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn a_filesystem_that_fills_up_is_a_clear_error_and_the_previous_checkpoint_stays_loadable() {
    let test =
        "a_filesystem_that_fills_up_is_a_clear_error_and_the_previous_checkpoint_stays_loadable";
    // How much one checkpoint takes, saved where there is room.
    let roomy = scratch("roomy");
    let first = |dir: &Path| {
        launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
            let (model, zero) = shard(Wide::<Train>::new(512, ctx.device()), &ctx, &config(3))?;
            let mut optim = adam(&zero);
            let model = step(model, &mut optim, 1);
            save(dir, 1, &model, &optim, &SaveOptions::default())?;
            Ok(param_values(&model))
        })
    };
    first(&roomy).unwrap();
    let one = bytes_under(&roomy);
    std::fs::remove_dir_all(&roomy).ok();
    // Room for the first checkpoint and half of the second.
    let Some(disk) = SmallDisk::mount("small-disk", (one * 3 / 2).div_ceil(4096) * 4096) else {
        burn_zero_testing::skip::skip(test, "this process may not mount a tmpfs (needs root)");
        return;
    };
    let dir = disk.path.join("checkpoints");
    let values = first(&dir).unwrap();
    let errors = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(Wide::<Train>::new(512, ctx.device()), &ctx, &config(3))?;
        let (model, mut optim, _) = load(&dir, model, adam(&zero))?;
        let model = step(model, &mut optim, 2);
        let error = save(&dir, 2, &model, &optim, &SaveOptions::default())
            .expect_err("the second checkpoint cannot fit");
        Ok(error.to_string())
    })
    .unwrap();
    assert!(
        errors.iter().any(|e| e.contains("no space left")),
        "{errors:?}"
    );
    assert_eq!(latest(&dir).unwrap().map(|d| d.step), Some(1));
    assert!(!dir.join("step-00000002").join(METADATA_FILE).exists());
    let reloaded = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(Wide::<Train>::new(512, ctx.device()), &ctx, &config(3))?;
        let (model, _, _) = load(&dir, model, adam(&zero))?;
        Ok(param_values(&model))
    })
    .unwrap();
    assert!(params_bits_equal(&values[0], &reloaded[0]));
}

/// Saves one step of the tiny block at two ranks; returns the checkpoint directory.
fn saved_block(name: &str) -> std::path::PathBuf {
    let dir = scratch(name);
    launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(
            burn_zero_testing::base_model(ctx.device()),
            &ctx,
            &config(3),
        )?;
        let mut optim = adam(&zero);
        let model = common::train(model, &mut optim, ctx.rank(), WORLD, 0..1);
        Ok(save(&dir, 1, &model, &optim, &SaveOptions::default())?)
    })
    .unwrap();
    dir
}

/// Every rank's error loading the tiny block from `dir`, joined.
fn load_block(dir: &Path) -> String {
    launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(
            burn_zero_testing::base_model(ctx.device()),
            &ctx,
            &config(3),
        )?;
        let error = load(dir, model, adam(&zero))
            .err()
            .expect("the load must fail");
        Ok(error.to_string())
    })
    .unwrap()
    .join("\n")
}

#[test]
fn corrupted_and_truncated_files_are_refused_naming_file_and_tensor() {
    let dir = saved_block("corrupt");
    let step = latest(&dir).unwrap().unwrap().path;
    let meta = read_metadata(&step).unwrap();
    // Flip one byte inside rank 1's piece of the embedding's master copy.
    let name = "master/embed.weight";
    let piece = meta.tensors[name]
        .pieces
        .iter()
        .find(|p| p.rank == 1)
        .unwrap()
        .clone();
    let file = step.join(&meta.files[1].name);
    let mut bytes = std::fs::read(&file).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[8 + header + piece.data_offsets.0 + 5] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let message = load_block(&dir);
    assert!(
        message.contains(name)
            && message.contains(&meta.files[1].name)
            && message.contains("checksum"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).ok();

    // Truncated: rank 0's file loses its last bytes.
    let dir = saved_block("truncated");
    let step = latest(&dir).unwrap().unwrap().path;
    let meta = read_metadata(&step).unwrap();
    let file = step.join(&meta.files[0].name);
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let message = load_block(&dir);
    assert!(
        message.contains(&meta.files[0].name)
            && message.contains("tensor `")
            && message.contains("bytes"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[derive(Module, Debug)]
struct Saved<B: Backend> {
    fc1: Linear<B>,
    head: Linear<B>,
}

#[derive(Module, Debug)]
struct Changed<B: Backend> {
    fc1: Linear<B>,
    tail: Linear<B>,
}

#[test]
fn a_model_that_does_not_match_is_named() {
    let dir = scratch("mismatch");
    let message = launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let device = ctx.device();
        let saved = Saved::<Train> {
            fc1: LinearConfig::new(4, 6).init(device),
            head: LinearConfig::new(6, 2).init(device),
        };
        let (saved, zero) = shard(saved, &ctx, &config(3))?;
        save(&dir, 0, &saved, &adam(&zero), &SaveOptions::default())?;
        let changed = Changed::<Train> {
            fc1: LinearConfig::new(4, 7).init(device),
            tail: LinearConfig::new(6, 2).init(device),
        };
        let (changed, zero) = shard(changed, &ctx, &config(3))?;
        load(&dir, changed, adam(&zero))?;
        Ok(())
    })
    .expect_err("the load must fail")
    .to_string();
    for part in [
        "not in the checkpoint: `tail.bias`, `tail.weight`",
        "not in the model: `head.bias`, `head.weight`",
        "`fc1.weight` is [4, 7] in the model, [4, 6] saved",
    ] {
        assert!(message.contains(part), "{part} in {message}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn only_the_last_two_checkpoints_are_kept_by_default() {
    let dir = scratch("rotation");
    // A partial checkpoint left by a crash, older than the ones to come.
    std::fs::create_dir_all(dir.join("step-00000000")).unwrap();
    launch::<Flex, _, _, Failure>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(
            burn_zero_testing::base_model(ctx.device()),
            &ctx,
            &config(2),
        )?;
        let mut optim = adam(&zero);
        for n in 0..4 {
            model = common::train(model, &mut optim, ctx.rank(), WORLD, n..n + 1);
            save(&dir, n as u64 + 1, &model, &optim, &SaveOptions::default())?;
        }
        // Saving a step that is already committed is refused.
        match save(&dir, 4, &model, &optim, &SaveOptions::default()) {
            Err(CheckpointError::Exists(_) | CheckpointError::OtherRank { .. }) => Ok(()),
            other => Err(format!("{other:?}").into()),
        }
    })
    .unwrap();
    let steps: Vec<(u64, bool)> = list(&dir)
        .unwrap()
        .iter()
        .map(|d| (d.step, d.complete))
        .collect();
    assert_eq!(steps, vec![(3, true), (4, true)]);
    std::fs::remove_dir_all(&dir).ok();
}
