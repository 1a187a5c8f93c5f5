//! A rank alone (world size 1), the single-GPU case: its collectives are answered in place. A
//! training step calls the engine for no collective, never synchronises the device (a bucket
//! waits for it only while a sampler reads its memory: `chunk_launches_wgpu.rs`), and runs on
//! no thread of burn-zero's, at
//! every stage, chunk size and reduction mode, and trains the same bits as Burn's Adam on one
//! unsharded model.
//!
//! Alone in its test binary, so that the threads read from `/proc/self/task` are this test's.

mod common;

use std::sync::Arc;

use burn::backend::Flex;
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero_comm::{Counts, LaunchOptions, RankContext, launch_with};
use burn_zero_core::{ChunkSize, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::recording::{CallLog, RecordingComm};
use burn_zero_testing::{Block, base_model_on, micro_batch, param_values, params_bits_equal};

use common::{LR, Train};

const STEPS: usize = 3;

/// Names of this process's threads that burn-zero started (Linux).
fn burn_zero_threads() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .map(|name| name.trim().to_string())
        .filter(|name| name.starts_with("burn-zero"))
        .collect()
}

/// What the steps after the first did: the engine's calls, the rank's counts, and the
/// threads of burn-zero's alive at the end; with the final parameters.
struct Run {
    calls: Vec<String>,
    counts: Counts,
    threads: Vec<String>,
    params: Vec<Vec<f32>>,
    /// Buckets of the last backward reduced before it ended, of how many.
    overlapped: (usize, usize),
}

fn train_alone(base: &Block<Train<Flex>>, config: &ZeroConfig) -> Run {
    let device = Default::default();
    let log: CallLog = Arc::default();
    let options = LaunchOptions::default();
    let mut runs = launch_with::<Flex, _, _, ZeroError>(1, &[device], &options, |ctx| {
        let recorder = RecordingComm::new(ctx.engine().clone(), log.clone());
        let ctx = RankContext::new(*ctx.device(), Arc::new(recorder));
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let (mut calls, mut counted) = (0, Counts::default());
        for step in 0..STEPS {
            if step == 1 {
                // The first step records the order buckets complete in; the rest repeat it.
                (calls, counted) = (log.lock().unwrap().len(), zero.counts());
            }
            let (tokens, targets) = micro_batch::<Train<Flex>>(step, ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        let calls = log.lock().unwrap()[calls..]
            .iter()
            .map(|(call, _)| call.clone())
            .collect();
        let last = zero.last_reduction();
        Ok(Run {
            overlapped: (last.overlapped, last.collectives),
            calls,
            counts: zero.counts() - counted,
            threads: burn_zero_threads(),
            params: param_values(&model),
        })
    })
    .unwrap();
    runs.remove(0)
}

#[test]
fn a_rank_alone_trains_without_engine_calls_gather_synchronisations_or_threads() {
    let device = Default::default();
    let base = base_model_on::<Flex>(&device);
    let want = common::reference::<Flex>(&base, 1, STEPS, &device);
    let chunk_sizes = [
        ChunkSize::PerParameter,
        ChunkSize::default_search(),
        ChunkSize::Elements(256),
    ];
    let mut configs = Vec::new();
    for chunk_size in chunk_sizes {
        for config in common::configs() {
            for overlap in [true, false] {
                configs.push(
                    config
                        .clone()
                        .with_chunk_size(chunk_size)
                        .with_overlap_comm(overlap),
                );
            }
        }
    }
    configs.push(
        ZeroConfig::new()
            .with_stage(3)
            .with_persist_below_numel(0)
            .with_prefetch(2),
    );
    for config in configs {
        let what = format!(
            "stage {}, {:?}, overlap {}, prefetch {}",
            config.stage, config.chunk_size, config.overlap_comm, config.prefetch
        );
        let run = train_alone(&base, &config);
        assert!(params_bits_equal(&run.params, &want), "{what}: parameters");
        assert!(
            run.calls.is_empty(),
            "{what}: the engine saw {:?}",
            run.calls
        );
        let counts = run.counts;
        assert!(counts.collectives() > 0, "{what}: {counts:?}");
        assert_eq!(counts.in_place, counts.collectives(), "{what}: {counts:?}");
        // No synchronisation: neither for a bucket (no sampler reads this device's memory)
        // nor for a gather.
        assert_eq!(counts.syncs, 0, "{what}: {counts:?}");
        assert!(run.threads.is_empty(), "{what}: threads {:?}", run.threads);
        // With overlap, buckets are reduced by the hooks that complete them, during backward.
        let (overlapped, buckets) = run.overlapped;
        if config.overlaps_reduction() {
            assert!(
                overlapped > 0,
                "{what}: {overlapped} of {buckets} during backward"
            );
        } else {
            assert_eq!(overlapped, 0, "{what}");
        }
    }
}
