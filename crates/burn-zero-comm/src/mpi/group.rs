//! `MpiGroup`: one rank's MPI communicator, and the collectives on any backend's tensors.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_zero_launch::sync::lock;

use super::MpiOptions;
use super::process::MpiProcess;
use super::staging::{Incoming, Outgoing};
use super::sys::{self, Comm, Failure, Layout, Request};
use crate::call::{CollectiveCall, CollectiveOp, ReduceOp, dtype_name};
use crate::communicator::Communicator;
use crate::control::JobControl;
use crate::error::CommError;
use crate::plane::{HostPlane, block_bounds};

/// The dtypes the MPI engine moves and reduces (those of `LocalGroup`).
const SUPPORTED: &str = "f64, f32, flex32, f16, bf16";

/// One rank's handle on an MPI communicator, for ranks in separate processes computing on
/// any Burn backend (Flex, NdArray, wgpu, CUDA without NCCL).
///
/// Build it with [`MpiGroup::from_env`] in each rank's process, started by `mpirun`, `srun`
/// (with Slurm's MPI support) or `zero-run` (see [`super`]).
///
/// Reductions are bitwise those of [`crate::LocalGroup`] at the same ranks, whatever MPI's
/// own algorithms: a reduce-scatter is an all-to-all of the buffer's blocks (each rank
/// receives every rank's copy of its own block), summed on this side in rank order with the
/// arithmetic `LocalGroup` uses on this backend; an all-reduce is that, over blocks of nearly
/// equal size, followed by an all-gather of the reduced blocks. Per rank that moves what
/// MPI's own ring reduce-scatter and all-reduce move.
///
/// On Flex and NdArray MPI reads the tensors' memory in place and writes into buffers of the
/// handle's pool, reused once every tensor made from them is dropped, as `LocalGroup` does.
/// Elsewhere tensors are read back to the host and results uploaded.
///
/// Every collective is non-blocking underneath: the rank polls it, and fails it with
/// [`CommError::Timeout`] after [`MpiOptions::timeout`], or at once with the job's failure
/// when another rank reports one through the job's control connection (a rank that panicked,
/// was killed, or failed on its own account). A failed group stays failed, as do its
/// duplicates and splits; MPI is then left without `MPI_Finalize`, which would wait for the
/// collective that never finished.
pub struct MpiGroup<B: Backend> {
    comm: Comm,
    rank: usize,
    world_size: usize,
    /// This rank as the group everything was split from numbers it.
    job_rank: usize,
    options: MpiOptions,
    /// The job's control connection (none in a job of one rank).
    control: Option<Arc<JobControl>>,
    /// Shared with every group duplicated or split from the same one.
    family: Arc<Family>,
    issued: AtomicU64,
    plane: Option<HostPlane>,
    process: Arc<MpiProcess>,
    _backend: PhantomData<fn() -> B>,
}

/// What a group and its duplicates and splits share.
#[derive(Debug, Default)]
pub(crate) struct Family {
    /// The first failure of any of them.
    failure: Mutex<Option<CommError>>,
    /// The first rank (as the job numbers it) that reported a failure of its own, with why.
    cause: Mutex<Option<(usize, String)>>,
}

/// A collective MPI is running, with everything it reads and writes.
struct Posted {
    request: Request,
    send: Option<Outgoing>,
    recv: Option<Incoming>,
    /// Read by MPI until the collective completes.
    _layout: Option<Box<Layout>>,
}

impl<B: Backend> MpiGroup<B> {
    /// Wraps the job's communicator (or one made from it).
    pub(crate) fn from_parts(
        comm: Comm,
        job_rank: usize,
        options: MpiOptions,
        control: Option<Arc<JobControl>>,
        family: Arc<Family>,
        process: Arc<MpiProcess>,
    ) -> Result<Self, CommError> {
        let rank = comm.rank().map_err(|f| setup_error(job_rank, f))?;
        let world_size = comm.size().map_err(|f| setup_error(job_rank, f))?;
        Ok(MpiGroup {
            comm,
            rank,
            world_size,
            job_rank,
            options,
            control,
            family,
            issued: AtomicU64::new(0),
            plane: HostPlane::new::<B>(),
            process,
            _backend: PhantomData,
        })
    }

    /// A family for a job's first group.
    pub(crate) fn new_family() -> Arc<Family> {
        Arc::new(Family::default())
    }

    /// The options the group was built with.
    pub fn options(&self) -> &MpiOptions {
        &self.options
    }

    /// The error that ended this group, if it has ended.
    pub fn failure(&self) -> Option<CommError> {
        lock(&self.family.failure).clone()
    }

    /// The host data plane of a group of several ranks.
    fn plane(&self) -> Option<&HostPlane> {
        self.plane.as_ref()
    }

    /// Fingerprints the next call, checks it on its face and, with schedule checks on, against
    /// the other ranks' calls; fails the group on an invalid call, so that no other rank is
    /// left waiting for it.
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
        if let Some(error) = self.failure() {
            return Err(error);
        }
        if let Some(error) = self.validate(&call) {
            return Err(self.fail(error));
        }
        if let Some(control) = &self.control
            && let Err(error) = control.check(&call)
        {
            return Err(self.fail(error));
        }
        Ok(call)
    }

    fn validate(&self, call: &CollectiveCall) -> Option<CommError> {
        if let Some(dtype) = call.dtype
            && !matches!(
                dtype,
                DType::F64 | DType::F32 | DType::Flex32 | DType::F16 | DType::BF16
            )
        {
            return Some(CommError::UnsupportedDtype {
                dtype: dtype_name(dtype),
                op: call.op.to_string(),
                supported: SUPPORTED,
            });
        }
        let bytes = call.numel * call.dtype.map_or(0, |dtype| dtype.size());
        let world_size = self.world_size;
        let moved = match call.op {
            CollectiveOp::AllGather => bytes * world_size,
            _ => bytes,
        };
        if sys::count(moved).is_none() {
            return Some(CommError::InvalidGroup(format!(
                "{call} moves {moved} bytes, and MPI counts a buffer's bytes in a 32-bit int: \
                 split it into buffers of at most 2 GiB (a smaller chunk or bucket size)"
            )));
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

    /// `tensor`'s bytes for MPI to read.
    fn outgoing(&self, tensor: &Tensor<B, 1>) -> Result<Outgoing, CommError> {
        Outgoing::of(tensor, self.plane(), self.job_rank).map_err(|error| self.fail(error))
    }

    /// Waits for `posted` to complete, polling MPI (which makes its progress inside the
    /// polls), the job's failure and the timeout; returns its buffers. A collective that does
    /// not complete is left to MPI with its buffers, which are never freed.
    fn complete(
        &self,
        call: &CollectiveCall,
        posted: Result<Posted, Failure>,
    ) -> Result<(Option<Outgoing>, Option<Incoming>), CommError> {
        let mut posted = posted.map_err(|failure| self.fail(self.mpi_error(call, failure)))?;
        let started = Instant::now();
        let mut idle = Idle::new();
        loop {
            let stop = match posted.request.test() {
                Ok(true) => return Ok((posted.send, posted.recv)),
                Ok(false) => self.interrupted().or_else(|| {
                    let waited = started.elapsed();
                    (waited >= self.options.timeout).then(|| CommError::Timeout {
                        rank: self.job_rank,
                        call: Box::new(call.clone()),
                        waited,
                        missing: Vec::new(),
                    })
                }),
                Err(failure) => Some(self.mpi_error(call, failure)),
            };
            if let Some(error) = stop {
                // MPI may still read and write these buffers: they must outlive the process.
                std::mem::forget(posted);
                self.process.abandon();
                return Err(self.fail(error));
            }
            idle.pause(started.elapsed());
        }
    }

    /// The job's failure, as seen by this rank while it waits.
    fn interrupted(&self) -> Option<CommError> {
        self.failure()
            .or_else(|| self.control.as_ref().and_then(|control| control.failure()))
    }

    /// Ends the group (and its family) with `error`, telling every other process; returns
    /// the family's first error.
    fn fail(&self, error: CommError) -> CommError {
        let mut failure = lock(&self.family.failure);
        if let Some(first) = failure.as_ref() {
            return first.clone();
        }
        tracing::error!(rank = self.job_rank, %error, "MPI group failed");
        *failure = Some(error.clone());
        drop(failure);
        if let Some(control) = &self.control {
            control.abort(&error.to_string());
        }
        error
    }

    fn mpi_error(&self, call: &CollectiveCall, failure: Failure) -> CommError {
        CommError::Mpi {
            rank: self.job_rank,
            during: call.to_string(),
            detail: failure.to_string(),
        }
    }

    /// A group on `comm` sharing this one's family, control connection (aborts only: its
    /// collectives are counted apart) and process.
    fn child(&self, comm: Comm) -> Result<MpiGroup<B>, CommError> {
        let control = self
            .control
            .as_ref()
            .map(|control| Arc::new(control.without_checks()));
        MpiGroup::from_parts(
            comm,
            self.job_rank,
            self.options.clone(),
            control,
            self.family.clone(),
            self.process.clone(),
        )
    }

    /// Records this rank's own failure as the job's cause, with the control store when there is
    /// one (a round trip).
    fn note_failure(&self, reason: &str) {
        lock(&self.family.cause).get_or_insert_with(|| (self.job_rank, reason.to_string()));
        if let Some(control) = &self.control {
            control.report(reason);
        }
    }

    /// Byte counts and offsets of an all-to-all that sends block `i` of `ranges` (in
    /// elements of `size` bytes) to rank `i` and receives `mine` elements from every rank.
    fn all_to_all_layout(ranges: &[std::ops::Range<usize>], mine: usize, size: usize) -> Layout {
        let int = |elements: usize| (elements * size) as i32;
        Layout {
            send_counts: ranges.iter().map(|r| int(r.len())).collect(),
            send_displs: ranges.iter().map(|r| int(r.start)).collect(),
            recv_counts: vec![int(mine); ranges.len()],
            recv_displs: (0..ranges.len()).map(|i| int(i * mine)).collect(),
        }
    }

    /// Every rank's `ranges`-th block of `input` summed (or reduced by `op`) in rank order:
    /// the all-to-all of the blocks, then the fold.
    fn reduce_blocks(
        &self,
        call: &CollectiveCall,
        input: &Tensor<B, 1>,
        ranges: &[std::ops::Range<usize>],
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        let dtype = input.dtype();
        let recv = self.exchange_blocks(call, input, ranges)?;
        Ok(recv.reduce(self.plane(), self.world_size, op, dtype, &input.device()))
    }

    /// Each rank's block of a buffer of `numel` elements that the world size divides.
    fn equal_blocks(&self, numel: usize) -> Vec<std::ops::Range<usize>> {
        let block = numel / self.world_size;
        (0..self.world_size)
            .map(|rank| rank * block..(rank + 1) * block)
            .collect()
    }

    /// Sends range `r` of `input` to rank `r` and receives this rank's range from every rank,
    /// end to end in rank order (an all-to-all).
    fn exchange_blocks(
        &self,
        call: &CollectiveCall,
        input: &Tensor<B, 1>,
        ranges: &[std::ops::Range<usize>],
    ) -> Result<Incoming, CommError> {
        let dtype = input.dtype();
        let mine = ranges[self.rank].len();
        let send = self.outgoing(input)?;
        let mut recv = Incoming::new(self.plane(), dtype, mine * self.world_size);
        let layout = Box::new(Self::all_to_all_layout(ranges, mine, dtype.size()));
        // SAFETY: the send bytes, the receive buffer and the layout move into `Posted` with
        // their heap storage in place, and stay alive until the request completes (or forever,
        // if it does not: `complete` leaks them).
        let request = unsafe {
            self.comm
                .all_to_all(send.address(), recv.address(), &layout)
        };
        let posted = request.map(|request| Posted {
            request,
            send: Some(send),
            recv: Some(recv),
            _layout: Some(layout),
        });
        let (_, recv) = self.complete(call, posted)?;
        Ok(recv.unwrap_or_else(|| unreachable!("an all-to-all receives")))
    }
}

/// How a waiting rank spends the time between polls: yielding its core at first (a
/// collective between processes of one node often completes within microseconds), then
/// sleeping in growing steps up to a millisecond, so that ranks sharing cores leave them to
/// the ranks still computing.
struct Idle {
    sleep: Duration,
}

impl Idle {
    const YIELD_FOR: Duration = Duration::from_micros(200);
    const LONGEST: Duration = Duration::from_millis(1);

    fn new() -> Self {
        Self {
            sleep: Duration::from_micros(10),
        }
    }

    fn pause(&mut self, waited: Duration) {
        if waited < Self::YIELD_FOR {
            thread::yield_now();
        } else {
            thread::sleep(self.sleep);
            self.sleep = (self.sleep * 2).min(Self::LONGEST);
        }
    }
}

impl<B: Backend> Communicator<B> for MpiGroup<B> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::AllGather, Some(&block))?;
        if self.world_size == 1 || call.numel == 0 {
            return Ok(block);
        }
        let dtype = block.dtype();
        let send = self.outgoing(&block)?;
        let mut recv = Incoming::new(self.plane(), dtype, call.numel * self.world_size);
        let bytes = send.bytes().len() as i32; // Checked against 2 GiB in `validate`.
        // SAFETY: as in `reduce_blocks`.
        let request = unsafe { self.comm.all_gather(send.address(), bytes, recv.address()) };
        let posted = request.map(|request| Posted {
            request,
            send: Some(send),
            recv: Some(recv),
            _layout: None,
        });
        let (_, recv) = self.complete(&call, posted)?;
        let recv = recv.unwrap_or_else(|| unreachable!("a gather receives"));
        Ok(recv.into_tensor(self.plane(), dtype, &block.device()))
    }

    fn reduce_scatter(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::ReduceScatter(op), Some(&input))?;
        if self.world_size == 1 || call.numel == 0 {
            return Ok(input);
        }
        let ranges = self.equal_blocks(call.numel);
        self.reduce_blocks(&call, &input, &ranges, op)
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::AllReduce(op), Some(&input))?;
        if self.world_size == 1 || call.numel == 0 {
            return Ok(input);
        }
        // Each rank reduces a block of nearly equal size, as `LocalGroup` does, then the
        // blocks are gathered.
        let ranges: Vec<_> = (0..self.world_size)
            .map(|rank| block_bounds(call.numel, self.world_size, rank))
            .collect();
        let mine = self.reduce_blocks(&call, &input, &ranges, op)?;
        let dtype = input.dtype();
        let send = self.outgoing(&mine)?;
        let mut recv = Incoming::new(self.plane(), dtype, call.numel);
        let size = dtype.size();
        let layout = Box::new(Layout {
            recv_counts: ranges.iter().map(|r| (r.len() * size) as i32).collect(),
            recv_displs: ranges.iter().map(|r| (r.start * size) as i32).collect(),
            ..Layout::default()
        });
        let bytes = send.bytes().len() as i32;
        // SAFETY: as in `reduce_blocks`.
        let request = unsafe {
            self.comm
                .all_gather_varying(send.address(), bytes, recv.address(), &layout)
        };
        let posted = request.map(|request| Posted {
            request,
            send: Some(send),
            recv: Some(recv),
            _layout: Some(layout),
        });
        let (_, recv) = self.complete(&call, posted)?;
        let recv = recv.unwrap_or_else(|| unreachable!("a gather receives"));
        Ok(recv.into_tensor(self.plane(), dtype, &input.device()))
    }

    fn all_to_all(&self, input: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::AllToAll, Some(&input))?;
        if self.world_size == 1 || call.numel == 0 {
            return Ok(input);
        }
        let ranges = self.equal_blocks(call.numel);
        let recv = self.exchange_blocks(&call, &input, &ranges)?;
        Ok(recv.into_tensor(self.plane(), input.dtype(), &input.device()))
    }

    fn broadcast(&self, buffer: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        let call = self.begin(CollectiveOp::Broadcast { root }, Some(&buffer))?;
        if self.world_size == 1 || call.numel == 0 {
            return Ok(buffer);
        }
        let dtype = buffer.dtype();
        let bytes = (call.numel * dtype.size()) as i32;
        let root_rank = root as i32;
        if self.rank == root {
            let send = self.outgoing(&buffer)?;
            // SAFETY: as in `reduce_blocks`; at the root MPI_Ibcast only reads the buffer, so
            // handing it the tensor's own (shared) memory, or the static of no bytes, as
            // writable is sound.
            let request = unsafe {
                self.comm
                    .broadcast(send.address().cast_mut(), bytes, root_rank)
            };
            let posted = request.map(|request| Posted {
                request,
                send: Some(send),
                recv: None,
                _layout: None,
            });
            self.complete(&call, posted)?;
            return Ok(buffer);
        }
        let mut recv = Incoming::new(self.plane(), dtype, call.numel);
        // SAFETY: as in `reduce_blocks`.
        let request = unsafe { self.comm.broadcast(recv.address(), bytes, root_rank) };
        let posted = request.map(|request| Posted {
            request,
            send: None,
            recv: Some(recv),
            _layout: None,
        });
        let (_, recv) = self.complete(&call, posted)?;
        let recv = recv.unwrap_or_else(|| unreachable!("a broadcast receives off the root"));
        Ok(recv.into_tensor(self.plane(), dtype, &buffer.device()))
    }

    fn barrier(&self) -> Result<(), CommError> {
        let call = self.begin(CollectiveOp::Barrier, None)?;
        if self.world_size == 1 {
            return Ok(());
        }
        let posted = self.comm.barrier().map(|request| Posted {
            request,
            send: None,
            recv: None,
            _layout: None,
        });
        self.complete(&call, posted).map(drop)
    }

    fn duplicate(&self) -> Result<Arc<dyn Communicator<B>>, CommError> {
        let call = self.begin(CollectiveOp::Duplicate, None)?;
        let comm = self
            .comm
            .duplicate()
            .map_err(|failure| self.fail(self.mpi_error(&call, failure)))?;
        Ok(Arc::new(self.child(comm)?))
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<B>>, CommError> {
        let call = self.begin(CollectiveOp::Split, None)?;
        let color = i32::try_from(color).map_err(|_| {
            self.fail(CommError::InvalidGroup(format!(
                "split color {color} is too large for MPI (at most {})",
                i32::MAX
            )))
        })?;
        let comm = self
            .comm
            .split(color, self.rank as i32)
            .map_err(|failure| self.fail(self.mpi_error(&call, failure)))?;
        Ok(Arc::new(self.child(comm)?))
    }

    fn abort(&self, reason: &str) {
        self.note_failure(reason);
        self.fail(CommError::PeerFailed {
            rank: self.job_rank,
            reason: reason.to_string(),
        });
    }

    fn report_failure(&self, reason: &str) {
        self.note_failure(reason);
    }

    fn first_failure(&self) -> Option<(usize, String)> {
        self.control
            .as_ref()
            .and_then(|control| control.first_failure())
            .or_else(|| lock(&self.family.cause).clone())
    }
}

impl<B: Backend> Drop for MpiGroup<B> {
    fn drop(&mut self) {
        if self.failure().is_some() {
            // A collective on this communicator or a related one may be pending in MPI.
            std::mem::replace(&mut self.comm, Comm::this_process()).abandon();
        }
    }
}

impl<B: Backend> std::fmt::Debug for MpiGroup<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("job_rank", &self.job_rank)
            .field("failure", &self.failure())
            .finish()
    }
}

/// A failure while a group is made.
pub(crate) fn setup_error(rank: usize, failure: Failure) -> CommError {
    CommError::Mpi {
        rank,
        during: "setting up the group".into(),
        detail: failure.to_string(),
    }
}
