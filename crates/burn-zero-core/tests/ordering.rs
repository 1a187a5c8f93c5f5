//! Overlapped gradient reduction at stage 3 keeps one order of collectives per rank, the same
//! on every rank, issued from one thread, even when one rank's reductions are slow: the
//! gathers of backward and the bucket reductions interleave by program order, not by timing.

use std::sync::Arc;
use std::thread::{self, ThreadId};
use std::time::Duration;

use burn::backend::Flex;
use burn_zero_comm::{RankContext, launch};
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_testing::recording::{CallLog, RecordingComm};
use burn_zero_testing::{base_model, loss_and_grads, reference};

type B = Flex;
#[test]
fn stage_three_overlap_issues_one_order_on_every_rank_from_one_thread() {
    let base = base_model(&Default::default());
    let world_size = 2;
    let (_, expected) = reference(&base, world_size);
    // Small buckets: many reductions, interleaved with backward's gathers.
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(0)
        .with_max_live_gathered_bytes(0)
        .with_bucket_size_mb(0.0002)
        .with_overlap_comm(true);
    let seen = launch::<B, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
        let log = CallLog::default();
        let mut recorder = RecordingComm::new(ctx.comm().clone(), log.clone());
        // On rank 0 reductions wait a little (a slow packer or link), which without ordering
        // lets the training thread's gathers overtake them on that rank only.
        if ctx.rank() == 0 {
            recorder = recorder.with_reduction_delay(Duration::from_millis(3));
        }
        let recorder = Arc::new(recorder);
        let ctx = RankContext::new(*ctx.device(), recorder);
        let (model, _zero) = shard(base.clone(), &ctx, &config)?;
        let (_, grads) = loss_and_grads(&model, ctx.rank(), ctx.device());
        drop(model);
        let log = log.lock().unwrap().clone();
        Ok((grads, log, thread::current().id()))
    })
    .unwrap();

    let calls = |log: &[(String, ThreadId)]| log.iter().map(|(c, _)| c.clone()).collect::<Vec<_>>();
    let first = calls(&seen[0].1);
    assert!(
        first.iter().any(|c| c.starts_with("reduce_scatter"))
            && first.iter().filter(|c| c.starts_with("all_gather")).count() > 10,
        "the run must interleave gathers and reductions: {first:?}"
    );
    for (rank, (grads, log, training)) in seen.iter().enumerate() {
        assert_eq!(
            calls(log),
            first,
            "rank {rank}'s order differs from rank 0's"
        );
        let issuer = log[0].1;
        assert!(
            log.iter().all(|(_, thread)| *thread == issuer),
            "rank {rank}: collectives came from more than one thread"
        );
        assert_ne!(issuer, *training, "rank {rank}");
        for (got, want) in grads.iter().zip(&expected) {
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "rank {rank}: gradients differ from the reference");
        }
    }
}
