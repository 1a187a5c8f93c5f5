//! How NCCL groups come to be: several GPUs of one process (one communicator per device from
//! one unique id, created in one NCCL group call, sharing one failure), or one rank per process
//! (the unique id handed out by the TCP rendezvous of `burn-zero-launch`, with the job's
//! control connection kept open beside it for aborts and schedule checks).

use std::sync::Arc;
use std::time::Instant;

use burn_zero_launch::DistEnv;
use burn_zero_launch::env::DeviceChoiceError;
use cubecl_cuda::CudaDevice;
use cudarc::driver::CudaContext;

use super::NcclOptions;
use super::family::Lineage;
use super::group::{Group, NcclGroup};
use super::setup::{ensure_nccl, finish_init, init_comm, setup_error};
use super::sys::{self, Progress, RawComm};
use crate::control::JobControl;
use crate::error::CommError;

impl NcclGroup {
    /// One group handle per device, in rank order, for ranks that run on threads of this
    /// process (give each handle to its rank's thread, or use [`super::launch_nccl`]).
    /// Devices must be distinct: NCCL refuses two ranks on one GPU.
    pub fn local_group(
        devices: &[CudaDevice],
        options: &NcclOptions,
    ) -> Result<Vec<NcclGroup>, CommError> {
        if devices.is_empty() {
            return Err(CommError::InvalidGroup("no CUDA device given".into()));
        }
        for (i, device) in devices.iter().enumerate() {
            if devices[..i].contains(device) {
                return Err(CommError::InvalidGroup(format!(
                    "{device:?} is given twice: NCCL runs one rank per GPU (use LocalGroup to \
                     run several ranks on one device)"
                )));
            }
        }
        ensure_nccl()?;
        let world_size = devices.len();
        let contexts = devices
            .iter()
            .enumerate()
            .map(|(rank, device)| context(rank, device))
            .collect::<Result<Vec<_>, _>>()?;
        let id = sys::unique_id().map_err(|f| setup_error(0, "ncclGetUniqueId", f))?;

        // One thread creates every communicator: inside an NCCL group, so that none of the
        // calls waits for the others.
        let started = Instant::now();
        sys::group_start().map_err(|f| setup_error(0, "ncclGroupStart", f))?;
        let mut comms = Vec::with_capacity(world_size);
        let mut started_error = None;
        for (rank, context) in contexts.iter().enumerate() {
            if let Err(error) = context.bind_to_thread() {
                started_error = Some(CommError::Device {
                    rank,
                    reason: format!("CUDA: {error}"),
                });
                break;
            }
            match RawComm::init(world_size, rank, &id) {
                Ok((comm, _)) => comms.push(comm),
                Err(failure) => {
                    started_error = Some(setup_error(rank, "ncclCommInitRankConfig", failure));
                    break;
                }
            }
        }
        let ended = sys::group_end();
        if let Some(error) = started_error {
            return Err(error); // Dropping `comms` aborts them.
        }
        let progress = ended.map_err(|f| setup_error(0, "ncclGroupEnd", f))?;
        let mut ready = Vec::with_capacity(world_size);
        for (rank, comm) in comms.into_iter().enumerate() {
            let waiting = if progress == Progress::Done {
                Progress::Pending // Poll once anyway: members report errors there.
            } else {
                progress
            };
            ready.push(finish_init(
                rank,
                comm,
                waiting,
                started,
                options.init_timeout,
                "communicator creation",
            )?);
        }
        tracing::info!(world_size, elapsed = ?started.elapsed(), "NCCL group created in this process");
        // One failure for the whole job: a rank that fails ends every rank's group.
        let family = NcclGroup::new_family();
        ready
            .into_iter()
            .zip(devices.iter().cloned().zip(contexts))
            .enumerate()
            .map(|(rank, (comm, (device, context)))| {
                Group::new(
                    rank,
                    world_size,
                    device,
                    options.clone(),
                    context,
                    comm,
                    family.clone(),
                    Lineage::new(),
                    None,
                )
                .map(NcclGroup::from)
            })
            .collect()
    }

    /// This process's rank of a multi-process job, from whichever launcher started it:
    /// zero-run, torchrun, `srun`, `mpirun`, `jsrun` or a Kubeflow pod ([`DistEnv::detect`]).
    /// The GPU is the one the process sees when it sees exactly one (schedulers that bind a
    /// GPU to each task show it as device 0, whatever the local rank), else GPU `LOCAL_RANK`
    /// ([`DistEnv::device_index`]); then the ranks meet at the master to share the NCCL
    /// unique id.
    pub fn from_env(options: &NcclOptions) -> Result<NcclGroup, CommError> {
        let detected = DistEnv::detect().map_err(|e| CommError::Rendezvous(e.to_string()))?;
        let env = &detected.env;
        // Counting devices loads libcuda, which cudarc cannot do without panicking when it is
        // missing: check the libraries by name first.
        ensure_nccl()?;
        let visible = CudaContext::device_count()
            .map_err(|error| CommError::Device {
                rank: env.rank,
                reason: format!("CUDA: {error}"),
            })?
            .max(0) as usize;
        let index = env
            .device_index(visible)
            .map_err(|error| device_choice_error(env.rank, error))?;
        tracing::info!(
            launcher = %detected.source,
            rank = env.rank,
            local_rank = env.local_rank,
            visible,
            device = index,
            "GPU chosen"
        );
        NcclGroup::init(env, CudaDevice::new(index), options)
    }

    /// Rank `env.rank` of a multi-process job on `device`: rank 0 makes the NCCL unique id and
    /// serves it over TCP; the others fetch it; then every rank creates its communicator.
    ///
    /// Rank 0 also starts the job's control store (on a port the system picks, sent along with
    /// the id) and every rank keeps a connection to it for the group's life: a rank that fails
    /// stops every rank of the job, and with [`NcclOptions::check_schedule`] every call is
    /// compared across ranks before NCCL sees it.
    pub fn init(
        env: &DistEnv,
        device: CudaDevice,
        options: &NcclOptions,
    ) -> Result<NcclGroup, CommError> {
        ensure_nccl()?;
        let rank = env.rank;
        let context = context(rank, &device)?;
        let id = if rank == 0 {
            Some(sys::unique_id().map_err(|f| setup_error(rank, "ncclGetUniqueId", f))?)
        } else {
            None
        };
        let (bytes, client) =
            burn_zero_launch::establish(env, options.rendezvous_timeout, None, || {
                id.map(|id| id.to_vec()).unwrap_or_default()
            })
            .map_err(|e| CommError::Rendezvous(e.to_string()))?;
        let id = <[u8; sys::UNIQUE_ID_BYTES]>::try_from(bytes.as_slice()).map_err(|_| {
            CommError::Rendezvous(format!(
                "rank 0 sent {} bytes, an NCCL unique id has {}",
                bytes.len(),
                sys::UNIQUE_ID_BYTES
            ))
        })?;
        tracing::debug!(%env, store = client.endpoint(), "NCCL unique id shared");
        let control = Arc::new(JobControl::new(
            client,
            options.check_schedule,
            options.timeout,
        ));
        let comm = match init_comm(rank, env.world_size, &context, &id, options) {
            Ok(comm) => comm,
            Err(error) => {
                control.abort(&error.to_string());
                return Err(error);
            }
        };
        Group::new(
            rank,
            env.world_size,
            device,
            options.clone(),
            context,
            comm,
            NcclGroup::new_family(),
            Lineage::new(),
            Some(control),
        )
        .map(NcclGroup::from)
    }
}

fn context(rank: usize, device: &CudaDevice) -> Result<Arc<CudaContext>, CommError> {
    let count = CudaContext::device_count().map_err(|error| CommError::Device {
        rank,
        reason: format!("CUDA: {error}"),
    })?;
    if device.index >= count.max(0) as usize {
        return Err(CommError::NoSuchDevice {
            rank,
            device: format!("{device:?}"),
            visible: count.max(0) as usize,
        });
    }
    CudaContext::new(device.index).map_err(|error| CommError::Device {
        rank,
        reason: format!("CUDA on {device:?}: {error}"),
    })
}

/// No device, or a device layout that names none for this rank.
fn device_choice_error(rank: usize, error: DeviceChoiceError) -> CommError {
    match error {
        DeviceChoiceError::NoDevice => CommError::Unavailable(format!("rank {rank}: {error}")),
        DeviceChoiceError::Ambiguous { .. } => {
            CommError::InvalidGroup(format!("rank {rank}: {error}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_given_twice_is_refused_before_any_cuda_call() {
        let devices = [CudaDevice::new(0), CudaDevice::new(0)];
        let error = NcclGroup::local_group(&devices, &NcclOptions::default()).unwrap_err();
        assert!(error.to_string().contains("given twice"), "{error}");
    }
}
