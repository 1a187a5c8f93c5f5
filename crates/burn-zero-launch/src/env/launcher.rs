//! [`EnvSource`]: the launchers whose variables burn-zero reads, with their names and what to
//! do when one of their variables is missing.

use std::fmt;

/// A launcher whose variables [`crate::DistEnv`] can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EnvSource {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, as
    /// zero-run, torchrun and torchelastic set them (or a user by hand).
    Torchrun,
    /// Kubeflow's PyTorchJob: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` in each pod,
    /// one rank per pod and no `LOCAL_RANK`.
    Kubeflow,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE`.
    OpenMpi,
    /// MPICH's and Intel MPI's Hydra (`mpiexec`): `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`,
    /// `MPI_LOCALNRANKS`.
    Pmi,
    /// IBM LSF's `jsrun`: `JSM_NAMESPACE_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE`, with
    /// `LSB_JOBID` and `LSB_MCPU_HOSTS`.
    Lsf,
    /// Slurm's `srun`: `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_STEP_NUM_TASKS`,
    /// `SLURM_STEP_NODELIST`, `SLURM_STEP_TASKS_PER_NODE`, `SLURM_JOB_ID`, `SLURM_STEP_ID`.
    Slurm,
}

impl EnvSource {
    /// Every launcher, innermost first: the order in which detection prefers them.
    pub const ALL: [EnvSource; 6] = [
        EnvSource::Torchrun,
        EnvSource::Kubeflow,
        EnvSource::OpenMpi,
        EnvSource::Pmi,
        EnvSource::Lsf,
        EnvSource::Slurm,
    ];

    /// The short name `BURN_ZERO_LAUNCHER` and `from_str` take.
    pub fn name(self) -> &'static str {
        match self {
            EnvSource::Torchrun => "torchrun",
            EnvSource::Kubeflow => "kubeflow",
            EnvSource::OpenMpi => "openmpi",
            EnvSource::Pmi => "pmi",
            EnvSource::Lsf => "lsf",
            EnvSource::Slurm => "slurm",
        }
    }

    /// What to do when one of this launcher's variables is missing.
    pub(crate) fn missing_help(self) -> &'static str {
        match self {
            EnvSource::Torchrun => {
                "start the ranks with `zero-run` (or torchrun), or set RANK, WORLD_SIZE, \
                 LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself"
            }
            EnvSource::Kubeflow => {
                "a Kubeflow PyTorchJob sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in \
                 every pod"
            }
            EnvSource::OpenMpi => "start the ranks with Open MPI's mpirun (or mpiexec)",
            EnvSource::Pmi => {
                "start the ranks with MPICH's or Intel MPI's mpiexec (Hydra), which sets \
                 PMI_RANK, PMI_SIZE and MPI_LOCALRANKID"
            }
            EnvSource::Lsf => {
                "start the ranks with jsrun, which sets JSM_NAMESPACE_RANK, JSM_NAMESPACE_SIZE \
                 and JSM_NAMESPACE_LOCAL_RANK"
            }
            EnvSource::Slurm => {
                "start the ranks with srun, which sets SLURM_PROCID, SLURM_LOCALID, \
                 SLURM_STEP_ID and SLURM_STEP_NUM_TASKS"
            }
        }
    }
}

impl fmt::Display for EnvSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EnvSource::Torchrun => "zero-run/torchrun",
            EnvSource::Kubeflow => "Kubeflow PyTorchJob",
            EnvSource::OpenMpi => "Open MPI",
            EnvSource::Pmi => "MPICH/Intel MPI (PMI)",
            EnvSource::Lsf => "LSF jsrun",
            EnvSource::Slurm => "Slurm",
        })
    }
}
