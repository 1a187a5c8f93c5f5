//! The MPI calls the engine makes, over rsmpi's raw bindings (`mpi::ffi`): communicators it
//! owns, non-blocking collectives on byte buffers, and the port calls that join separately
//! started processes. rsmpi's safe layer covers initialisation; what it lacks here is a
//! request that can be abandoned (its requests panic when dropped unfinished, and a failed
//! job must leave a collective behind) and the dynamic-process calls.
//!
//! Every call returns MPI's error code as a [`Failure`] with MPI's own text: the engine's
//! communicators answer errors instead of aborting the process (`MPI_ERRORS_RETURN`).

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use mpi::ffi;

/// Bytes in a port name, with its terminating zero (Open MPI's `MPI_MAX_PORT_NAME`).
const PORT_NAME_BYTES: usize = ffi::MPI_MAX_PORT_NAME as usize;

/// An MPI error: its code and MPI's text for it.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub call: &'static str,
    pub code: c_int,
    pub text: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed with MPI error {}: {}",
            self.call, self.code, self.text
        )
    }
}

/// `Ok` for `MPI_SUCCESS`, else the failure with MPI's text.
fn check(call: &'static str, code: c_int) -> Result<(), Failure> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut text = vec![0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `text` holds MPI_MAX_ERROR_STRING characters and a zero, as the call requires;
    // MPI_Error_string may be called at any time, even after an error.
    let known = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr(), &mut len) };
    let text = if known == ffi::MPI_SUCCESS as c_int {
        // SAFETY: MPI wrote a zero-terminated string into `text`, which outlives the borrow.
        unsafe { CStr::from_ptr(text.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    } else {
        "(no text for this code)".into()
    };
    Err(Failure { call, code, text })
}

/// A byte count as MPI's `int`; a collective moves at most 2 GiB per buffer.
pub(crate) fn count(bytes: usize) -> Option<c_int> {
    c_int::try_from(bytes).ok()
}

/// A communicator this engine owns: freed when dropped, unless it was abandoned because a
/// collective on it never finished.
#[derive(Debug)]
pub(crate) struct Comm {
    raw: ffi::MPI_Comm,
    /// `MPI_COMM_WORLD` and `MPI_COMM_SELF` are not ours to free.
    owned: bool,
}

// SAFETY: the process initialises MPI with MPI_THREAD_MULTIPLE (`super::process`), under which
// any thread may call MPI on any communicator; a communicator handle is a plain pointer that
// MPI synchronises itself.
unsafe impl Send for Comm {}
// SAFETY: as for `Send`: concurrent calls on one communicator are MPI_THREAD_MULTIPLE's to
// order; the engine issues one collective at a time per communicator anyway.
unsafe impl Sync for Comm {}

impl Comm {
    /// `MPI_COMM_WORLD`, not owned.
    pub fn world() -> Self {
        // SAFETY: a constant of the MPI library, read after MPI_Init (the caller holds the
        // initialised process).
        let raw = unsafe { ffi::RSMPI_COMM_WORLD };
        Comm { raw, owned: false }
    }

    /// `MPI_COMM_SELF`, not owned.
    pub fn this_process() -> Self {
        // SAFETY: as in `world`.
        let raw = unsafe { ffi::RSMPI_COMM_SELF };
        Comm { raw, owned: false }
    }

    fn adopt(raw: ffi::MPI_Comm) -> Result<Self, Failure> {
        let comm = Comm { raw, owned: true };
        comm.return_errors()?;
        Ok(comm)
    }

    /// Errors on this communicator are returned to the caller rather than ending the process,
    /// so that a failure reaches the other ranks through the control store and names its
    /// cause.
    pub fn return_errors(&self) -> Result<(), Failure> {
        // SAFETY: `raw` is a valid communicator; the error handler is a library constant.
        check("MPI_Comm_set_errhandler", unsafe {
            ffi::MPI_Comm_set_errhandler(self.raw, ffi::RSMPI_ERRORS_RETURN)
        })
    }

    /// This process's rank in the communicator.
    pub fn rank(&self) -> Result<usize, Failure> {
        let mut rank: c_int = 0;
        // SAFETY: `raw` is valid and `rank` is a place for one int.
        check("MPI_Comm_rank", unsafe {
            ffi::MPI_Comm_rank(self.raw, &mut rank)
        })?;
        Ok(rank as usize)
    }

    /// The number of processes in the communicator.
    pub fn size(&self) -> Result<usize, Failure> {
        let mut size: c_int = 0;
        // SAFETY: `raw` is valid and `size` is a place for one int.
        check("MPI_Comm_size", unsafe {
            ffi::MPI_Comm_size(self.raw, &mut size)
        })?;
        Ok(size as usize)
    }

    /// A new communicator over the same processes (collective).
    pub fn duplicate(&self) -> Result<Comm, Failure> {
        let mut raw = null_comm();
        // SAFETY: `raw` receives the new handle; `self.raw` is valid.
        check("MPI_Comm_dup", unsafe {
            ffi::MPI_Comm_dup(self.raw, &mut raw)
        })?;
        Comm::adopt(raw)
    }

    /// The processes that pass the same `color`, ranked by `key` (collective).
    pub fn split(&self, color: c_int, key: c_int) -> Result<Comm, Failure> {
        let mut raw = null_comm();
        // SAFETY: as in `duplicate`; colors are non-negative, so every process gets a group.
        check("MPI_Comm_split", unsafe {
            ffi::MPI_Comm_split(self.raw, color, key, &mut raw)
        })?;
        Comm::adopt(raw)
    }

    /// Accepts one process connecting to `port` (collective over this communicator; `port` is
    /// read at `root` only), and merges it in as the highest rank.
    pub fn accept_one(&self, port: &CStr, root: c_int) -> Result<Comm, Failure> {
        let mut inter = null_comm();
        // SAFETY: `port` is zero-terminated and outlives the call; the info object is the
        // library's null one; `inter` receives the intercommunicator.
        check("MPI_Comm_accept", unsafe {
            ffi::MPI_Comm_accept(
                port.as_ptr(),
                ffi::RSMPI_INFO_NULL,
                root,
                self.raw,
                &mut inter,
            )
        })?;
        merge(inter, false)
    }

    /// Connects this process (alone) to the processes accepting on `port`, and merges into
    /// them as the highest rank.
    pub fn connect(port: &CStr) -> Result<Comm, Failure> {
        let mut inter = null_comm();
        // SAFETY: as in `accept_one`, over MPI_COMM_SELF.
        check("MPI_Comm_connect", unsafe {
            ffi::MPI_Comm_connect(
                port.as_ptr(),
                ffi::RSMPI_INFO_NULL,
                0,
                ffi::RSMPI_COMM_SELF,
                &mut inter,
            )
        })?;
        merge(inter, true)
    }

    /// Starts `MPI_Iallgather` of `block` bytes from `send` into `recv` (`size · block`
    /// bytes).
    ///
    /// # Safety
    /// `send` must stay readable and `recv` writable, and neither may move or be freed, until
    /// the request completes (or forever, if it never does).
    pub unsafe fn all_gather(
        &self,
        send: *const u8,
        block: c_int,
        recv: *mut u8,
    ) -> Result<Request, Failure> {
        let mut request = null_request();
        // SAFETY: the caller keeps the buffers alive; the counts describe them.
        check("MPI_Iallgather", unsafe {
            ffi::MPI_Iallgather(
                send.cast::<c_void>(),
                block,
                ffi::RSMPI_UINT8_T,
                recv.cast::<c_void>(),
                block,
                ffi::RSMPI_UINT8_T,
                self.raw,
                &mut request,
            )
        })?;
        Ok(Request(request))
    }

    /// Starts `MPI_Ialltoallv`: block `i` of `send` (`send_counts[i]` bytes at
    /// `send_displs[i]`) goes to rank `i`, and rank `i`'s block for this rank lands at
    /// `recv_displs[i]` of `recv`.
    ///
    /// # Safety
    /// As for [`Comm::all_gather`], for both buffers and the four count arrays, which MPI
    /// reads until the request completes.
    pub unsafe fn all_to_all(
        &self,
        send: *const u8,
        recv: *mut u8,
        layout: &Layout,
    ) -> Result<Request, Failure> {
        let mut request = null_request();
        // SAFETY: the caller keeps buffers and layout alive; the layout describes them.
        check("MPI_Ialltoallv", unsafe {
            ffi::MPI_Ialltoallv(
                send.cast::<c_void>(),
                layout.send_counts.as_ptr(),
                layout.send_displs.as_ptr(),
                ffi::RSMPI_UINT8_T,
                recv.cast::<c_void>(),
                layout.recv_counts.as_ptr(),
                layout.recv_displs.as_ptr(),
                ffi::RSMPI_UINT8_T,
                self.raw,
                &mut request,
            )
        })?;
        Ok(Request(request))
    }

    /// Starts `MPI_Iallgatherv`: this rank's `send` (`layout.recv_counts[rank]` bytes) lands
    /// at `recv_displs[i]` of every rank's `recv` for `i` = this rank.
    ///
    /// # Safety
    /// As for [`Comm::all_to_all`].
    pub unsafe fn all_gather_varying(
        &self,
        send: *const u8,
        send_count: c_int,
        recv: *mut u8,
        layout: &Layout,
    ) -> Result<Request, Failure> {
        let mut request = null_request();
        // SAFETY: the caller keeps buffers and layout alive; the layout describes them.
        check("MPI_Iallgatherv", unsafe {
            ffi::MPI_Iallgatherv(
                send.cast::<c_void>(),
                send_count,
                ffi::RSMPI_UINT8_T,
                recv.cast::<c_void>(),
                layout.recv_counts.as_ptr(),
                layout.recv_displs.as_ptr(),
                ffi::RSMPI_UINT8_T,
                self.raw,
                &mut request,
            )
        })?;
        Ok(Request(request))
    }

    /// Starts `MPI_Ibcast` of `len` bytes of `buffer` from `root`.
    ///
    /// # Safety
    /// As for [`Comm::all_gather`].
    pub unsafe fn broadcast(
        &self,
        buffer: *mut u8,
        len: c_int,
        root: c_int,
    ) -> Result<Request, Failure> {
        let mut request = null_request();
        // SAFETY: the caller keeps the buffer alive.
        check("MPI_Ibcast", unsafe {
            ffi::MPI_Ibcast(
                buffer.cast::<c_void>(),
                len,
                ffi::RSMPI_UINT8_T,
                root,
                self.raw,
                &mut request,
            )
        })?;
        Ok(Request(request))
    }

    /// Starts `MPI_Ibarrier`.
    pub fn barrier(&self) -> Result<Request, Failure> {
        let mut request = null_request();
        // SAFETY: no buffer; `request` receives the handle.
        check("MPI_Ibarrier", unsafe {
            ffi::MPI_Ibarrier(self.raw, &mut request)
        })?;
        Ok(Request(request))
    }

    /// Leaves the communicator without freeing it: a collective on it may still be pending
    /// in MPI after the job failed, and freeing would wait for it.
    pub fn abandon(mut self) {
        self.owned = false;
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.owned && !mpi::environment::is_finalized() {
            // SAFETY: an owned communicator with no pending collective (a failed group
            // abandons its communicators instead); MPI is still initialised.
            let freed = unsafe { ffi::MPI_Comm_free(&mut self.raw) };
            if let Err(failure) = check("MPI_Comm_free", freed) {
                tracing::warn!(%failure, "could not free an MPI communicator");
            }
        }
    }
}

/// Merges an intercommunicator into one communicator, the remote group first when `high`.
fn merge(mut inter: ffi::MPI_Comm, high: bool) -> Result<Comm, Failure> {
    let mut merged = null_comm();
    // SAFETY: `inter` is the valid intercommunicator just made; `merged` receives the result.
    check("MPI_Intercomm_merge", unsafe {
        ffi::MPI_Intercomm_merge(inter, c_int::from(high), &mut merged)
    })?;
    // SAFETY: the intercommunicator is not used again.
    check("MPI_Comm_free", unsafe { ffi::MPI_Comm_free(&mut inter) })?;
    Comm::adopt(merged)
}

/// Block sizes and offsets of an all-to-all or a varying all-gather, in bytes.
#[derive(Debug, Clone, Default)]
pub(crate) struct Layout {
    pub send_counts: Vec<c_int>,
    pub send_displs: Vec<c_int>,
    pub recv_counts: Vec<c_int>,
    pub recv_displs: Vec<c_int>,
}

/// A pending non-blocking collective.
#[derive(Debug)]
pub(crate) struct Request(ffi::MPI_Request);

// SAFETY: a request handle may be tested from any thread under MPI_THREAD_MULTIPLE; one thread
// owns it at a time.
unsafe impl Send for Request {}

fn null_comm() -> ffi::MPI_Comm {
    // SAFETY: a library constant, read after MPI_Init.
    unsafe { ffi::RSMPI_COMM_NULL }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: a library constant, read after MPI_Init.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

impl Request {
    /// Whether the collective has completed; drives MPI's progress.
    pub fn test(&mut self) -> Result<bool, Failure> {
        let mut done: c_int = 0;
        // SAFETY: `self.0` is a live request (MPI sets it to the null request once complete,
        // and testing the null request answers "done"); the status is ignored.
        check("MPI_Test", unsafe {
            ffi::MPI_Test(&mut self.0, &mut done, ffi::RSMPI_STATUS_IGNORE)
        })?;
        Ok(done != 0)
    }
}

/// A port that separately started processes can connect to (`MPI_Open_port`), closed when
/// dropped.
pub(crate) struct Port {
    name: CString,
}

impl Port {
    /// Opens a port.
    pub fn open() -> Result<Self, Failure> {
        let mut name = vec![0 as c_char; PORT_NAME_BYTES];
        // SAFETY: `name` has MPI_MAX_PORT_NAME characters, as the call requires.
        check("MPI_Open_port", unsafe {
            ffi::MPI_Open_port(ffi::RSMPI_INFO_NULL, name.as_mut_ptr())
        })?;
        // SAFETY: MPI wrote a zero-terminated name into `name`.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_owned();
        Ok(Port { name })
    }

    /// The port's name, for the processes that connect.
    pub fn name(&self) -> &CStr {
        &self.name
    }
}

impl Drop for Port {
    fn drop(&mut self) {
        if mpi::environment::is_finalized() {
            return;
        }
        // SAFETY: the name MPI_Open_port gave; MPI only reads it.
        let closed = unsafe { ffi::MPI_Close_port(self.name.as_ptr()) };
        if let Err(failure) = check("MPI_Close_port", closed) {
            tracing::warn!(%failure, "could not close the MPI port");
        }
    }
}

/// The name of the machine this process runs on, as MPI knows it.
pub(crate) fn processor_name() -> Result<String, Failure> {
    let mut name = vec![0 as c_char; ffi::MPI_MAX_PROCESSOR_NAME as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `name` holds MPI_MAX_PROCESSOR_NAME characters and a zero.
    check("MPI_Get_processor_name", unsafe {
        ffi::MPI_Get_processor_name(name.as_mut_ptr(), &mut len)
    })?;
    // SAFETY: MPI wrote a zero-terminated name.
    Ok(unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}
