//! Ranks in separate processes on any backend: this process is one rank of a job that a
//! launcher started (`mpirun`, Slurm's `srun`, `zero-run`), joined to the others through MPI
//! (`MpiGroup`, feature `mpi`).
//!
//! A launcher's variables without the engine are refused by name: each process would
//! otherwise train the whole job on its own, and several would write one checkpoint
//! directory.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::backend::Backend;
use burn_zero_comm::{Communicator, RankContext};
use burn_zero_launch::{DistEnv, EnvError};

use super::{RankFn, RankOutcome};

/// How long a rank in its own process waits for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// In one collective, before it fails with a timeout naming the collective.
    pub collective: Duration,
    /// To meet the other ranks at the start.
    pub rendezvous: Duration,
}

impl Default for Timeouts {
    /// Ten minutes per collective and five to meet, as PyTorch's defaults.
    fn default() -> Self {
        Timeouts {
            collective: Duration::from_secs(600),
            rendezvous: Duration::from_secs(300),
        }
    }
}

/// This process's rank of a job of several processes, with the device it computes on.
pub struct ProcessRank<B: Backend> {
    comm: Arc<dyn Communicator<B>>,
    device: B::Device,
}

impl<B: Backend> ProcessRank<B> {
    /// This process's rank when a launcher started it (its variables are set), `None`
    /// otherwise (the ranks are then threads of this process). `backend` names the backend
    /// for messages.
    ///
    /// Without the `mpi` feature a launched job of more than one rank is an error that says
    /// what to do.
    pub fn from_launcher(backend: &str, timeouts: Timeouts) -> Result<Option<Self>, String> {
        if !DistEnv::is_launched() {
            return Ok(None);
        }
        let detected = match DistEnv::detect() {
            Ok(detected) => detected,
            Err(EnvError::NotLaunched) => return Ok(None),
            Err(error) => return Err(error.to_string()),
        };
        let env = &detected.env;
        if env.world_size == 1 {
            return Ok(None);
        }
        Self::join(backend, &detected, timeouts).map(Some)
    }

    #[cfg(feature = "mpi")]
    fn join(
        backend: &str,
        detected: &burn_zero_launch::Detected,
        timeouts: Timeouts,
    ) -> Result<Self, String> {
        use burn_zero_comm::{MpiGroup, MpiOptions};
        let options = MpiOptions {
            timeout: timeouts.collective,
            rendezvous_timeout: timeouts.rendezvous,
            ..MpiOptions::default()
        };
        let group = MpiGroup::<B>::from_env(&options).map_err(|e| {
            format!(
                "--backend {backend}: rank {} of {} ({}) could not join the MPI job: {e}",
                detected.env.rank, detected.env.world_size, detected.source
            )
        })?;
        Ok(ProcessRank {
            comm: Arc::new(group),
            device: B::Device::default(),
        })
    }

    #[cfg(not(feature = "mpi"))]
    fn join(
        backend: &str,
        detected: &burn_zero_launch::Detected,
        _timeouts: Timeouts,
    ) -> Result<Self, String> {
        let env = &detected.env;
        Err(format!(
            "--backend {backend}: {} started this process as rank {} of {}, and ranks in separate \
             processes need an engine between them, which this build lacks: rebuild with \
             `--features mpi` (needs Open MPI: openmpi-bin libopenmpi-dev libclang-dev) and start \
             the ranks again, or run them as threads of one process with --world-size {} and no \
             launcher",
            detected.source, env.rank, env.world_size, env.world_size
        ))
    }

    /// Ranks in the whole job.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The device this rank computes on.
    pub fn device(&self) -> B::Device {
        self.device.clone()
    }

    /// This rank's context (for a training loop of its own, or burn-train's `ZeroStrategy`).
    pub fn into_context(self) -> RankContext<B> {
        RankContext::new(self.device, self.comm)
    }

    /// Runs `rank_fn` for this process's rank; the ranks argument of `train_with`.
    pub fn run(self, rank_fn: &RankFn<'_, B>) -> Result<Vec<RankOutcome>, String> {
        run_one(self.device, self.comm, rank_fn)
    }
}

/// Runs `rank_fn` as this process's one rank on `comm`; a failed rank tells the others at
/// once, so that they do not wait out their timeout.
pub(crate) fn run_one<B: Backend>(
    device: B::Device,
    comm: Arc<dyn Communicator<B>>,
    rank_fn: &RankFn<'_, B>,
) -> Result<Vec<RankOutcome>, String> {
    let outcome = rank_fn(RankContext::new(device, comm.clone()));
    if let Err(error) = &outcome {
        comm.abort(&error.to_string());
    }
    outcome.map(|o| vec![o]).map_err(|e| e.to_string())
}
