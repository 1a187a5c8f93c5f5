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
        .map_err(|f| name_shared_gpu(setup_error(rank, "ncclCommInitRankConfig", f)))?;
    let comm = finish_init(
        rank,
        comm,
        progress,
        started,
        options.init_timeout,
        "communicator creation",
    )
    .map_err(name_shared_gpu)?;
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

/// NCCL's refusal of two ranks of one communicator on one GPU, as [`CommError::GpuShared`]
/// with what allows it; any other error as it is.
fn name_shared_gpu(error: CommError) -> CommError {
    match error {
        // NCCL is loaded (it answered): asking its version cannot fail to load it.
        CommError::Nccl { ref detail, .. } if detail.contains("Duplicate GPU") => {
            name_shared_gpu_of(error, sys::version().ok())
        }
        other => other,
    }
}

/// [`name_shared_gpu`] for the NCCL of version code `version`.
fn name_shared_gpu_of(error: CommError, version: Option<i32>) -> CommError {
    match error {
        CommError::Nccl { rank, detail, .. } if detail.contains("Duplicate GPU") => {
            let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
            CommError::GpuShared {
                rank,
                version: version.map_or_else(|| "(version unknown)".into(), version_text),
                detail,
                remedy: shared_gpu_remedy(
                    version,
                    set("NCCL_MULTI_RANK_GPU_ENABLE"),
                    set("NCCL_HOSTID"),
                ),
            }
        }
        other => other,
    }
}

/// The first NCCL that reads `NCCL_MULTI_RANK_GPU_ENABLE`.
const MULTI_RANK_GPU_VERSION: i32 = 23007;

/// What lets several ranks share a GPU, given the loaded NCCL's version code and which of the
/// two variables this process has.
fn shared_gpu_remedy(version: Option<i32>, multi_rank_enabled: bool, host_id_set: bool) -> String {
    let usual = "give each rank a GPU of its own, or, to share one (for testing), set \
                 NCCL_HOSTID to a different value in every rank's process (`zero-run \
                 --share-gpu` does)";
    match version {
        Some(code) if code >= MULTI_RANK_GPU_VERSION => format!(
            "{usual}, or NCCL_MULTI_RANK_GPU_ENABLE=1 in every process{}",
            if multi_rank_enabled {
                " (it is set in this one: check the others)"
            } else {
                ""
            }
        ),
        _ if multi_rank_enabled => format!(
            "NCCL_MULTI_RANK_GPU_ENABLE is set, but only NCCL {} and later read it; {usual}",
            version_text(MULTI_RANK_GPU_VERSION)
        ),
        _ if host_id_set => format!(
            "NCCL_HOSTID is set in this process: it must differ between the ranks sharing the \
             GPU; {usual}"
        ),
        _ => usual.to_string(),
    }
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
    fn a_refused_shared_gpu_names_what_allows_it_with_the_loaded_nccl() {
        let old = shared_gpu_remedy(Some(22703), false, false);
        assert!(
            old.contains("NCCL_HOSTID") && !old.contains("ENABLE"),
            "{old}"
        );
        let too_old = shared_gpu_remedy(Some(22703), true, false);
        assert!(
            too_old.starts_with("NCCL_MULTI_RANK_GPU_ENABLE is set, but only NCCL 2.30.7"),
            "{too_old}"
        );
        let same_host = shared_gpu_remedy(Some(22703), false, true);
        assert!(same_host.contains("must differ"), "{same_host}");
        let new = shared_gpu_remedy(Some(23007), false, false);
        assert!(new.contains("NCCL_MULTI_RANK_GPU_ENABLE=1"), "{new}");

        let refused = CommError::Nccl {
            rank: 1,
            during: "communicator creation".into(),
            code: "ncclInvalidUsage".into(),
            detail: "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000".into(),
        };
        let named = name_shared_gpu_of(refused, Some(22703)).to_string();
        assert!(
            named.starts_with("rank 1: NCCL 2.27.3 refused several ranks on one GPU"),
            "{named}"
        );
        let other = CommError::Nccl {
            rank: 0,
            during: "x".into(),
            code: "ncclSystemError".into(),
            detail: "socket".into(),
        };
        assert_eq!(name_shared_gpu(other.clone()), other);
    }

    #[test]
    fn versions_read_as_text() {
        assert_eq!(version_text(21805), "2.18.5");
        assert_eq!(version_text(23000), "2.30.0");
    }
}
