//! The MPI engine (feature `mpi`): [`MpiGroup`] implements [`crate::Communicator`] for any
//! Burn backend across processes, one rank per process, through MPI (Open MPI 4 and later, by
//! rsmpi's bindings).
//!
//! It is the engine for ranks in separate processes where NCCL is not: CPU backends (Flex,
//! NdArray), wgpu, or CUDA without NCCL. The processes may be started by `mpirun -np N`, by
//! `srun` with Slurm's MPI support, or by `zero-run`, which also runs Open MPI's name server
//! for them; [`MpiGroup::from_env`] finds out which.
//!
//! What it gives, beyond MPI:
//! - reductions bitwise equal to [`crate::LocalGroup`]'s at the same ranks, whatever MPI's own
//!   algorithms (an all-to-all of the blocks, summed on this side in rank order);
//! - a timeout for every collective, and a failure of any rank (a panic, an error, a killed
//!   process) ending every rank's collectives at once, through the job's control connection
//!   ([`crate::JobControl`]), which also names the first cause to `zero-run`;
//! - with [`MpiOptions::check_schedule`], every call compared across ranks before MPI sees it.
//!
//! MPI starts once per process ([`MPI_THREAD_MULTIPLE`]: every burn-zero thread may issue
//! collectives) and is finalised when the last group is dropped; a process whose group failed
//! leaves MPI unfinalised, since finalising would wait for the collective that never finished.
//!
//! [`MPI_THREAD_MULTIPLE`]: https://www.mpi-forum.org/docs/mpi-4.1/mpi41-report/node303.htm

mod group;
mod join;
mod process;
mod staging;
mod sys;

use std::time::Duration;

pub use burn_zero_launch::name_server::SERVER_URI_VAR;
pub use group::MpiGroup;

/// Timeouts and checks of an MPI group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpiOptions {
    /// How long a collective may take before the rank fails with [`crate::CommError::Timeout`].
    pub timeout: Duration,
    /// How long the ranks may take to meet and form the job's world.
    pub rendezvous_timeout: Duration,
    /// Compare every collective with the other ranks' through the job's control connection
    /// before MPI sees it: a diverged schedule then fails with
    /// [`crate::CommError::Mismatch`] naming both calls instead of hanging or mixing buffers.
    /// Off by default: one round trip to rank 0's store per collective.
    pub check_schedule: bool,
}

impl Default for MpiOptions {
    /// Ten minutes per collective and five to meet, as the NCCL engine; schedules not compared.
    fn default() -> Self {
        MpiOptions {
            timeout: Duration::from_secs(600),
            rendezvous_timeout: Duration::from_secs(300),
            check_schedule: false,
        }
    }
}

impl MpiOptions {
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
