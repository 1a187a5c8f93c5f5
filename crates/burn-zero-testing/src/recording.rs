//! [`RecordingComm`]: a communicator that logs what reaches the engine, and from which
//! thread, for tests of the order in which collectives are issued.

use std::sync::{Arc, Mutex};
use std::thread::{self, ThreadId};
use std::time::Duration;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_comm::{CommError, Communicator, ReduceOp};

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
}

impl<B: Backend> RecordingComm<B> {
    /// Records the calls made on `inner` into `log`.
    pub fn new(inner: Arc<dyn Communicator<B>>, log: CallLog) -> Self {
        Self {
            inner,
            log,
            reduction_delay: None,
            orders_on_device: false,
        }
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
        Ok(Arc::new(Self {
            inner: self.inner.duplicate()?,
            log: self.log.clone(),
            reduction_delay: self.reduction_delay,
            orders_on_device: self.orders_on_device,
        }))
    }
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        self.note("split".into(), false);
        Ok(Arc::new(Self {
            inner: self.inner.split(color)?,
            log: self.log.clone(),
            reduction_delay: self.reduction_delay,
            orders_on_device: self.orders_on_device,
        }))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn orders_inputs_on_device(&self) -> bool {
        self.orders_on_device
    }
}
