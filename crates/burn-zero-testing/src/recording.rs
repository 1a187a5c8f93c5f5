//! [`RecordingComm`]: a communicator that logs what reaches the engine, and from which
//! thread, for tests of the order in which collectives are issued.

use std::sync::{Arc, Mutex};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_comm::{CommError, Communicator, Completion, DataOp, Issued, RankCounters, ReduceOp};

/// Every call that reached the engine, in order: `"<op> <elements>"` and the calling thread.
pub type CallLog = Arc<Mutex<Vec<(String, ThreadId)>>>;

/// Logs each call into a [`CallLog`], then hands it to the engine it wraps. Duplicates log into
/// the same log.
pub struct RecordingComm<B: Backend> {
    inner: Arc<dyn Communicator<B>>,
    log: CallLog,
    /// Slept before each reduction (reduce-scatter, all-reduce): a slow packer or link.
    reduction_delay: Option<Duration>,
    /// Says it orders its inputs after their writers on the device, as NCCL does.
    orders_on_device: bool,
    /// How long after its issue a reduction completes, as one running on a device would.
    completes_after: Option<Duration>,
    /// The rank's counts, where a wait for a reduction that has not completed is counted.
    counters: Arc<Mutex<Option<Arc<RankCounters>>>>,
}

impl<B: Backend> RecordingComm<B> {
    /// Records the calls made on `inner` into `log`.
    pub fn new(inner: Arc<dyn Communicator<B>>, log: CallLog) -> Self {
        Self {
            inner,
            log,
            reduction_delay: None,
            orders_on_device: false,
            completes_after: None,
            counters: Arc::default(),
        }
    }

    /// The same recording, into the same log and with the same settings, around `inner` (a
    /// communicator duplicated or split from this one's).
    fn around(&self, inner: Arc<dyn Communicator<B>>) -> Arc<dyn Communicator<B>> {
        Arc::new(Self {
            inner,
            log: self.log.clone(),
            reduction_delay: self.reduction_delay,
            orders_on_device: self.orders_on_device,
            completes_after: self.completes_after,
            counters: self.counters.clone(),
        })
    }

    /// Makes every reduction (reduce-scatter, all-reduce) issued with
    /// [`Communicator::issue`] complete `after` its issue, as a collective on a device does
    /// while the host goes on: asking before then says it is not done, and waiting before then
    /// sleeps the rest and counts one wait of the engine (`Counts::engine_waits`).
    pub fn completing_after(mut self, after: Duration) -> Self {
        self.completes_after = Some(after);
        self
    }

    /// Says that the engine orders its reads of a collective's input after the input's writers
    /// on the device ([`Communicator::orders_inputs_on_device`]), as `NcclGroup` does with
    /// its default options: the layers above then hand it tensors without synchronising, and a
    /// test counts what is left. On a CPU backend the engine's own reads need no ordering.
    pub fn ordering_on_device(mut self) -> Self {
        self.orders_on_device = true;
        self
    }

    /// Makes every reduction wait `delay` before it reaches the engine.
    pub fn with_reduction_delay(mut self, delay: Duration) -> Self {
        self.reduction_delay = Some(delay);
        self
    }

    fn note(&self, what: String, reduction: bool) {
        if let (true, Some(delay)) = (reduction, self.reduction_delay) {
            thread::sleep(delay);
        }
        self.log
            .lock()
            .unwrap()
            .push((what, thread::current().id()));
    }
}

impl<B: Backend> Communicator<B> for RecordingComm<B> {
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
        Ok(self.around(self.inner.duplicate()?))
    }
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.note("split".into(), false);
        Ok(self.around(self.inner.split(color)?))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn orders_inputs_on_device(&self) -> bool {
        self.orders_on_device
    }
    fn issue(&self, op: DataOp, input: Tensor<B, 1>) -> Result<Issued<B>, CommError> {
        let result = op.run(self, input)?;
        match (op, self.completes_after) {
            (DataOp::ReduceScatter(_) | DataOp::AllReduce(_), Some(after)) => {
                let completion = Later {
                    at: Instant::now() + after,
                    counters: self.counters.lock().unwrap().clone(),
                };
                Ok(Issued::pending(Box::new(completion), move || result))
            }
            _ => Ok(Issued::ready(result)),
        }
    }
    fn count_into(&self, counters: &Arc<RankCounters>) {
        *self.counters.lock().unwrap() = Some(counters.clone());
        self.inner.count_into(counters);
    }
}

/// A reduction of [`RecordingComm::completing_after`], complete from `at` on.
struct Later {
    at: Instant,
    counters: Option<Arc<RankCounters>>,
}

impl Completion for Later {
    fn wait(self: Box<Self>) -> Result<(), CommError> {
        let left = self.at.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            if let Some(counters) = &self.counters {
                counters.engine_wait();
            }
            thread::sleep(left);
        }
        Ok(())
    }

    fn is_done(&self) -> Option<bool> {
        Some(Instant::now() >= self.at)
    }
}
