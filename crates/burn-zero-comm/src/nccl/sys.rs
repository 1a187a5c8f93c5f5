//! The FFI edge of the NCCL engine: NCCL's C API through `cudarc`'s raw bindings
//! (`cudarc::nccl::sys`, loaded from `libnccl.so` at run time). Every `unsafe` block of the
//! engine lives in this module; the rest of the engine sees [`RawComm`] and plain results.
//!
//! Communicators are created non-blocking (`ncclConfig_t::blocking = 0`): creation and
//! collectives return at once, possibly with `ncclInProgress`, and the caller polls
//! [`RawComm::poll`] with its own timeout. That is what lets a rank give up and abort instead of
//! waiting forever for a peer that died.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use cudarc::nccl::sys;

/// Size of an NCCL unique id, the blob rank 0 hands to every rank.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// NCCL's version code for `major.minor.patch` (the `NCCL_VERSION` macro for 2.9 and later).
pub(crate) const fn version_code(major: i32, minor: i32, patch: i32) -> i32 {
    major * 10000 + minor * 100 + patch
}

/// The oldest NCCL the engine runs with: non-blocking communicators (`ncclCommInitRankConfig`)
/// arrived in 2.14.
pub(crate) const MIN_VERSION: i32 = version_code(2, 14, 0);
/// `ncclCommSplit` arrived in 2.18.
pub(crate) const SPLIT_VERSION: i32 = version_code(2, 18, 0);
/// The layout of `ncclConfig_t` in the bindings (NCCL 2.30). A library of another version reads
/// the fields it knows: NCCL copies at most its own `sizeof(ncclConfig_t)` and fills fields
/// newer than `version` with defaults.
const CONFIG_VERSION: u32 = version_code(2, 30, 0) as u32;
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: let NCCL choose.
const UNDEF: c_int = c_int::MIN;

/// An NCCL error: the result code's name and NCCL's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    pub code: String,
    pub detail: String,
}

/// Whether an asynchronous NCCL step has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    Done,
    Pending,
}

/// Element types NCCL moves for the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DataType {
    F32,
    F16,
    BF16,
}

impl DataType {
    /// Bytes per element.
    pub(crate) fn size(self) -> usize {
        match self {
            DataType::F32 => 4,
            DataType::F16 | DataType::BF16 => 2,
        }
    }

    fn raw(self) -> sys::ncclDataType_t {
        match self {
            DataType::F32 => sys::ncclDataType_t::ncclFloat32,
            DataType::F16 => sys::ncclDataType_t::ncclFloat16,
            DataType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        }
    }
}

/// Element-wise reductions NCCL performs for the engine (mean is a sum, divided afterwards).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RedOp {
    Sum,
    Max,
    Min,
}

impl RedOp {
    fn raw(self) -> sys::ncclRedOp_t {
        match self {
            RedOp::Sum => sys::ncclRedOp_t::ncclSum,
            RedOp::Max => sys::ncclRedOp_t::ncclMax,
            RedOp::Min => sys::ncclRedOp_t::ncclMin,
        }
    }
}

/// A device address (`CUdeviceptr`) of a buffer the caller keeps alive until the operation
/// using it has completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevicePtr(pub u64);

impl DevicePtr {
    fn as_const(self) -> *const c_void {
        self.0 as usize as *const c_void
    }
    fn as_mut(self) -> *mut c_void {
        self.0 as usize as *mut c_void
    }
}

/// A CUDA stream handle, as `cudarc`'s driver bindings hand it out.
pub(crate) type Stream = cudarc::driver::sys::CUstream;

/// Whether the CUDA driver library can be loaded (`cudarc` panics on the first call into a
/// library it cannot find).
pub(crate) fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to `dlopen` the library's candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The loaded library's version code.
pub(crate) fn version() -> Result<i32, Failure> {
    let mut version: c_int = 0;
    // SAFETY: `version` is a valid, writable `int` for the duration of the call.
    let result = unsafe { sys::ncclGetVersion(&mut version) };
    check(result, None)?;
    Ok(version)
}

/// A fresh unique id (rank 0 makes it; every rank of the new communicator needs it).
pub(crate) fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], Failure> {
    let mut id = MaybeUninit::<sys::ncclUniqueId>::uninit();
    // SAFETY: `id` points to writable memory of the size of `ncclUniqueId`, which
    // `ncclGetUniqueId` fills entirely when it succeeds; it is only read after success.
    let id = unsafe {
        check(sys::ncclGetUniqueId(id.as_mut_ptr()), None)?;
        id.assume_init()
    };
    Ok(id.internal.map(|c| c as u8))
}

/// Makes `stream` wait on the device until the 32-bit word at `flag` is at least `value`
/// (`cuStreamWaitValue32`): work queued on `stream` afterwards starts only then. The host does
/// not wait.
pub(crate) fn wait_value(stream: Stream, flag: DevicePtr, value: u32) -> Result<(), Failure> {
    use cudarc::driver::sys as cu;
    // SAFETY: `stream` is a live stream of the current context and `flag` a device address of
    // that context holding a 4-byte-aligned word, alive until the wait is over (the caller's
    // group owns it for its whole life).
    let result = unsafe {
        cu::cuStreamWaitValue32_v2(
            stream,
            flag.0,
            value,
            cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
    };
    match result {
        cu::cudaError_enum::CUDA_SUCCESS => Ok(()),
        error => Err(Failure {
            code: format!("{error:?}"),
            detail: "cuStreamWaitValue32 on the group's stream".into(),
        }),
    }
}

/// Opens a group of NCCL calls (several communicators initialised from one thread, or the
/// sends and receives of one all-to-all).
pub(crate) fn group_start() -> Result<(), Failure> {
    // SAFETY: no arguments; NCCL keeps the group state per thread.
    check(unsafe { sys::ncclGroupStart() }, None).map(|_| ())
}

/// Closes the group opened by [`group_start`]; with non-blocking communicators the members
/// may still be initialising ([`Progress::Pending`]): poll each one.
pub(crate) fn group_end() -> Result<Progress, Failure> {
    // SAFETY: no arguments; closes this thread's group.
    check(unsafe { sys::ncclGroupEnd() }, None)
}

/// An owned NCCL communicator. Dropping it aborts it (`ncclCommAbort`): that frees its
/// resources without waiting for any other rank, so a drop never hangs. The engine only drops
/// a communicator once its last operation has completed or failed.
#[derive(Debug)]
pub(crate) struct RawComm {
    comm: sys::ncclComm_t,
    /// Where NCCL was told to store the communicator. Its creation runs as an asynchronous job
    /// that stores the handle there again when it finishes, from NCCL's own thread and, for a
    /// non-blocking communicator, after the creating call has returned; a split stores it
    /// there only then. So the slot lives on the heap, as long as the communicator.
    _slot: Slot,
}

/// The heap cell NCCL writes a new communicator's handle into (see [`RawComm`]).
type Slot = Box<AtomicPtr<sys::ncclComm>>;

/// The pause between two polls of an NCCL step still under way: 50 µs, doubling up to 10 ms,
/// so a quick step is seen at once and a slow one costs little CPU.
pub(crate) struct Backoff {
    pause: Duration,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self {
            pause: Duration::from_micros(50),
        }
    }

    /// Sleeps for the current pause, and doubles the next.
    pub(crate) fn wait(&mut self) {
        thread::sleep(self.pause);
        self.pause = (self.pause * 2).min(Duration::from_millis(10));
    }
}

/// What [`RawComm::split`] came to.
pub(crate) enum Split {
    /// The new communicator, still to be polled until [`Progress::Done`].
    Started(RawComm, Progress),
    /// The parent was still creating it when the time given ran out.
    Stalled,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the engine
// keeps each `RawComm` behind a mutex (or on the one thread that creates it), so calls on one
// communicator never overlap.
unsafe impl Send for RawComm {}

impl RawComm {
    /// Starts creating rank `rank` of a communicator of `world_size` ranks on the CUDA device
    /// current on this thread. The communicator is non-blocking: poll it until
    /// [`Progress::Done`].
    pub(crate) fn init(
        world_size: usize,
        rank: usize,
        id: &[u8; UNIQUE_ID_BYTES],
    ) -> Result<(RawComm, Progress), Failure> {
        let (Ok(world_size), Ok(rank)) = (c_int::try_from(world_size), c_int::try_from(rank))
        else {
            return Err(Failure {
                code: "ncclInvalidArgument".into(),
                detail: "rank or world size out of range".into(),
            });
        };
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut config = nonblocking_config();
        let slot: Slot = Box::new(AtomicPtr::new(std::ptr::null_mut()));
        // SAFETY: `slot` is valid for writes until the communicator it receives is aborted (it
        // moves into the `RawComm`, or is leaked below), which covers NCCL's late store from
        // its init thread; `config` is initialised as NCCL_CONFIG_INITIALIZER would (size,
        // magic, version, every other field undefined) with `blocking = 0`, and NCCL copies it
        // before returning. The caller made the device's context current on this thread.
        let result = unsafe {
            sys::ncclCommInitRankConfig(slot.as_ptr(), world_size, id, rank, &mut config)
        };
        let comm = slot.load(Ordering::Acquire);
        if comm.is_null() {
            // Nothing to abort: report the failure (or NCCL's silence) as is. A job that was
            // started may still write the slot.
            Box::leak(slot);
            check(result, None)?;
            return Err(Failure {
                code: "ncclInternalError".into(),
                detail: "ncclCommInitRankConfig returned no communicator".into(),
            });
        }
        let raw = RawComm { comm, _slot: slot };
        let progress = check(result, Some(raw.comm))?;
        Ok((raw, progress))
    }

    /// Creates a communicator over the ranks of `self` that pass the same `color`, in their
    /// order in `self` (`ncclCommSplit`, keyed by rank); one color for all ranks makes a
    /// duplicate. Collective: every rank calls it. The split runs as a job of the parent, which
    /// stores the new handle only when it has finished: this polls the parent until then, or
    /// until `timeout` has passed since `started`; the new communicator may still be
    /// connecting ([`Progress::Pending`]).
    pub(crate) fn split(
        &self,
        color: usize,
        rank: usize,
        started: Instant,
        timeout: Duration,
    ) -> Result<Split, Failure> {
        let color = c_int::try_from(color).map_err(|_| Failure {
            code: "ncclInvalidArgument".into(),
            detail: format!("split color {color} does not fit NCCL's int"),
        })?;
        let key = c_int::try_from(rank).unwrap_or(c_int::MAX);
        let mut config = nonblocking_config();
        let slot: Slot = Box::new(AtomicPtr::new(std::ptr::null_mut()));
        // SAFETY: `self.comm` is a live communicator (owned by `self`); `slot` stays valid for
        // writes until the new communicator is aborted (it moves into the `RawComm`, or is
        // leaked when waiting stops), which covers NCCL's store from its own thread; `config`
        // is valid for the call, as in `init`.
        let result =
            unsafe { sys::ncclCommSplit(self.comm, color, key, slot.as_ptr(), &mut config) };
        if let Err(failure) = check(result, Some(self.comm)) {
            Box::leak(slot);
            return Err(failure);
        }
        let mut backoff = Backoff::new();
        let comm = loop {
            let comm = slot.load(Ordering::Acquire);
            if !comm.is_null() {
                break comm;
            }
            match self.poll() {
                Ok(Progress::Pending) => {}
                // The parent has finished the job; the handle is stored before that.
                Ok(Progress::Done) => {
                    let comm = slot.load(Ordering::Acquire);
                    if comm.is_null() {
                        Box::leak(slot);
                        return Err(Failure {
                            code: "ncclInternalError".into(),
                            detail: "ncclCommSplit finished without a communicator".into(),
                        });
                    }
                    break comm;
                }
                Err(failure) => {
                    Box::leak(slot);
                    return Err(failure);
                }
            }
            if started.elapsed() >= timeout {
                Box::leak(slot);
                return Ok(Split::Stalled);
            }
            backoff.wait();
        };
        let raw = RawComm { comm, _slot: slot };
        let progress = raw.poll()?;
        Ok(Split::Started(raw, progress))
    }

    /// The communicator's state: [`Progress::Pending`] while creation or an enqueue is still
    /// under way, an error once anything failed (including a peer's failure NCCL noticed).
    pub(crate) fn poll(&self) -> Result<Progress, Failure> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `self.comm` is live; `state` is valid for writes.
        let result = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        check(result, Some(self.comm))?;
        check(state, Some(self.comm))
    }

    /// Enqueues an all-gather of `count` elements per rank from `send` into `recv` (which
    /// holds `count · world_size` elements) on `stream`.
    pub(crate) fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        stream: Stream,
    ) -> Result<Progress, Failure> {
        // SAFETY: the caller guarantees that `send` holds `count` and `recv` `count ·
        // world_size` elements of `dtype` on this communicator's device, both alive until the
        // operation completes on `stream`, a live stream of the same context.
        let result = unsafe {
            sys::ncclAllGather(
                send.as_const(),
                recv.as_mut(),
                count,
                dtype.raw(),
                self.comm,
                stream as sys::cudaStream_t,
            )
        };
        check(result, Some(self.comm))
    }

    /// Enqueues a reduce-scatter: `send` holds `count · world_size` elements, `recv` receives
    /// this rank's `count`.
    pub(crate) fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        op: RedOp,
        stream: Stream,
    ) -> Result<Progress, Failure> {
        // SAFETY: as in `all_gather`, with `send` of `count · world_size` elements and `recv`
        // of `count`.
        let result = unsafe {
            sys::ncclReduceScatter(
                send.as_const(),
                recv.as_mut(),
                count,
                dtype.raw(),
                op.raw(),
                self.comm,
                stream as sys::cudaStream_t,
            )
        };
        check(result, Some(self.comm))
    }

    /// Enqueues an all-reduce of `count` elements from `send` into `recv`.
    pub(crate) fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        op: RedOp,
        stream: Stream,
    ) -> Result<Progress, Failure> {
        // SAFETY: as in `all_gather`, with `count` elements in both buffers.
        let result = unsafe {
            sys::ncclAllReduce(
                send.as_const(),
                recv.as_mut(),
                count,
                dtype.raw(),
                op.raw(),
                self.comm,
                stream as sys::cudaStream_t,
            )
        };
        check(result, Some(self.comm))
    }

    /// Enqueues a broadcast of `count` elements from `root`'s `send` into every rank's `recv`.
    /// Sends block `peer` of `send` to every `peer` and receives block `peer` of `recv` from
    /// it, `count` elements a block and `world_size` blocks: NCCL's all-to-all, a group of one
    /// send and one receive per peer (this rank's own block included, which NCCL copies).
    pub(crate) fn all_to_all(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        world_size: usize,
        dtype: DataType,
        stream: Stream,
    ) -> Result<Progress, Failure> {
        let block = (count * dtype.size()) as u64;
        group_start()?;
        let mut queued = Ok(());
        for peer in 0..world_size {
            let peer_rank = c_int::try_from(peer).unwrap_or(c_int::MAX);
            let offset = block * peer as u64;
            // SAFETY: the caller guarantees that `send` and `recv` each hold `count ·
            // world_size` elements of `dtype` on this communicator's device, alive until the
            // operation completes on `stream`; block `peer` starts `offset` bytes in, inside
            // both. Inside a group NCCL only records the calls; they run at `group_end`.
            let result = unsafe {
                let sent = sys::ncclSend(
                    DevicePtr(send.0 + offset).as_const(),
                    count,
                    dtype.raw(),
                    peer_rank,
                    self.comm,
                    stream as sys::cudaStream_t,
                );
                // A nonblocking communicator may answer "in progress" inside a group too: the
                // send is recorded then, and its receive must follow, or the peers' sends
                // would have nothing to meet.
                if matches!(
                    sent,
                    sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                ) {
                    sys::ncclRecv(
                        DevicePtr(recv.0 + offset).as_mut(),
                        count,
                        dtype.raw(),
                        peer_rank,
                        self.comm,
                        stream as sys::cudaStream_t,
                    )
                } else {
                    sent
                }
            };
            if let Err(failure) = check(result, Some(self.comm)) {
                queued = Err(failure);
                break;
            }
        }
        // The group is closed whatever happened inside it, so the next call starts afresh.
        let ended = group_end();
        queued?;
        ended
    }

    pub(crate) fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: Stream,
    ) -> Result<Progress, Failure> {
        let root = c_int::try_from(root).unwrap_or(c_int::MAX);
        // SAFETY: as in `all_gather`, with `count` elements in both buffers.
        let result = unsafe {
            sys::ncclBroadcast(
                send.as_const(),
                recv.as_mut(),
                count,
                dtype.raw(),
                root,
                self.comm,
                stream as sys::cudaStream_t,
            )
        };
        check(result, Some(self.comm))
    }
}

impl RawComm {
    /// Ends a communicator whose work is over the way NCCL asks for: finalized (its pending
    /// network work flushed, so a peer still receiving what this rank sent gets it) and then
    /// destroyed. Over the socket transport a rank's kernels can end while its proxy still
    /// sends their last chunks; an abort then could cut a slower peer short. Where finalizing
    /// fails or takes longer than `within` (a peer gone), the communicator is aborted instead.
    pub(crate) fn finish(mut self, within: Duration) {
        // SAFETY: `self.comm` is live and owned by `self`, and no other call on it runs (the
        // caller gave up its last reference).
        let started = unsafe { sys::ncclCommFinalize(self.comm) };
        let mut state = started;
        let deadline = Instant::now() + within;
        let mut backoff = Backoff::new();
        while state == sys::ncclResult_t::ncclInProgress && Instant::now() < deadline {
            backoff.wait();
            // SAFETY: as above; NCCL writes the communicator's state into `state`.
            let queried = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            if queried != sys::ncclResult_t::ncclSuccess {
                state = queried;
            }
        }
        if state != sys::ncclResult_t::ncclSuccess {
            tracing::warn!(code = ?state, "finalizing an NCCL communicator failed; aborting it");
            return; // Drop aborts.
        }
        // SAFETY: as above; the communicator is finalized, and after this call it is never
        // used again (the handle is cleared, so the drop below does nothing).
        let result = unsafe { sys::ncclCommDestroy(self.comm) };
        if result == sys::ncclResult_t::ncclSuccess {
            self.comm = std::ptr::null_mut();
        } else {
            tracing::warn!(code = ?result, "ncclCommDestroy failed; aborting the communicator");
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return; // Destroyed by `finish`.
        }
        // SAFETY: `self.comm` is live and owned by `self`; after this call it is never used
        // again. `ncclCommAbort` does not wait for other ranks.
        let result = unsafe { sys::ncclCommAbort(self.comm) };
        if result != sys::ncclResult_t::ncclSuccess {
            tracing::warn!(code = ?result, "ncclCommAbort failed");
        }
    }
}

/// What `NCCL_CONFIG_INITIALIZER` sets, with `blocking = 0`.
fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// Turns an NCCL result into progress or a [`Failure`] with NCCL's message.
fn check(result: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> Result<Progress, Failure> {
    match result {
        sys::ncclResult_t::ncclSuccess => Ok(Progress::Done),
        sys::ncclResult_t::ncclInProgress => Ok(Progress::Pending),
        error => Err(Failure {
            code: format!("{error:?}"),
            detail: last_error(comm),
        }),
    }
}

/// NCCL's description of the last error (on `comm`, or of the library).
fn last_error(comm: Option<sys::ncclComm_t>) -> String {
    let comm = comm.unwrap_or(std::ptr::null_mut());
    // SAFETY: `comm` is live or null (both accepted); NCCL returns a pointer to a
    // NUL-terminated string it owns (or null), which is copied out at once.
    unsafe {
        let text = sys::ncclGetLastError(comm);
        if text.is_null() {
            String::new()
        } else {
            CStr::from_ptr(text).to_string_lossy().trim().to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_follow_nccl() {
        assert_eq!(version_code(2, 14, 0), 21400);
        assert_eq!(version_code(2, 18, 3), 21803);
        const { assert!(MIN_VERSION < SPLIT_VERSION) };
    }

    #[test]
    fn config_is_the_nonblocking_initializer() {
        let config = nonblocking_config();
        assert_eq!(config.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(config.magic, 0xcafebeef);
        assert_eq!(config.blocking, 0);
        assert_eq!(config.minCTAs, i32::MIN);
        assert!(config.netName.is_null());
    }
}
