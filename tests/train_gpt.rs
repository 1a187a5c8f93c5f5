//! The `train_gpt` example's training run (`burn_zero_gpt::train`): a short run learns, and
//! ZeRO-3 on 2 ranks ends with exactly the parameters of 1 rank that accumulates the same two
//! micro-batches.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn_zero::{Capacity, Placement};
use burn_zero_gpt::train::{RankOutcome, RunConfig, train};

/// The tiny model on short sequences: a few seconds per run.
fn short(steps: usize) -> RunConfig {
    RunConfig {
        steps,
        batch_size: 8,
        seq_len: 32,
        sample_len: 0,
        ..RunConfig::new()
    }
}

/// Four short steps that keep their parameters and save a checkpoint under `dir` every two
/// (resuming from the latest there when `resume`).
fn checkpointed(dir: &Path, resume: bool) -> RunConfig {
    RunConfig {
        keep_params: true,
        checkpoint_dir: Some(dir.to_path_buf()),
        save_every: 2,
        resume,
        ..short(4)
    }
}

/// An empty directory of this process for `name`'s checkpoints.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-zero-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

#[test]
fn short_run_lowers_the_loss() {
    let config = short(25);
    let ranks = train::<Flex>(&config, Default::default(), |_| {}).unwrap();
    let losses = &ranks[0].losses;
    let first = losses[0];
    let last = losses[losses.len() - 3..].iter().sum::<f32>() / 3.0;
    // The first loss is about ln(vocabulary) (the tied head starts near zero).
    let uniform = (burn_zero_gpt::Corpus::new(burn_zero_gpt::TEXT).vocab() as f32).ln();
    assert!(
        (first - uniform).abs() < 0.1,
        "first loss {first}, ln(vocab) {uniform}"
    );
    assert!(last < first - 0.5, "loss {first} -> {last}: {losses:?}");
    // Every rank reports the same all-reduced loss.
    assert!(ranks.iter().all(|r| &r.losses == losses));
}

#[test]
fn two_rank_zero3_equals_one_rank_accumulating_both_micro_batches_bitwise() {
    let run = |world_size, accumulation| {
        let config = RunConfig {
            world_size,
            accumulation,
            keep_params: true,
            ..short(3)
        };
        train::<Flex>(&config, Default::default(), |_| {}).unwrap()
    };
    // Same global batch of 8: two ranks with 4 rows each, or one rank with two micro-batches
    // of 4 rows (micro-batch m on rank r is number m · world_size + r of the global batch).
    let sharded = run(2, 1);
    let single = run(1, 2);
    let want = single[0].params.as_ref().unwrap();
    for rank in &sharded {
        let got = rank.params.as_ref().unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let same =
                g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
            let diff = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(
                same,
                "rank {}, parameter #{i}: max |difference| {diff:e}",
                rank.rank
            );
        }
        // The reported losses are the same mean of the same two micro-batch losses.
        assert_eq!(rank.losses, single[0].losses);
    }
}

#[test]
fn a_diverging_run_names_the_non_finite_loss() {
    // Adam moves every weight by about the learning rate: at 1e30 the logits overflow at once.
    let config = RunConfig {
        lr: 1e30,
        ..short(4)
    };
    let error = match train::<Flex>(&config, Default::default(), |_| {}) {
        Ok(_) => panic!("a run at lr 1e30 finished"),
        Err(error) => error,
    };
    assert!(
        error.contains("the loss became") && error.contains("training diverged"),
        "{error}"
    );
}

#[test]
fn a_learning_rate_that_is_not_a_positive_number_is_refused_before_training() {
    for lr in [f64::NAN, f64::INFINITY, 0.0, -1e-3] {
        let config = RunConfig { lr, ..short(1) };
        let error = config.validate().unwrap_err();
        assert!(error.contains("--lr"), "{lr}: {error}");
    }
}

#[test]
fn a_run_saved_at_two_ranks_resumes_at_one_rank_bitwise() {
    let dir = scratch("train-gpt");
    let run = |world_size, accumulation, resume| {
        let config = RunConfig {
            world_size,
            accumulation,
            ..checkpointed(&dir, resume)
        };
        train::<Flex>(&config, Default::default(), |_| {}).unwrap()
    };
    let straight = train::<Flex>(
        &RunConfig {
            keep_params: true,
            ..short(4)
        },
        Default::default(),
        |_| {},
    )
    .unwrap();
    // Two ranks save after steps 2 and 4; the checkpoint of step 4 is removed to resume from 2.
    run(2, 1, false);
    std::fs::remove_dir_all(dir.join("step-00000004")).unwrap();
    // One rank accumulating both micro-batches continues from step 2.
    let resumed = run(1, 2, true);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(resumed[0].resumed_from, Some(2));
    assert_eq!(resumed[0].losses, straight[0].losses[2..]);
    assert_eq!(resumed[0].params, straight[0].params);
}

#[test]
fn adapter_fine_tuning_trains_only_the_adapters_bitwise_at_any_world_size_and_on_resume() {
    let dir = scratch("adapters");
    // Every parameter sharded: the adapters are reduce-scattered too.
    let adapters = |steps| RunConfig {
        adapter_rank: 4,
        persist_below: 0,
        keep_params: true,
        ..short(steps)
    };
    let run = |config: RunConfig| train::<Flex>(&config, Default::default(), |_| {}).unwrap();
    let initial = run(adapters(0)).remove(0).params.unwrap();
    let two = run(RunConfig {
        checkpoint_dir: Some(dir.clone()),
        save_every: 2,
        ..adapters(4)
    });
    let one = run(RunConfig {
        world_size: 1,
        accumulation: 2,
        ..adapters(4)
    });
    std::fs::remove_dir_all(dir.join("step-00000004")).unwrap();
    let resumed = run(RunConfig {
        world_size: 1,
        accumulation: 2,
        checkpoint_dir: Some(dir.clone()),
        resume: true,
        ..adapters(4)
    });
    std::fs::remove_dir_all(&dir).ok();

    // The tiny model: width 64, 2 blocks, so 2 adapters of two 64 × 4 matrices, visited last.
    let trainable = 2 * 2 * 64 * 4;
    let final_params = two[0].params.as_ref().unwrap();
    let adapter_params = final_params.len() - 4;
    for rank in &two {
        assert_eq!(rank.trainable, trainable);
        assert_eq!(
            rank.params, one[0].params,
            "rank {}: 2 ranks = 1 rank",
            rank.rank
        );
        // Each step reduce-scatters the adapters' gradients (2 rows of 128 per matrix), f32.
        assert_eq!(rank.reduced_bytes, 4 * trainable);
        let memory = rank.memory.as_ref().unwrap();
        assert_eq!(memory.master_weights.current as usize, 4 * trainable / 2);
        assert_eq!(memory.optimizer_state.current as usize, 8 * trainable / 2);
    }
    assert_eq!(two[0].losses, one[0].losses);
    assert_eq!(resumed[0].resumed_from, Some(2));
    assert_eq!(
        resumed[0].params, two[0].params,
        "resumed at 1 rank = 2 ranks straight"
    );
    for (i, (after, before)) in final_params.iter().zip(&initial).enumerate() {
        let unchanged = after
            .iter()
            .zip(before)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert_eq!(unchanged, i < adapter_params, "parameter #{i}");
    }
}

#[test]
fn hybrid_sharding_trains_and_each_rank_holds_its_shard_groups_share() {
    // 4 ranks: sharded over all 4, and in 2 shard groups of 2.
    let run = |shard_group_size| {
        let config = RunConfig {
            world_size: 4,
            shard_group_size,
            persist_below: 0,
            ..short(12)
        };
        train::<Flex>(&config, Default::default(), |_| {}).unwrap()
    };
    let shards = |ranks: &[RankOutcome]| {
        ranks[0]
            .memory
            .as_ref()
            .expect("a memory report")
            .parameter_shards
            .current
    };
    let flat = run(0);
    let hybrid = run(2);
    let (first, last) = (hybrid[0].losses[0], *hybrid[0].losses.last().unwrap());
    assert!(last < first - 0.3, "hybrid loss {first} -> {last}");
    // Blocks of 1/2 instead of 1/4 of every parameter (padding aside).
    let ratio = shards(&hybrid) as f64 / shards(&flat) as f64;
    assert!(
        (ratio - 2.0).abs() < 0.01,
        "parameter shards hybrid / flat = {ratio}"
    );
    let refused = RunConfig {
        world_size: 4,
        shard_group_size: 3,
        ..short(1)
    };
    let error = refused.validate().unwrap_err();
    assert!(error.contains("--shard-group-size 3"), "{error}");
}

#[test]
fn prefetch_trains_bitwise_like_gathering_on_demand() {
    // Stage 3 on 2 ranks, every parameter sharded: the losses of every step are bit for bit
    // the same, and every step after the first is served by prefetches.
    let run = |prefetch| {
        let config = RunConfig {
            world_size: 2,
            stage: 3,
            persist_below: 0,
            prefetch,
            ..short(6)
        };
        train::<Flex>(&config, Default::default(), |_| {}).unwrap()
    };
    let on_demand = run(0);
    let ahead = run(2);
    let bits = |ranks: &[RankOutcome]| -> Vec<u32> {
        ranks[0].losses.iter().map(|l| l.to_bits()).collect()
    };
    assert_eq!(bits(&ahead), bits(&on_demand));
    assert!(ahead.iter().all(|r| r.losses == ahead[0].losses));
    let (plain, stats) = (on_demand[0].gathers, ahead[0].gathers);
    assert_eq!(plain.prefetched, 0);
    assert_eq!(stats.gathers, plain.gathers, "{stats:?}");
    // The first step records the order; each later one gathers its first parameter on
    // demand and every other from a prefetch.
    let per_step = plain.gathers / 6;
    assert_eq!(stats.prefetched, 5 * (per_step - 1), "{stats:?}");
}

#[test]
fn parameters_on_the_host_train_the_same_bits_and_bad_fractions_are_refused() {
    let run = |offload_param_frac| {
        let config = RunConfig {
            world_size: 2,
            placement: Placement::fractions(offload_param_frac, 0.0),
            keep_params: true,
            ..short(3)
        };
        train::<Flex>(&config, Default::default(), |_| {}).unwrap()
    };
    let on_device = run(0.0);
    let on_host = run(1.0);
    for (host, device) in on_host.iter().zip(&on_device) {
        assert_eq!(host.params, device.params, "rank {}", host.rank);
        assert_eq!(host.losses, device.losses);
        let memory = host.memory.as_ref().unwrap();
        assert!(memory.host_parameter_shards.current > 0);
        assert_eq!(
            memory.host_parameter_shards.current,
            device.memory.as_ref().unwrap().parameter_shards.current,
            "rank {}: the shards the device held are on the host",
            host.rank
        );
    }
    for (frac, stage) in [(1.5, 3), (-0.5, 3), (f64::NAN, 3), (0.5, 2)] {
        let config = RunConfig {
            placement: Placement::fractions(frac, 0.0),
            stage,
            ..short(1)
        };
        let error = config.validate().unwrap_err();
        assert!(error.contains("--offload-param-frac"), "{frac}: {error}");
    }
    for (mib, stage, frac) in [
        (-1.0, 3, 0.0),
        (f64::NAN, 3, 0.0),
        (64.0, 2, 0.0),
        (64.0, 3, 0.5),
    ] {
        let config = RunConfig {
            placement: Placement::auto(Capacity::MiB(mib)).with_offload_param_frac(frac),
            stage,
            ..short(1)
        };
        let error = config.validate().unwrap_err();
        assert!(error.contains("--auto-placement-mib"), "{mib}: {error}");
    }
    // A margin is shared out of the auto placement's room: without it, it is refused.
    let margin = RunConfig {
        placement: Placement::fractions(0.0, 1.0).with_gpu_margin_mem_ratio(0.5),
        ..short(1)
    };
    let error = margin.validate().unwrap_err();
    assert!(
        error.contains("--gpu-margin-mem-ratio") && error.contains("--auto-placement-mib"),
        "{error}"
    );
}

/// `--offload-optim-frac`: half the chunks' optimizer state stepped on the host (Flex) trains
/// the same bits as all of it on the device; its checkpoint resumes in a run with all of it on
/// the device at another world size bitwise, and the other way round; a fraction outside 0..1
/// is refused before training.
#[test]
fn optimizer_state_on_the_host_trains_and_resumes_the_same_bits() {
    let (device_dir, split_dir) = (scratch("gpt-device-optim"), scratch("gpt-split-optim"));
    let run = |dir: &Path, world_size, accumulation, offload_optim_frac, resume| {
        let config = RunConfig {
            world_size,
            accumulation,
            placement: Placement::fractions(0.0, offload_optim_frac),
            ..checkpointed(dir, resume)
        };
        train::<Flex>(&config, Default::default(), |_| {}).unwrap()
    };
    let on_device = run(&device_dir, 2, 1, 0.0, false);
    let split = run(&split_dir, 2, 1, 0.5, false);
    for (split, device) in split.iter().zip(&on_device) {
        assert_eq!(split.params, device.params, "rank {}", split.rank);
        assert!(split.optimizer_host_chunks > 0);
        let memory = split.memory.as_ref().unwrap();
        assert!(memory.host_master_weights.current > 0 && memory.master_weights.current > 0);
    }
    // Each run's checkpoint of step 2 resumes under the other optimizer, on one rank.
    for dir in [&device_dir, &split_dir] {
        std::fs::remove_dir_all(dir.join("step-00000004")).unwrap();
    }
    let from_split = run(&split_dir, 1, 2, 0.0, true);
    let from_device = run(&device_dir, 1, 2, 0.75, true);
    for resumed in [&from_split[0], &from_device[0]] {
        assert_eq!(resumed.resumed_from, Some(2));
        assert_eq!(resumed.params, on_device[0].params);
    }
    assert!(from_device[0].optimizer_host_chunks > 0);
    std::fs::remove_dir_all(&device_dir).ok();
    std::fs::remove_dir_all(&split_dir).ok();

    for frac in [1.5, -0.1, f64::NAN] {
        let config = RunConfig {
            placement: Placement::fractions(0.0, frac),
            ..short(1)
        };
        let error = config.validate().unwrap_err();
        assert!(error.contains("--offload-optim-frac"), "{frac}: {error}");
    }
}

#[test]
fn a_launched_run_without_an_engine_between_processes_is_refused_by_name() {
    // Two torchrun-style ranks of one job, started as zero-run would but without its name
    // server: each must refuse at once, saying what to do, rather than train the whole job
    // alone and write a checkpoint beside the other.
    let program = burn_zero_testing::processes::built(
        "TRAIN_GPT",
        "examples/train_gpt",
        "cargo build --example train_gpt",
    );
    let dir = scratch("refused");
    let port = burn_zero_testing::processes::free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::process::Command::new(&program)
                .args(["--steps", "2", "--batch-size", "8", "--seq-len", "32"])
                .arg("--checkpoint-dir")
                .arg(&dir)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env_remove("OMPI_MCA_pmix_server_uri")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in ranks {
        let output = child.wait_with_output().unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(output.status.code(), Some(1), "{said}");
        assert!(!said.contains("GPT 'tiny'"), "it trained:\n{said}");
        let told = if cfg!(feature = "mpi") {
            said.contains("mpirun -np 2") && said.contains("zero-run")
        } else {
            said.contains("--features mpi") && said.contains("--world-size 2")
        };
        assert!(told, "{said}");
    }
    assert!(!dir.exists(), "a checkpoint was written");
}
