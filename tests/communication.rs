//! Communication per training step and rank, counted where the collectives reach the engine,
//! against the volume the ZeRO analysis predicts from the model's parameter list, to the
//! element, at 2 and 4 ranks and every stage.
//!
//! Counted as the paper counts: an all-gather moves its output (N blocks), a reduce-scatter
//! its input, an all-reduce twice its buffer (a reduce-scatter and an all-gather), a broadcast
//! its buffer. Every parameter is sharded (`persist_below_numel(0)`), so with Ψ' the padded
//! parameter count (each parameter rounded up to a multiple of N) the prediction, written
//! before any run, is:
//!
//! - stage 0: every gradient all-reduced, 2Ψ;
//! - stages 1 and 2: the gradients reduce-scattered (Ψ') and the updated shards all-gathered
//!   into the replicated parameters (Ψ');
//! - stage 3 without the gather cache: forward gathers every parameter once, and the token
//!   table, tied to the output head, once more (Ψ' + T'); backward gathers again every
//!   parameter whose value its gradient needs (not the biases, not the layer norms' betas:
//!   Ψ' − B') and the token table twice, for the head's matmul and the embedding's backward
//!   (+ T'); the gradients are reduce-scattered (Ψ');
//! - stage 3 with the gather cache: each parameter gathered once in forward and found again in
//!   backward (Ψ'), the gradients reduce-scattered (Ψ').
//!
//! The step counted is the second: the first records the order backward produces gradients
//! in, and the buckets are rebuilt from it; the volume must not depend on that.

use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero::comm::{Communicator, LocalGroup, RankContext};
use burn_zero::{PerTensor, ZeroConfig, ZeroOptimizer, shard};
use burn_zero_gpt::train::Train;
use burn_zero_gpt::{Corpus, Gpt, Preset, TEXT};
use burn_zero_testing::recording::{CallLog, RecordingComm};

/// A configuration counted.
#[derive(Debug, Clone, Copy)]
struct Setup {
    stage: u8,
    gather_cache: bool,
}

const SETUPS: [Setup; 5] = [
    Setup {
        stage: 0,
        gather_cache: false,
    },
    Setup {
        stage: 1,
        gather_cache: false,
    },
    Setup {
        stage: 2,
        gather_cache: false,
    },
    Setup {
        stage: 3,
        gather_cache: false,
    },
    Setup {
        stage: 3,
        gather_cache: true,
    },
];

impl Setup {
    fn config(self) -> ZeroConfig {
        let config = ZeroConfig::new()
            .with_stage(self.stage)
            .with_bucket_size_mb(0.25)
            .with_persist_below_numel(0);
        if self.gather_cache {
            config
        } else {
            config.with_max_live_gathered_bytes(0)
        }
    }

    /// The predicted elements per step and rank (see the module documentation), from every
    /// parameter's path and element count.
    fn predicted(self, params: &[(String, usize)], world_size: usize) -> usize {
        let padded = |n: usize| n.div_ceil(world_size) * world_size;
        let sum = |keep: &dyn Fn(&str) -> bool| -> usize {
            params
                .iter()
                .filter(|(path, _)| keep(path))
                .map(|(_, n)| padded(*n))
                .sum()
        };
        let psi: usize = params.iter().map(|(_, n)| n).sum();
        let psi_padded = sum(&|_| true);
        let tied = sum(&|path| path.ends_with("tokens.weight"));
        let no_regather = sum(&|path| path.ends_with("bias") || path.ends_with("beta"));
        match (self.stage, self.gather_cache) {
            (0, _) => 2 * psi,
            (1 | 2, _) => 2 * psi_padded,
            (_, false) => (psi_padded + tied) + (psi_padded - no_regather + tied) + psi_padded,
            (_, true) => 2 * psi_padded,
        }
    }
}

/// Elements the logged calls moved, counted as the module documentation says.
fn elements(log: &[(String, std::thread::ThreadId)], world_size: usize) -> usize {
    log.iter()
        .map(|(call, _)| {
            let mut words = call.split_whitespace();
            let op = words.next().unwrap_or_default();
            let n: usize = words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
            match op {
                "all_gather" => n * world_size,
                "all_reduce" => 2 * n,
                "reduce_scatter" | "broadcast" => n,
                _ => 0,
            }
        })
        .sum()
}

/// Two training steps of GPT `small` on `world_size` ranks; every rank's calls in the second
/// step, and the model's parameters (path, elements).
fn count(setup: Setup, world_size: usize) -> (Vec<usize>, Vec<(String, usize)>) {
    let corpus = Corpus::new(TEXT);
    let device = Default::default();
    let (seq_len, micro) = (32, 2);
    let base: Gpt<Train<Flex>> = Preset::Small.config(corpus.vocab(), seq_len).init(&device);
    let groups = LocalGroup::<Flex>::new(world_size).expect("a group");
    let results: Vec<(usize, Vec<(String, usize)>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                let base = base.clone();
                let corpus = &corpus;
                scope.spawn(move || {
                    let log: CallLog = Arc::new(Mutex::new(Vec::new()));
                    let engine: Arc<dyn Communicator<Flex>> = Arc::new(group);
                    let comm = Arc::new(RecordingComm::new(engine, log.clone()));
                    let ctx = RankContext::new(Default::default(), comm);
                    let (mut model, zero) = shard(base, &ctx, &setup.config()).expect("sharded");
                    let mut optimizer =
                        ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
                    let rank = ctx.rank();
                    for step in 0..2 {
                        log.lock().unwrap().clear();
                        let rows = rank * micro..(rank + 1) * micro;
                        let (inputs, targets) =
                            corpus.batch::<Train<Flex>>(7, step, rows, seq_len, ctx.device());
                        let loss = model.loss(inputs, targets);
                        let grads = GradientsParams::from_grads(loss.backward(), &model);
                        model = optimizer.step(1e-3, model, grads);
                    }
                    let moved = elements(&log.lock().unwrap(), world_size);
                    let params = zero
                        .params()
                        .into_iter()
                        .map(|info| (info.path, info.shape.num_elements()))
                        .collect();
                    (moved, params)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank"))
            .collect()
    });
    let params = results[0].1.clone();
    (
        results.into_iter().map(|(moved, _)| moved).collect(),
        params,
    )
}

#[test]
fn every_rank_moves_what_the_analysis_predicts_at_2_and_4_ranks() {
    for world_size in [2, 4] {
        for setup in SETUPS {
            let (moved, params) = count(setup, world_size);
            let predicted = setup.predicted(&params, world_size);
            for (rank, moved) in moved.iter().enumerate() {
                assert_eq!(
                    *moved, predicted,
                    "{setup:?}, {world_size} ranks, rank {rank}: moved {moved} elements, \
                     predicted {predicted}"
                );
            }
        }
    }
}
