//! `NcclGroup`: one rank's NCCL communicator, and the collectives on CubeCL CUDA tensors.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_zero_launch::sync::lock;
use cubecl_cuda::{CudaDevice, CudaRuntime};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::NcclOptions;
use super::family::{Departures, Family, Lineage};
use super::flag::StreamFlags;
use super::sys::{self, DataType, DevicePtr, Failure, Progress, RawComm, RedOp};
use crate::call::{CollectiveCall, CollectiveOp, ReduceOp, dtype_name};
use crate::communicator::DataOp;
use crate::control::JobControl;
use crate::counters::RankCounters;
use crate::error::CommError;
use crate::issued::Completion;

mod communicator;
mod split;

/// The dtypes the NCCL engine moves and reduces.
pub(crate) const SUPPORTED: &str = "f32, flex32 (stored as f32), f16, bf16";

/// One rank's handle on an NCCL communicator, for tensors of
/// `CubeBackend<CudaRuntime, F, I, BT>` on one CUDA device.
///
/// Build the handles with [`NcclGroup::local_group`] (several GPUs of this process, one rank
/// per thread), [`NcclGroup::from_env`] / [`NcclGroup::init`] (one rank per process, started by
/// `zero-run` or torchrun), or [`crate::nccl::launch_nccl`].
///
/// Each collective is ordered after its input's writers on the device
/// ([`NcclOptions::order_on_device`]): the issuing thread's stream writes a number into a
/// device flag the group keeps for that stream, and the group's own stream waits for it before
/// NCCL runs; with the option off, the issuing thread's stream is synchronised instead.
/// [`crate::Communicator::issue`]
/// returns as soon as NCCL's call is queued; the thread that reads the result
/// ([`crate::Issued::wait`]) queries an event recorded after it and waits only if NCCL has not
/// completed yet, so the result is ready for any stream when it is handed out. The input and
/// output buffers are held until then. The blocking methods issue and wait at once. While it
/// waits, the rank polls NCCL for asynchronous errors and watches the group's timeout; on an
/// error or a timeout it aborts the communicator (`ncclCommAbort`) and returns
/// [`CommError::Nccl`] or [`CommError::Stalled`]. A failed group stays failed: every later call
/// returns the same error.
///
/// A failure of one rank reaches the others without waiting for the timeout: the ranks of one
/// process ([`NcclGroup::local_group`]) share their failure, and ranks in several processes
/// ([`NcclGroup::init`]) hear of it through the job's control connection ([`JobControl`]);
/// either way a rank polling a collective aborts its communicator at once. With
/// [`NcclOptions::check_schedule`], every call is compared with the other ranks' calls
/// before NCCL sees it, so a diverged schedule is a [`CommError::Mismatch`] naming both calls,
/// never a collective that reads or writes past a buffer.
///
/// `ReduceOp::Mean` is an NCCL sum divided once by the world size with a Burn op afterwards
/// (not `ncclAvg`), the same arithmetic as [`crate::LocalGroup`]. Sums follow NCCL's order
/// (ring or tree), not rank order, so they can differ from `LocalGroup` in the last bits when
/// more than two ranks add values that round.
pub struct NcclGroup {
    /// Shared with the collectives still in flight ([`crate::Communicator::issue`]): the
    /// communicator and its stream live until the last of them has completed.
    group: Arc<Group>,
}

impl std::ops::Deref for NcclGroup {
    type Target = Group;

    fn deref(&self) -> &Group {
        &self.group
    }
}

impl From<Group> for NcclGroup {
    fn from(group: Group) -> Self {
        NcclGroup {
            group: Arc::new(group),
        }
    }
}

/// The state behind an [`NcclGroup`] handle: the communicator, its stream, and what the
/// collectives share.
pub struct Group {
    // Declared first so that it drops first: the communicator is aborted before its stream
    // and context are released. Shared (weakly) with the control connection's failure hook.
    link: Arc<Mutex<Link>>,
    rank: usize,
    world_size: usize,
    device: CudaDevice,
    options: NcclOptions,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Set by [`crate::Communicator::abort`] while another thread is inside a collective.
    abort_request: Mutex<Option<String>>,
    /// Shared with the other ranks of this process's job, the group this one was duplicated
    /// from and every duplicate: the first failure of any of them ends them all.
    family: Family,
    /// The job's control connection, for ranks in several processes.
    control: Option<Arc<JobControl>>,
    issued: AtomicU64,
    /// This rank as the group everything was split from numbers it.
    job_rank: usize,
    /// The device flags collectives wait for ([`NcclOptions::order_on_device`]).
    flags: StreamFlags,
    /// The rank's counters, where the group's host waits are counted.
    counters: OnceLock<Arc<RankCounters>>,
    /// Where this group comes from among its family's groups.
    lineage: Lineage,
    /// What this group's ranks in this process have issued before they left, shared with
    /// them.
    departed: Departures,
}

/// The communicator and what it needs to run one collective at a time.
struct Link {
    /// `None` once the communicator was aborted.
    comm: Option<RawComm>,
    failure: Option<CommError>,
}

/// How long a healthy communicator's end may take to flush its network work before it is
/// aborted instead ([`RawComm::finish`]).
const FINISH_WITHIN: Duration = Duration::from_secs(10);

impl Drop for Link {
    fn drop(&mut self) {
        // A failed group's communicator was aborted already (or is, by its drop).
        if self.failure.is_none()
            && let Some(comm) = self.comm.take()
        {
            comm.finish(FINISH_WITHIN);
        }
    }
}

/// What a collective hands to NCCL besides the buffers.
#[derive(Debug, Clone, Copy)]
enum Kind {
    AllGather,
    AllToAll,
    ReduceScatter(RedOp),
    AllReduce(RedOp),
    Broadcast(usize),
}

impl From<DataOp> for Kind {
    fn from(op: DataOp) -> Self {
        match op {
            DataOp::AllGather => Kind::AllGather,
            DataOp::AllToAll => Kind::AllToAll,
            DataOp::Broadcast { root } => Kind::Broadcast(root),
            DataOp::ReduceScatter(op) => Kind::ReduceScatter(NcclGroup::reduce_kind(op)),
            DataOp::AllReduce(op) => Kind::AllReduce(NcclGroup::reduce_kind(op)),
        }
    }
}

/// The buffers of one collective on the device, and their sizes in elements.
#[derive(Debug, Clone, Copy)]
struct Transfer {
    send: DevicePtr,
    recv: DevicePtr,
    /// Elements of the input.
    numel: usize,
    /// Elements of the output.
    out_numel: usize,
    data_type: DataType,
    /// The device flag and number the group's stream waits for before NCCL runs, when the
    /// collective is ordered on the device.
    after: Option<(DevicePtr, u32)>,
}

/// A collective queued on the group's stream, with what the device may still touch: the
/// [`Completion`] an [`Issued`] result waits on. It holds the group, so the communicator and
/// its stream outlive it.
struct InFlight {
    group: Arc<Group>,
    /// Recorded on the group's stream after the collective.
    done: CudaEvent,
    call: CollectiveCall,
    /// When it was queued: the group's timeout runs from here.
    started: Instant,
    /// The input and output tensors and their resolved buffers, released once `done` is
    /// complete (or the group failed).
    held: Box<dyn Send>,
}

impl Completion for InFlight {
    /// Queries the event; when the device is not done yet, waits for it (counted as one wait
    /// of the engine), polling NCCL for errors and watching the group's timeout meanwhile.
    fn wait(self: Box<Self>) -> Result<(), CommError> {
        let InFlight {
            group,
            done,
            call,
            started,
            held,
        } = *self;
        // The reading thread may never have made the group's context current.
        let bound = {
            let mut link = group.lock();
            group.bind(&mut link)
        };
        if let Err(error) = bound {
            drop(held);
            return Err(error);
        }
        let waited = group.wait(&call, started, || {
            done.try_is_complete()
                .map_err(|e| group.device_error(format!("CUDA: {e}")))
        });
        match waited {
            Ok(true) => group.count_wait(),
            Ok(false) => {}
            // The communicator was aborted, but what its stream had queued may still run:
            // the wait for the input's flag, then NCCL's kernel, which would write into memory
            // the pool had given to another tensor. Buffers the device is not known to be done
            // with are left to the failed process rather than reused.
            Err(_) if !matches!(done.try_is_complete(), Ok(true)) => {
                strand(held);
                return waited.map(|_| ());
            }
            Err(_) => {}
        }
        drop(held);
        waited.map(|_| ())
    }

    /// Queries the event once. A failed query, or a group that has failed, reads as done, so
    /// that the caller's `wait` comes and reports the error.
    fn is_done(&self) -> Option<bool> {
        let mut link = self.group.lock();
        if link.failure.is_some() || self.group.bind(&mut link).is_err() {
            return Some(true);
        }
        drop(link);
        Some(self.done.try_is_complete().unwrap_or(true))
    }
}

impl NcclGroup {
    /// A family for the groups of one job in this process.
    pub(crate) fn new_family() -> Family {
        Family::default()
    }

    /// Tells the other ranks that this rank will issue no more collectives: one still waiting
    /// for it in a later collective fails with [`CommError::PeerExited`] instead of waiting
    /// out its timeout. [`crate::nccl::launch_nccl`] calls it when a rank's work succeeded.
    pub fn leave(&self) {
        let issued = self.issued.load(Ordering::Relaxed);
        self.record_departure(issued);
        if let Some(control) = &self.control
            && control.checks_schedule()
        {
            control.leave(issued);
        }
    }

    /// The CUDA device of this rank.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The options the group was built with.
    pub fn options(&self) -> &NcclOptions {
        &self.options
    }

    /// The error that ended this group, if it has ended.
    pub fn failure(&self) -> Option<CommError> {
        self.lock().failure.clone()
    }

    /// [`crate::Communicator::report_failure`] for both backends this engine serves: kept for the
    /// ranks of this process and, in a job of several processes, reported to its control
    /// store (a round trip), which names the job's cause to every rank and to `zero-run`.
    pub(crate) fn note_failure(&self, reason: &str) {
        self.family.note_cause(self.job_rank, reason);
        if let Some(control) = &self.control {
            control.report(reason);
        }
    }

    /// [`crate::Communicator::first_failure`] for both backends this engine serves: with a control
    /// connection, the job's first cause as its store recorded it (ranks of every process);
    /// otherwise, or before the store's word arrived, the first of this process's ranks.
    pub(crate) fn cause(&self) -> Option<(usize, String)> {
        self.control
            .as_ref()
            .and_then(|control| control.first_failure())
            .or_else(|| self.family.cause())
    }

    /// Fingerprints the next call of this rank.
    fn call(&self, op: CollectiveOp, dtype: Option<DType>, numel: usize) -> CollectiveCall {
        let seq = self.issued.fetch_add(1, Ordering::Relaxed) + 1;
        let call = CollectiveCall {
            seq,
            op,
            dtype,
            numel,
        };
        tracing::trace!(rank = self.rank, %call, "collective");
        call
    }

    /// Checks a call on its face; an invalid call fails the group, so the other ranks' NCCL
    /// calls time out (or fail) instead of waiting forever.
    fn validate(&self, call: &CollectiveCall) -> Result<DataType, CommError> {
        let dtype = call.dtype.unwrap_or(DType::F32);
        let data_type = data_type(dtype).ok_or_else(|| CommError::UnsupportedDtype {
            dtype: dtype_name(dtype),
            op: call.op.to_string(),
            supported: SUPPORTED,
        })?;
        match call.op {
            CollectiveOp::ReduceScatter(_) | CollectiveOp::AllToAll
                if !call.numel.is_multiple_of(self.world_size) =>
            {
                Err(CommError::NotDivisible {
                    numel: call.numel,
                    world_size: self.world_size,
                })
            }
            CollectiveOp::Broadcast { root } if root >= self.world_size => {
                Err(CommError::InvalidRoot {
                    root,
                    world_size: self.world_size,
                })
            }
            _ => Ok(data_type),
        }
    }

    /// Runs one collective on `input` and returns its result on this rank's device, once
    /// NCCL has completed it.
    fn run(
        &self,
        op: CollectiveOp,
        input: CubeTensor<CudaRuntime>,
        kind: Kind,
    ) -> Result<CubeTensor<CudaRuntime>, CommError> {
        let (output, in_flight) = self.start(op, input, kind)?;
        if let Some(in_flight) = in_flight {
            Box::new(in_flight).wait()?;
        }
        Ok(output)
    }

    /// Queues one collective on `input` on the group's stream and returns its output buffer
    /// with what completes it ([`InFlight`]), or the output alone when nothing moves. The
    /// output must not be read before the collective completed.
    fn start(
        &self,
        op: CollectiveOp,
        input: CubeTensor<CudaRuntime>,
        kind: Kind,
    ) -> Result<(CubeTensor<CudaRuntime>, Option<InFlight>), CommError> {
        let numel = input.meta.shape().num_elements();
        let dtype = input.dtype;
        let call = self.call(op, Some(dtype), numel);
        let during = call.to_string();
        self.admit(&call, &during, &input)?;
        let data_type = data_type(dtype).unwrap_or(DataType::F32);
        let out_numel = self.out_numel(kind, numel);
        if out_numel == 0 || numel == 0 {
            // Nothing moves; every rank agrees on the (empty) result without NCCL.
            return Ok((input, None));
        }

        // Failing before NCCL is called still fails the group, so this rank's schedule never
        // silently diverges from the others'.
        let fail_now = |reason: String| self.fail_unlocked(self.device_error(reason));
        let input = into_contiguous(input);
        let client = input.client.clone();
        let elem_size = input.dtype.size();
        let output = client.empty(out_numel * elem_size);
        // Resolving the buffers on this thread's stream also orders them after their writers
        // on other streams; the signal (or `sync`) then covers all of it.
        let send = client
            .get_resource(input.handle.clone())
            .map_err(|e| fail_now(format!("input buffer: {e}")))?;
        let recv = client
            .get_resource(output.clone())
            .map_err(|e| fail_now(format!("output buffer: {e}")))?;
        if (send.resource().size as usize) < numel * elem_size
            || (recv.resource().size as usize) < out_numel * elem_size
        {
            return Err(fail_now(
                "a CubeCL buffer is smaller than its tensor".into(),
            ));
        }
        let after = if self.options.order_on_device {
            let signalled = self.flags.signal(&client, || self.count_wait());
            Some(signalled.map_err(fail_now)?)
        } else {
            self.count_wait();
            <CubeBackend<CudaRuntime, f32, i32, u8> as burn::tensor::backend::Backend>::sync(
                &self.device,
            )
            .map_err(|e| fail_now(format!("finishing the input: {e}")))?;
            None
        };

        let transfer = Transfer {
            send: DevicePtr(send.resource().ptr),
            recv: DevicePtr(recv.resource().ptr),
            numel,
            out_numel,
            data_type,
            after,
        };
        let output = CubeTensor::new_contiguous(
            client,
            self.device.clone(),
            Shape::new([out_numel]),
            output,
            dtype,
        );
        // The device reads the input and writes the output until `done`.
        let held: Box<dyn Send> = Box::new((send, recv, input, output.clone()));
        let started = Instant::now();
        let done = match self.launch(kind, transfer, &call, &during, started) {
            Ok(done) => done,
            Err(error) => {
                // NCCL may have queued part of the call before it failed.
                strand(held);
                return Err(error);
            }
        };
        let in_flight = InFlight {
            group: self.group.clone(),
            done,
            call,
            started,
            held,
        };
        Ok((output, Some(in_flight)))
    }

    /// Checks `call` (described by `during`) before any buffer is touched: the group must be
    /// usable, the call valid ([`NcclGroup::validate`]) and `input` on the group's device; with
    /// a control connection, every rank must also agree on the call. A check that does not
    /// pass fails the group, so that the other ranks stop too.
    fn admit(
        &self,
        call: &CollectiveCall,
        during: &str,
        input: &CubeTensor<CudaRuntime>,
    ) -> Result<(), CommError> {
        {
            let mut link = self.lock();
            self.usable(&mut link)?;
            let checked = self.validate(call).and_then(|dtype| {
                if input.device != self.device {
                    Err(CommError::InvalidGroup(format!(
                        "rank {}'s NCCL group runs on {:?}, the tensor of its {during} is on {:?}",
                        self.rank, self.device, input.device
                    )))
                } else {
                    Ok(dtype)
                }
            });
            if let Err(error) = checked {
                return Err(self.fail(&mut link, error));
            }
        }
        // Every rank agrees on this call before NCCL touches a buffer.
        self.check_schedule(call)
    }

    /// With a control connection, that every rank of the job makes `call` at this point of
    /// its schedule; a mismatch (or a failed check) fails the group.
    fn check_schedule(&self, call: &CollectiveCall) -> Result<(), CommError> {
        match &self.control {
            Some(control) => control
                .check(call)
                .map_err(|error| self.fail_unlocked(error)),
            None => Ok(()),
        }
    }

    /// The number of elements of a collective's result on this rank, for `numel` elements of
    /// input: every rank's input side by side for a gather, this rank's share for a
    /// reduce-scatter, as many as the input otherwise.
    fn out_numel(&self, kind: Kind, numel: usize) -> usize {
        match kind {
            Kind::AllGather => numel * self.world_size,
            Kind::ReduceScatter(_) => numel / self.world_size,
            Kind::AllToAll | Kind::AllReduce(_) | Kind::Broadcast(_) => numel,
        }
    }

    /// Enqueues the NCCL call of `kind` on the group's stream, waits ([`Group::wait`]) until
    /// NCCL has enqueued all of it (a call it reports pending is still being enqueued), and
    /// returns an event recorded on the stream after it, which completes with the call. Any
    /// failure fails the group.
    fn launch(
        &self,
        kind: Kind,
        transfer: Transfer,
        call: &CollectiveCall,
        during: &str,
        started: Instant,
    ) -> Result<CudaEvent, CommError> {
        let Transfer {
            send: send_ptr,
            recv: recv_ptr,
            numel,
            out_numel,
            data_type,
            after,
        } = transfer;
        let mut link = self.lock();
        self.bind(&mut link)?;
        let done = self
            .context
            .new_event(None)
            .map_err(|e| self.fail(&mut link, self.device_error(format!("CUDA: {e}"))))?;
        let stream = self.stream.cu_stream();
        if let Some((flag, value)) = after
            && let Err(failure) = sys::wait_value(stream, flag, value)
        {
            return Err(self.fail(&mut link, self.nccl_error(during, failure)));
        }
        let launched = {
            let comm = self.usable(&mut link)?;
            match kind {
                Kind::AllGather => comm.all_gather(send_ptr, recv_ptr, numel, data_type, stream),
                Kind::AllToAll => {
                    let block = numel / self.world_size;
                    let ranks = self.world_size;
                    comm.all_to_all(send_ptr, recv_ptr, block, ranks, data_type, stream)
                }
                Kind::ReduceScatter(op) => {
                    comm.reduce_scatter(send_ptr, recv_ptr, out_numel, data_type, op, stream)
                }
                Kind::AllReduce(op) => {
                    comm.all_reduce(send_ptr, recv_ptr, numel, data_type, op, stream)
                }
                Kind::Broadcast(root) => {
                    comm.broadcast(send_ptr, recv_ptr, numel, data_type, root, stream)
                }
            }
        };
        let progress = launched.map_err(|f| self.fail(&mut link, self.nccl_error(during, f)))?;
        if progress == Progress::Pending {
            drop(link);
            self.wait(call, started, || Ok(true))?;
            link = self.lock();
        }
        if let Err(error) = done.record(&self.stream) {
            return Err(self.fail(&mut link, self.device_error(format!("CUDA: {error}"))));
        }
        Ok(done)
    }

    fn reduce_kind(op: ReduceOp) -> RedOp {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => RedOp::Sum,
            ReduceOp::Max => RedOp::Max,
            ReduceOp::Min => RedOp::Min,
        }
    }
}

impl Group {
    /// The state of a group around a communicator that was created on `context`'s device and
    /// has finished initialising.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        world_size: usize,
        device: CudaDevice,
        options: NcclOptions,
        context: Arc<CudaContext>,
        comm: RawComm,
        family: Family,
        lineage: Lineage,
        control: Option<Arc<JobControl>>,
    ) -> Result<Self, CommError> {
        let departed = family.departures(&lineage, world_size);
        let device_error = |error: cudarc::driver::DriverError| CommError::Device {
            rank,
            reason: format!("CUDA: {error}"),
        };
        let stream = context.new_stream().map_err(device_error)?;
        let link = Arc::new(Mutex::new(Link {
            comm: Some(comm),
            failure: None,
        }));
        if let Some(control) = &control {
            // On receipt of the job's failure: abort the communicator now when no collective
            // holds it; a collective that does sees the failure at its next poll (`usable`).
            let link = Arc::downgrade(&link);
            control.on_failure(move |error| {
                let Some(link) = link.upgrade() else { return };
                if let Ok(mut link) = link.try_lock()
                    && link.failure.is_none()
                {
                    tracing::error!(rank, %error, "the job failed; aborting the NCCL communicator");
                    link.comm = None; // Drop aborts.
                    link.failure = Some(error.clone());
                }
            });
        }
        let flags = StreamFlags::new(device.clone());
        Ok(Group {
            rank,
            world_size,
            device,
            options,
            context,
            stream,
            link,
            abort_request: Mutex::new(None),
            family,
            control,
            issued: AtomicU64::new(0),
            job_rank: rank,
            flags,
            counters: OnceLock::new(),
            lineage,
            departed,
        })
    }

    /// Records for this group's other ranks in this process that this rank left it after
    /// `issued` collectives.
    fn record_departure(&self, issued: u64) {
        self.departed.record(self.rank, issued);
    }

    fn lock(&self) -> MutexGuard<'_, Link> {
        lock(&self.link)
    }

    /// The live communicator, or the error that ended the group (an abort requested while
    /// another thread held the group ends it here).
    fn usable<'a>(&self, link: &'a mut Link) -> Result<&'a RawComm, CommError> {
        if let Some(reason) = self.take_abort_request() {
            let error = CommError::PeerFailed {
                rank: self.rank,
                reason,
            };
            self.fail(link, error);
        }
        if link.failure.is_none()
            && let Some(error) = self.family.failure()
        {
            // Another rank of this process, a duplicate or the group this one came from
            // failed: end this one too.
            self.fail(link, error);
        }
        if link.failure.is_none()
            && let Some(error) = self.control.as_ref().and_then(|control| control.failure())
        {
            // A rank of another process failed (the control connection says so).
            self.fail(link, error);
        }
        if let Some(failure) = &link.failure {
            return Err(failure.clone());
        }
        link.comm
            .as_ref()
            .ok_or_else(|| CommError::InvalidGroup("communicator is gone".into()))
    }

    /// Makes the group's CUDA context current on this thread (NCCL launches on it).
    fn bind(&self, link: &mut Link) -> Result<(), CommError> {
        self.context.bind_to_thread().map_err(|error| {
            self.fail(
                link,
                CommError::Device {
                    rank: self.rank,
                    reason: format!("CUDA: {error}"),
                },
            )
        })
    }

    /// [`Group::fail`] from a caller that does not hold the group's lock.
    fn fail_unlocked(&self, error: CommError) -> CommError {
        let mut link = self.lock();
        self.fail(&mut link, error)
    }

    /// Ends the group with `error`: aborts the communicator (so no peer is left waiting on
    /// this rank's side of a collective) and remembers the error. Returns the group's error
    /// (the first one, if it had already failed).
    fn fail(&self, link: &mut Link, error: CommError) -> CommError {
        if let Some(first) = &link.failure {
            return first.clone();
        }
        tracing::error!(rank = self.rank, %error, "NCCL group failed; aborting the communicator");
        link.comm = None; // Drop aborts.
        link.failure = Some(error.clone());
        self.family.fail(&error);
        if let Some(control) = &self.control {
            // Every other process hears of it (the store keeps only the job's first failure).
            control.abort(&error.to_string());
        }
        error
    }

    /// A rank of this process that finished its work before reaching `call`, which it will
    /// therefore never join.
    fn departed_before(&self, call: &CollectiveCall) -> Option<CommError> {
        self.departed
            .left_before(self.rank, call.seq)
            .map(|peer| CommError::PeerExited {
                peer,
                rank: self.rank,
                call: Box::new(call.clone()),
            })
    }

    fn nccl_error(&self, during: &str, failure: Failure) -> CommError {
        CommError::Nccl {
            rank: self.rank,
            during: during.to_string(),
            code: failure.code,
            detail: failure.detail,
        }
    }

    /// A device error of this rank, not yet recorded as the group's failure.
    fn device_error(&self, reason: String) -> CommError {
        CommError::Device {
            rank: self.rank,
            reason,
        }
    }

    /// Counts one wait of the host for the device, when the rank's counters were given.
    fn count_wait(&self) {
        if let Some(counters) = self.counters.get() {
            counters.engine_wait();
        }
    }

    /// Polls until `ready` says so, NCCL reports an error, an abort is requested, or the
    /// timeout (counted from `started`) passes; the last three fail the group. The group is
    /// locked for each poll only, so other collectives of the group can be queued meanwhile.
    /// Returns whether `ready` ever said no: whether the host had to wait.
    fn wait(
        &self,
        call: &CollectiveCall,
        started: Instant,
        mut ready: impl FnMut() -> Result<bool, CommError>,
    ) -> Result<bool, CommError> {
        let mut spins = 0u32;
        loop {
            {
                let mut link = self.lock();
                let polled = self.usable(&mut link)?.poll();
                match polled {
                    Err(failure) => {
                        let error = self.nccl_error(&call.to_string(), failure);
                        return Err(self.fail(&mut link, error));
                    }
                    Ok(Progress::Pending) => {}
                    Ok(Progress::Done) => match ready() {
                        Ok(true) => return Ok(spins > 0),
                        Ok(false) => {}
                        Err(error) => return Err(self.fail(&mut link, error)),
                    },
                }
                // Asked only of a call not done yet: a peer may leave once its side is done.
                if let Some(error) = self.departed_before(call) {
                    return Err(self.fail(&mut link, error));
                }
                let waited = started.elapsed();
                if waited >= self.options.timeout {
                    let error = CommError::Stalled {
                        rank: self.rank,
                        during: call.to_string(),
                        waited,
                    };
                    return Err(self.fail(&mut link, error));
                }
            }
            // Spin briefly (small collectives finish in microseconds), then back off.
            spins += 1;
            if spins < 200 {
                thread::yield_now();
            } else {
                thread::sleep(Duration::from_micros(if spins < 2000 { 20 } else { 200 }));
            }
        }
    }

    fn take_abort_request(&self) -> Option<String> {
        lock(&self.abort_request).take()
    }
}

/// Keeps a failed collective's buffers out of the memory pools for the rest of the process:
/// its queued work may still read or write them after the communicator was aborted, and a
/// failed group is not used again, so the memory is not needed back.
fn strand(held: Box<dyn Send>) {
    std::mem::forget(held);
}

/// NCCL's element type for a Burn dtype.
pub(crate) fn data_type(dtype: DType) -> Option<DataType> {
    match dtype {
        DType::F32 | DType::Flex32 => Some(DataType::F32),
        DType::F16 => Some(DataType::F16),
        DType::BF16 => Some(DataType::BF16),
        _ => None,
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        // A rank whose work ended says so, with its count of collectives, so that a rank
        // still waiting for it in a later collective fails at once. A panicking rank says
        // nothing here: its control connection reports the panic.
        if !thread::panicking() {
            self.leave();
        }
    }
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .field("failure", &self.failure())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_moves_the_float_dtypes_of_cuda() {
        assert_eq!(data_type(DType::F32), Some(DataType::F32));
        assert_eq!(data_type(DType::Flex32), Some(DataType::F32));
        assert_eq!(data_type(DType::F16), Some(DataType::F16));
        assert_eq!(data_type(DType::BF16), Some(DataType::BF16));
        for other in [DType::F64, DType::I32, DType::U8] {
            assert_eq!(data_type(other), None, "{other:?}");
        }
    }
}
