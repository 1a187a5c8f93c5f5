//! Creating one communicator: NCCL's non-blocking init polled to the end under a deadline, and
//! the check that the libraries are there and recent enough. Both ways a group comes to be
//! (`init`) and a group splitting itself (`group`) create communicators this way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;

use super::NcclOptions;
use super::sys::{self, Progress, RawComm};
use crate::error::CommError;
use crate::libraries::CudaLibrary;

/// Creates this rank's communicator from a shared id, on `context`'s device.
pub(crate) fn init_comm(
    rank: usize,
    world_size: usize,
    context: &Arc<CudaContext>,
    id: &[u8; sys::UNIQUE_ID_BYTES],
    options: &NcclOptions,
) -> Result<RawComm, CommError> {
    context
        .bind_to_thread()
        .map_err(|error| CommError::Device {
            rank,
            reason: format!("CUDA: {error}"),
        })?;
    let started = Instant::now();
    let (comm, progress) = RawComm::init(world_size, rank, id)
        .map_err(|f| setup_error(rank, "ncclCommInitRankConfig", f))?;
    let comm = finish_init(
        rank,
        comm,
        progress,
        started,
        options.init_timeout,
        "communicator creation",
    )?;
    tracing::info!(rank, world_size, elapsed = ?started.elapsed(), "NCCL communicator created");
    Ok(comm)
}

/// Polls a communicator being created until it is ready; on an error or after `timeout` it is
/// aborted (dropped) and the error returned.
pub(crate) fn finish_init(
    rank: usize,
    comm: RawComm,
    mut progress: Progress,
    started: Instant,
    timeout: Duration,
    during: &str,
) -> Result<RawComm, CommError> {
    let mut backoff = sys::Backoff::new();
    while progress == Progress::Pending {
        progress = comm.poll().map_err(|f| setup_error(rank, during, f))?;
        if progress == Progress::Done {
            break;
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(CommError::Stalled {
                rank,
                during: during.to_string(),
                waited,
            });
        }
        backoff.wait();
    }
    Ok(comm)
}

/// The libraries are there (checked under the names `cudarc` will try, so that it cannot panic
/// on a missing one) and NCCL is recent enough.
pub(crate) fn ensure_nccl() -> Result<(), CommError> {
    crate::libraries::check(&CudaLibrary::ALL)?;
    let version = sys::version().map_err(|f| setup_error(0, "ncclGetVersion", f))?;
    if version < sys::MIN_VERSION {
        return Err(CommError::Unavailable(format!(
            "NCCL {} is too old: the engine needs 2.14 or newer (non-blocking communicators)",
            version_text(version)
        )));
    }
    Ok(())
}

/// `2.21.5` from NCCL's version code.
pub(crate) fn version_text(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, (code / 100) % 100, code % 100)
}

pub(crate) fn setup_error(rank: usize, during: &str, failure: sys::Failure) -> CommError {
    CommError::Nccl {
        rank,
        during: during.to_string(),
        code: failure.code,
        detail: failure.detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_text() {
        assert_eq!(version_text(21805), "2.18.5");
        assert_eq!(version_text(23000), "2.30.0");
    }
}
