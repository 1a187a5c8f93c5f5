//! The NCCL engine (feature `cuda`): [`NcclGroup`] implements [`crate::Communicator`] for
//! `CubeBackend<CudaRuntime, F, I, BT>` ([`CudaBackend`]) through `cudarc`'s NCCL bindings.
//!
//! - [`NcclGroup::local_group`] / [`launch_nccl`]: several GPUs of this process, one rank per
//!   thread.
//! - [`NcclGroup::from_env`] / [`NcclGroup::init`]: one rank per process, started by
//!   `zero-run` (or torchrun); rank 0 hands the NCCL unique id to the others over TCP
//!   ([`burn_zero_launch::Rendezvous`]).
//!
//! Nothing here needs CUDA at build time: `cudarc` loads `libcuda.so` and `libnccl.so` when
//! the first group is created, and a missing library is a [`CommError::MissingLibrary`] naming
//! it and how to provide it ([`crate::libraries`]).
//! Supported dtypes: f32 (and flex32, stored as f32), f16, bf16; anything else is a
//! [`CommError::UnsupportedDtype`].
//!
//! Both forms of the CUDA backend work: Burn's default `burn::backend::Cuda`, which is
//! `Fusion<CubeBackend<…>>` ([`FusedCudaBackend`]), and the plain [`CudaBackend`].

mod family;
mod flag;
mod fusion;
mod group;
mod init;
mod setup;
mod sys;

use std::time::Duration;

use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
pub use cubecl_cuda::{CudaDevice, CudaRuntime};

pub use fusion::FusedCudaBackend;
pub use group::NcclGroup;

use crate::error::{CommError, LaunchError};
use crate::launch::{RankContext, run_ranks};

/// The CUDA backend without Burn's fusion layer, which the NCCL engine works on.
pub type CudaBackend<F = f32, I = i32> = CubeBackend<CudaRuntime, F, I, u8>;

/// Timeouts of an NCCL group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclOptions {
    /// How long a collective may take before the rank aborts the communicator and fails with
    /// [`CommError::Stalled`].
    pub timeout: Duration,
    /// How long creating a communicator may take (every rank must join).
    pub init_timeout: Duration,
    /// How long the TCP rendezvous of a multi-process job may take.
    pub rendezvous_timeout: Duration,
    /// Compare every collective with the other ranks' through the job's control connection
    /// before NCCL sees it (multi-process jobs): a diverged schedule then fails with
    /// [`CommError::Mismatch`] naming both calls instead of hanging or reading past a buffer.
    /// Off by default: it costs one round trip to rank 0's store per collective, measured at
    /// 75–104 µs on the loopback of a 2-vCPU machine, 2–4% of a GPT training step at stage 3
    /// there (and more of a GPU's shorter step). Turn it on to debug a hang or a crash inside
    /// NCCL. Aborts travel over the connection either way.
    pub check_schedule: bool,
    /// Order each collective after its input's writers on the device, without the host
    /// waiting: a one-thread kernel on the issuing thread's stream writes an increasing number
    /// into a device flag after everything queued before it (cubecl has already ordered that
    /// stream after the input's writers on other threads' streams), and the group's stream
    /// waits for the number (`cuStreamWaitValue32`) before NCCL runs. The ranks' own threads
    /// then hand tensors over without a synchronisation either. On by default; off, each
    /// collective synchronises the issuing thread's stream first and each caller its own, as
    /// before (the fallback, and the comparison for the GPU check).
    pub order_on_device: bool,
}

impl Default for NcclOptions {
    /// Ten minutes per collective (as PyTorch's NCCL process groups), five to set up;
    /// schedules not compared (see [`NcclOptions::check_schedule`]).
    fn default() -> Self {
        NcclOptions {
            timeout: Duration::from_secs(600),
            init_timeout: Duration::from_secs(300),
            rendezvous_timeout: Duration::from_secs(300),
            check_schedule: false,
            order_on_device: true,
        }
    }
}

impl NcclOptions {
    /// Options with the given collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Options with schedule checks on or off.
    pub fn with_check_schedule(mut self, check_schedule: bool) -> Self {
        self.check_schedule = check_schedule;
        self
    }
}

/// Number of CUDA devices visible to this process: 0 when there is no driver library or the
/// driver reports no device (`CUDA_ERROR_NO_DEVICE`, as with `CUDA_VISIBLE_DEVICES=""`).
///
/// Any other driver error is returned, naming the driver's code: a driver that is installed
/// but broken (a version too old for this build, a device in a bad state) must not read as
/// "this machine has no GPU", or a GPU test would be skipped instead of failing.
pub fn cuda_device_count() -> Result<usize, CommError> {
    if !sys::driver_present() {
        return Ok(0);
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(count) => Ok(count.max(0) as usize),
        Err(error) if error.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => Ok(0),
        Err(error) => Err(CommError::Unavailable(format!(
            "the CUDA driver failed to count the devices: {error:?}"
        ))),
    }
}

/// Whether the NCCL engine can run here: the CUDA driver, NVRTC and NCCL load (under the names
/// [`crate::libraries`] lists) and NCCL is 2.14 or newer.
pub fn nccl_available() -> Result<(), CommError> {
    setup::ensure_nccl()
}

/// [`crate::launch()`] for NCCL: runs `rank_fn` once per device, each rank on its own thread with
/// its [`NcclGroup`], and returns the results in rank order. The ranks share one failure: a
/// rank that fails ends every rank's group at once (each aborts its communicator), and a rank
/// that finished leaves, so one still waiting for it fails with [`CommError::PeerExited`]
/// instead of waiting out its timeout.
pub fn launch_nccl<FE, IE, BT, F, T, E>(
    devices: &[CudaDevice],
    options: &NcclOptions,
    rank_fn: F,
) -> Result<Vec<T>, LaunchError>
where
    FE: FloatElement,
    IE: IntElement,
    BT: BoolElement,
    F: Fn(RankContext<CubeBackend<CudaRuntime, FE, IE, BT>>) -> Result<T, E> + Sync,
    T: Send,
    E: std::fmt::Display,
{
    let groups = NcclGroup::local_group(devices, options)
        .map_err(|e| LaunchError::Invalid(e.to_string()))?;
    run_ranks(groups, devices, NcclGroup::leave, rank_fn)
}
