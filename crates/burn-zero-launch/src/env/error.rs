//! [`EnvError`]: a launcher environment that cannot describe a rank, said before any network
//! call so that a misconfigured job fails at once instead of waiting out a rendezvous.

use super::launcher::EnvSource;

/// A launcher environment that is missing, malformed or contradicts itself. Every variant
/// but [`EnvError::NotLaunched`] and [`EnvError::UnknownLauncher`] names the launcher whose
/// variables were read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// No launcher's variables are set.
    #[error(
        "no launcher environment found: start the ranks with zero-run (or torchrun), srun, \
         mpirun, mpiexec or jsrun, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and \
         MASTER_PORT yourself"
    )]
    NotLaunched,
    /// `BURN_ZERO_LAUNCHER` (or a name given to [`EnvSource`]'s `from_str`) names no launcher.
    #[error(
        "unknown launcher {value:?}: expected one of torchrun, kubeflow, openmpi, pmi, lsf, \
         slurm (or none)"
    )]
    UnknownLauncher {
        /// The name given.
        value: String,
    },
    /// A variable the launcher always sets is not set.
    #[error("{launcher}: environment variable {var} is not set: {}", launcher.missing_help())]
    Missing {
        /// Whose variables were read.
        launcher: EnvSource,
        /// The variable.
        var: &'static str,
    },
    /// A variable whose value does not parse or is out of its range.
    #[error("{launcher}: environment variable {var}={value:?} is invalid: {reason}")]
    Invalid {
        /// Whose variables were read.
        launcher: EnvSource,
        /// The variable.
        var: &'static str,
        /// Its value (lossily decoded when it is not UTF-8).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A rank (or local rank, or node index) not below the size it counts in.
    #[error("{launcher}: {var}={value} is not below {size} ({size_of})")]
    OutOfRange {
        /// Whose variables were read.
        launcher: EnvSource,
        /// The variable holding the index.
        var: &'static str,
        /// Its value.
        value: usize,
        /// The size it must be below.
        size: usize,
        /// Where that size comes from (a variable, or a description).
        size_of: &'static str,
    },
    /// A Slurm step whose tasks-per-node list and node list disagree on the number of nodes.
    #[error(
        "{launcher}: {tasks_var}={tasks:?} describes {task_nodes} node(s) but \
         {nodes_var}={nodes:?} names {listed_nodes}"
    )]
    NodeListMismatch {
        /// Whose variables were read.
        launcher: EnvSource,
        /// The tasks-per-node variable.
        tasks_var: &'static str,
        /// Its value.
        tasks: String,
        /// The nodes it describes.
        task_nodes: usize,
        /// The node-list variable.
        nodes_var: &'static str,
        /// Its value.
        nodes: String,
        /// The hosts it expands to.
        listed_nodes: usize,
    },
    /// Two variables that contradict each other.
    #[error("{launcher}: inconsistent launcher environment: {reason}")]
    Inconsistent {
        /// Whose variables were read.
        launcher: EnvSource,
        /// What contradicts what.
        reason: String,
    },
    /// A program started by a Slurm batch script or in an `salloc` shell, not by `srun`: it
    /// sees the job's task count but is one process, and the other ranks would never start.
    #[error(
        "Slurm job {job_id} has {tasks} tasks ({tasks_var}={tasks}) but this process was not \
         started by srun (no SLURM_STEP_ID): it is the one process of the batch script or of \
         an salloc shell, and the other ranks would never start. Start the ranks with srun \
         (for example `srun ./train` in the batch script), or with zero-run or mpirun under \
         it; BURN_ZERO_LAUNCHER=none runs this process alone"
    )]
    NotAnSrunStep {
        /// The job.
        job_id: String,
        /// Its number of tasks.
        tasks: usize,
        /// The variable that said so.
        tasks_var: &'static str,
    },
    /// The launcher does not say where rank 0 runs, and `MASTER_ADDR` is not set.
    #[error(
        "{launcher}: no master address: {reason}; set MASTER_ADDR to the host of rank 0 \
         (and MASTER_PORT to a free port on it)"
    )]
    MasterUnknown {
        /// Whose variables were read.
        launcher: EnvSource,
        /// Why it cannot be derived.
        reason: String,
    },
}

impl EnvError {
    /// The launcher whose variables were read, when the error is about one.
    pub fn launcher(&self) -> Option<EnvSource> {
        match self {
            EnvError::NotLaunched | EnvError::UnknownLauncher { .. } => None,
            EnvError::NotAnSrunStep { .. } => Some(EnvSource::Slurm),
            EnvError::Missing { launcher, .. }
            | EnvError::Invalid { launcher, .. }
            | EnvError::OutOfRange { launcher, .. }
            | EnvError::NodeListMismatch { launcher, .. }
            | EnvError::Inconsistent { launcher, .. }
            | EnvError::MasterUnknown { launcher, .. } => Some(*launcher),
        }
    }
}
