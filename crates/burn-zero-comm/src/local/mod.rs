//! `LocalGroup`: the in-process engine. One thread per rank, data moved and reduced with Burn
//! tensor ops, so it runs on every backend (CPU, wgpu, CUDA devices without NCCL), and with
//! loops over host memory on CPU backends (Flex, NdArray), whose results go into buffers
//! reused from call to call.

mod rendezvous;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::tensor::{DType, Tensor, backend::Backend};

use crate::call::{CollectiveCall, CollectiveOp, ReduceOp, dtype_name};
use crate::communicator::Communicator;
use crate::error::CommError;
use crate::plane::{HostPlane, block_bounds, fold_parts};
use rendezvous::Rendezvous;

/// Settings of a [`LocalGroup`].
#[derive(Debug, Clone, PartialEq)]
pub struct GroupOptions {
    /// How long a rank waits in a collective for the others before the group fails with
    /// [`CommError::Timeout`].
    pub timeout: Duration,
}

impl Default for GroupOptions {
    /// A ten-minute timeout, as PyTorch's default for NCCL process groups.
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(600),
        }
    }
}

/// One rank's handle on an in-process group of ranks that run on threads of this process.
///
/// Build all handles at once with [`LocalGroup::new`] and give one to each rank's thread (or
/// let [`crate::launch()`] do it). Reductions add in rank order, so every rank receives bitwise
/// the same result, run after run. Dropping a handle tells the other ranks that this rank will
/// issue no more collectives: a rank still waiting for it gets [`CommError::PeerExited`].
///
/// On Flex and NdArray, a collective reads the other ranks' buffers in place and writes its
/// result into memory of the handle's own pool: a result's buffer is written again by a later
/// collective once every tensor made from it has been dropped (at most 256 MiB of such idle
/// buffers are kept per handle). Elsewhere results are fresh tensors of Burn ops.
///
/// A group made by [`Communicator::split`] numbers its ranks from 0, but its errors name each
/// rank as the group it was split from numbers it, so that a message reads as the job's ranks.
pub struct LocalGroup<B: Backend> {
    rank: usize,
    rendezvous: Arc<Rendezvous<Option<Tensor<B, 1>>>>,
    issued: AtomicU64,
    /// The host data plane, on CPU backends.
    host: Option<HostPlane>,
}

impl<B: Backend> LocalGroup<B> {
    /// Handles for a group of `world_size` ranks with default options, in rank order.
    pub fn new(world_size: usize) -> Result<Vec<Self>, CommError> {
        Self::with_options(world_size, GroupOptions::default())
    }

    /// Handles for a group of `world_size` ranks, in rank order.
    pub fn with_options(world_size: usize, options: GroupOptions) -> Result<Vec<Self>, CommError> {
        if world_size == 0 {
            return Err(CommError::InvalidGroup(
                "world size must be at least 1".into(),
            ));
        }
        if options.timeout.is_zero() {
            return Err(CommError::InvalidGroup(
                "timeout must be longer than zero".into(),
            ));
        }
        let rendezvous = Arc::new(Rendezvous::new(world_size, options.timeout));
        Ok((0..world_size)
            .map(|rank| Self::handle(rank, rendezvous.clone()))
            .collect())
    }

    fn handle(rank: usize, rendezvous: Arc<Rendezvous<Option<Tensor<B, 1>>>>) -> Self {
        LocalGroup {
            rank,
            rendezvous,
            issued: AtomicU64::new(0),
            host: HostPlane::new::<B>(),
        }
    }

    /// The error that ended this group, if it has ended.
    pub fn failure(&self) -> Option<CommError> {
        self.rendezvous.failure()
    }

    /// Tells the other ranks that this rank will issue no more collectives.
    pub fn leave(&self) {
        self.rendezvous.depart(self.rank);
    }

    fn world(&self) -> usize {
        self.rendezvous.world_size()
    }

    /// Fingerprints the next call of this rank; a call that is invalid on its face ends the
    /// group, so no other rank is left waiting for it.
    fn begin(
        &self,
        op: CollectiveOp,
        tensor: Option<&Tensor<B, 1>>,
    ) -> Result<CollectiveCall, CommError> {
        let seq = self.issued.fetch_add(1, Ordering::Relaxed) + 1;
        let call = CollectiveCall {
            seq,
            op,
            dtype: tensor.map(|t| t.dtype()),
            numel: tensor.map_or(0, |t| t.dims()[0]),
        };
        tracing::trace!(rank = self.rank, %call, "collective");
        if let Some(error) = self.validate(&call) {
            return Err(self.rendezvous.fail(error));
        }
        Ok(call)
    }

    fn validate(&self, call: &CollectiveCall) -> Option<CommError> {
        let world_size = self.world();
        if let Some(dtype) = call.dtype
            && !matches!(
                dtype,
                DType::F64 | DType::F32 | DType::Flex32 | DType::F16 | DType::BF16
            )
        {
            return Some(CommError::UnsupportedDtype {
                dtype: dtype_name(dtype),
                op: call.op.to_string(),
                supported: "f64, f32, flex32, f16, bf16",
            });
        }
        match call.op {
            CollectiveOp::ReduceScatter(_) | CollectiveOp::AllToAll
                if !call.numel.is_multiple_of(world_size) =>
            {
                Some(CommError::NotDivisible {
                    numel: call.numel,
                    world_size,
                })
            }
            CollectiveOp::Broadcast { root } if root >= world_size => {
                Some(CommError::InvalidRoot { root, world_size })
            }
            _ => None,
        }
    }

    fn exchange(
        &self,
        call: &CollectiveCall,
        phase: u8,
        payload: Option<Tensor<B, 1>>,
    ) -> Result<Vec<Option<Tensor<B, 1>>>, CommError> {
        if let Some(tensor) = &payload {
            self.settle(&tensor.device())?;
        }
        self.rendezvous.exchange(self.rank, call, phase, payload)
    }

    /// Waits until this thread's work on `device` is done. Ranks read each other's tensors from
    /// their own threads; on backends with a queue per thread (cubecl's wgpu and CUDA streams)
    /// a tensor must be written before another rank reads it, and another rank's tensor must be
    /// read before its owner may reuse the memory. A no-op on CPU backends.
    fn settle(&self, device: &B::Device) -> Result<(), CommError> {
        B::sync(device).map_err(|error| {
            self.rendezvous.fail(CommError::Device {
                rank: self.rendezvous.origin(self.rank),
                reason: error.to_string(),
            })
        })
    }

    /// `result` once this rank has finished reading `received`, the other ranks' tensors,
    /// which it lets go of only then.
    ///
    /// The order matters on cubecl's wgpu runtime: each thread has its own queue of pending
    /// work *and its own memory pool*, and a kernel reading another rank's buffer does not keep
    /// that buffer's memory reserved. Were this rank to drop its handles first (as `cat` does
    /// with the tensors it consumes) while its copy kernel still waits in its queue, the owner
    /// could hand the memory to its next tensor and upload into it before the copy runs: the
    /// copy then reads the wrong values. Holding `received` until this thread's work is
    /// finished rules that out whatever the timing.
    fn settled(
        &self,
        result: Tensor<B, 1>,
        received: Vec<Option<Tensor<B, 1>>>,
    ) -> Result<Tensor<B, 1>, CommError> {
        self.settle(&result.device())?;
        drop(received);
        Ok(result)
    }

    /// The host data plane, for a group of more than one rank (one rank's results are its own
    /// buffers, without a copy).
    fn host(&self) -> Option<&HostPlane> {
        self.host.as_ref().filter(|_| self.world() > 1)
    }

    /// Reduces `range` of every rank's buffer in rank order, on `device`.
    fn reduce_range(
        buffers: &[Option<Tensor<B, 1>>],
        range: std::ops::Range<usize>,
        op: ReduceOp,
        device: &B::Device,
    ) -> Tensor<B, 1> {
        let parts = buffers.iter().map(|buffer| {
            buffer
                .clone()
                .unwrap_or_else(|| unreachable!("every rank deposits a buffer"))
                .slice(range.clone())
                .to_device(device)
        });
        fold_parts(parts, op)
    }
}

impl<B: Backend> Communicator<B> for LocalGroup<B> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world()
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::AllGather, Some(&block))?;
        let device = block.device();
        let blocks = self.exchange(&call, 0, Some(block.clone()))?;
        if call.numel == 0 {
            return Ok(block);
        }
        if let Some(gathered) = self.host().and_then(|host| host.concat(&blocks)) {
            return Ok(gathered);
        }
        let parts = blocks
            .iter()
            .map(|b| {
                b.clone()
                    .unwrap_or_else(|| unreachable!("every rank deposits a block"))
                    .to_device(&device)
            })
            .collect();
        self.settled(Tensor::cat(parts, 0), blocks)
    }

    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::ReduceScatter(op), Some(&input))?;
        let device = input.device();
        let buffers = self.exchange(&call, 0, Some(input.clone()))?;
        if call.numel == 0 {
            return Ok(input);
        }
        let block = call.numel / self.world();
        let range = self.rank * block..(self.rank + 1) * block;
        if let Some(reduced) = self
            .host()
            .and_then(|host| host.reduce(&buffers, range.clone(), op))
        {
            return Ok(reduced);
        }
        let reduced = Self::reduce_range(&buffers, range, op, &device);
        self.settled(reduced, buffers)
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::AllReduce(op), Some(&input))?;
        let device = input.device();
        let buffers = self.exchange(&call, 0, Some(input.clone()))?;
        if call.numel == 0 {
            return Ok(input);
        }
        // Each rank reduces one block, then the blocks are gathered: every element is still
        // reduced in rank order, and no rank does the whole reduction alone.
        let range = block_bounds(call.numel, self.world(), self.rank);
        let mine = (!range.is_empty()).then(|| {
            self.host()
                .and_then(|host| host.reduce(&buffers, range.clone(), op))
                .unwrap_or_else(|| Self::reduce_range(&buffers, range, op, &device))
        });
        // This rank's block is written, and its reads of the others' buffers are done, before
        // it deposits the block and lets go of the buffers.
        self.settle(&device)?;
        drop(buffers);
        let blocks = self.exchange(&call, 1, mine)?;
        if let Some(reduced) = self.host().and_then(|host| host.concat(&blocks)) {
            return Ok(reduced);
        }
        let parts: Vec<Tensor<B, 1>> = blocks
            .iter()
            .flatten()
            .map(|b| b.clone().to_device(&device))
            .collect();
        self.settled(Tensor::cat(parts, 0), blocks)
    }

    fn all_to_all(&self, input: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::AllToAll, Some(&input))?;
        let device = input.device();
        let buffers = self.exchange(&call, 0, Some(input.clone()))?;
        if call.numel == 0 || self.world() == 1 {
            return Ok(input);
        }
        let block = call.numel / self.world();
        let range = self.rank * block..(self.rank + 1) * block;
        let pieces: Vec<Option<Tensor<B, 1>>> = buffers
            .iter()
            .map(|buffer| {
                let buffer = buffer
                    .clone()
                    .unwrap_or_else(|| unreachable!("every rank deposits a buffer"));
                Some(buffer.slice(range.clone()))
            })
            .collect();
        if let Some(received) = self.host().and_then(|host| host.concat(&pieces)) {
            return Ok(received);
        }
        let parts = pieces
            .into_iter()
            .flatten()
            .map(|piece| piece.to_device(&device));
        self.settled(Tensor::cat(parts.collect(), 0), buffers)
    }

    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::Broadcast { root }, Some(&buffer))?;
        let device = buffer.device();
        let is_root = self.rank == root;
        let buffers = self.exchange(&call, 0, is_root.then_some(buffer.clone()))?;
        if is_root {
            return Ok(buffer);
        }
        let sent = buffers
            .get(root)
            .cloned()
            .flatten()
            .unwrap_or_else(|| unreachable!("the root deposits its buffer"));
        if self.host.is_some() || call.numel == 0 {
            // Host tensors are copy-on-write: sharing the root's buffer is a copy made lazily.
            return Ok(sent);
        }
        // A tensor of its own, written on this rank's queue: a caller could otherwise hold the
        // root's memory past the point where the root reuses it (see `settled`).
        let numel = sent.dims()[0];
        // One range for the one dimension (not a vector of one range).
        #[allow(clippy::single_range_in_vec_init)]
        let all = [0..numel];
        let copy = Tensor::<B, 1>::empty([numel], (&device, sent.dtype()))
            .slice_assign(all, sent.to_device(&device));
        self.settled(copy, buffers)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let call = self.begin(CollectiveOp::Barrier, None)?;
        self.exchange(&call, 0, None).map(drop)
    }

    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        let call = self.begin(CollectiveOp::Duplicate, None)?;
        let child = Rendezvous::child(&self.rendezvous, call.seq);
        // Once the exchange completes, every rank has taken the child.
        self.exchange(&call, 0, None)?;
        self.rendezvous.forget_child(call.seq);
        Ok(Arc::new(Self::handle(self.rank, child)))
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        let call = self.begin(CollectiveOp::Split, None)?;
        self.rendezvous.note_color(call.seq, self.rank, color);
        // Once the first exchange completes, every rank's color is recorded.
        self.exchange(&call, 0, None)?;
        let (child, rank) = Rendezvous::split_child(&self.rendezvous, call.seq, self.rank);
        // Once the second completes, every rank has taken its group.
        self.exchange(&call, 1, None)?;
        self.rendezvous.forget_split(call.seq);
        Ok(Arc::new(Self::handle(rank, child)))
    }

    fn abort(&self, reason: &str) {
        self.rendezvous.report(self.rank, reason);
        self.rendezvous.fail(CommError::PeerFailed {
            rank: self.rendezvous.origin(self.rank),
            reason: reason.to_string(),
        });
    }

    fn report_failure(&self, reason: &str) {
        self.rendezvous.report(self.rank, reason);
    }

    fn first_failure(&self) -> Option<(usize, String)> {
        self.rendezvous.cause()
    }
}

impl<B: Backend> Drop for LocalGroup<B> {
    fn drop(&mut self) {
        self.leave();
    }
}
