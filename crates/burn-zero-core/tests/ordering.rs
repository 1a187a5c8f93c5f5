//! Overlapped gradient reduction at stage 3 keeps one order of collectives per rank, the same
//! on every rank, issued from one thread, even when one rank's reductions are slow: the
//! gathers of backward and the bucket reductions interleave by program order, not by timing.

use std::sync::{Arc, Mutex};
use std::thread::{self, ThreadId};
use std::time::Duration;

use burn::backend::Flex;
use burn::tensor::Tensor;
use burn_zero_comm::{CommError, Communicator, RankContext, ReduceOp, launch};
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_testing::{base_model, loss_and_grads, reference};

type B = Flex;
type Log = Arc<Mutex<Vec<(String, ThreadId)>>>;

/// Records what reaches the engine and from which thread; on rank 0, reductions first wait a
/// little (a slow packer or a slow link), which without ordering lets the training thread's
/// gathers overtake them on that rank only.
struct Recorder {
    inner: Arc<dyn Communicator<B>>,
    log: Log,
    slow_reductions: bool,
}

impl Recorder {
    fn note(&self, what: String, reduction: bool) {
        if reduction && self.slow_reductions {
            thread::sleep(Duration::from_millis(3));
        }
        self.log
            .lock()
            .unwrap()
            .push((what, thread::current().id()));
    }
}

impl Communicator<B> for Recorder {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        self.note(format!("all_gather {}", block.dims()[0]), false);
        self.inner.all_gather(block)
    }
    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.note(format!("reduce_scatter {}", input.dims()[0]), true);
        self.inner.reduce_scatter(input, op)
    }
    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        self.note(format!("all_reduce {}", input.dims()[0]), true);
        self.inner.all_reduce(input, op)
    }
    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.note(format!("broadcast {}", buffer.dims()[0]), false);
        self.inner.broadcast(buffer, root)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.note("barrier".into(), false);
        self.inner.barrier()
    }
    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(Arc::new(Recorder {
            inner: self.inner.duplicate()?,
            log: self.log.clone(),
            slow_reductions: self.slow_reductions,
        }))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

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
        let log: Log = Arc::default();
        let recorder = Arc::new(Recorder {
            inner: ctx.comm().clone(),
            log: log.clone(),
            slow_reductions: ctx.rank() == 0,
        });
        let ctx = RankContext::new(*ctx.device(), recorder);
        let (model, _) = shard(base.clone(), &ctx, &config)?;
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
