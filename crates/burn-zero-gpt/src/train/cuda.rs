//! `--backend cuda`: the ranks of a CUDA run talk through NCCL (`NcclGroup`).
//!
//! - Started by a launcher (`zero-run`, torchrun, Slurm's `srun`, an MPI launcher; see
//!   `DistEnv`), this process is one rank on the GPU the launcher gives it, and the world size
//!   is the job's.
//! - Otherwise the process runs `--world-size` ranks itself, one thread per GPU
//!   (`launch_nccl`); NCCL refuses two ranks on one GPU, so that needs as many visible GPUs.

use std::sync::Arc;

use burn_zero_comm::Communicator;
use burn_zero_comm::nccl::{
    CudaBackend, CudaDevice, NcclGroup, NcclOptions, cuda_device_count, launch_nccl,
};
use burn_zero_launch::DistEnv;

use super::{RankFn, RankOutcome};

/// The backend of `--backend cuda`: what `Zero` wraps and NCCL moves tensors of.
pub type Backend = CudaBackend;

/// Where this process's CUDA ranks come from.
pub enum CudaRanks {
    /// One rank of a multi-process job.
    Process(Box<NcclGroup>),
    /// One rank per device, on threads of this process.
    Devices(Vec<CudaDevice>),
}

impl CudaRanks {
    /// This process's ranks: from the launcher's environment when there is one, otherwise
    /// `world_size` GPUs of this machine.
    pub fn new(world_size: usize) -> Result<Self, String> {
        let visible = cuda_device_count().map_err(|e| format!("--backend cuda: {e}"))?;
        if visible == 0 {
            return Err("--backend cuda: no CUDA device is visible".into());
        }
        if DistEnv::is_launched() {
            let group = NcclGroup::from_env(&NcclOptions::default())
                .map_err(|e| format!("--backend cuda: joining the NCCL job: {e}"))?;
            return Ok(CudaRanks::Process(Box::new(group)));
        }
        if world_size > visible {
            return Err(format!(
                "--backend cuda --world-size {world_size}: {visible} CUDA device(s) visible, and \
                 NCCL needs one GPU per rank (start one process per GPU with zero-run, or lower \
                 --world-size)"
            ));
        }
        Ok(CudaRanks::Devices(
            (0..world_size).map(CudaDevice::new).collect(),
        ))
    }

    /// Ranks in the whole job.
    pub fn world_size(&self) -> usize {
        match self {
            CudaRanks::Process(group) => Communicator::<Backend>::world_size(group.as_ref()),
            CudaRanks::Devices(devices) => devices.len(),
        }
    }

    /// The device the model is initialised on: this process's GPU, or the first one.
    pub fn device(&self) -> CudaDevice {
        match self {
            CudaRanks::Process(group) => group.device().clone(),
            CudaRanks::Devices(devices) => devices[0].clone(),
        }
    }

    /// Runs `rank_fn` for each rank of this process; the ranks argument of `train_with`.
    pub fn run(self, rank_fn: &RankFn<'_, Backend>) -> Result<Vec<RankOutcome>, String> {
        match self {
            CudaRanks::Process(group) => {
                let device = group.device().clone();
                let comm: Arc<dyn Communicator<Backend>> = Arc::new(*group);
                super::process::run_one(device, comm, rank_fn)
            }
            CudaRanks::Devices(devices) => {
                launch_nccl::<f32, i32, u8, _, _, _>(&devices, &NcclOptions::default(), rank_fn)
                    .map_err(|e| e.to_string())
            }
        }
    }
}
