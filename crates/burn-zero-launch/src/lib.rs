//! Multi-process launch for burn-zero, std only (no Burn, no CUDA):
//!
//! - [`DistEnv`]: this process's place in the job, read from whichever launcher started it
//!   ([`EnvSource`]: zero-run and torchrun, Slurm's `srun`, Open MPI and PMI launchers, LSF's
//!   `jsrun`, Kubeflow), with a clear [`EnvError`], naming the launcher, for a missing or
//!   malformed variable.
//! - [`Rendezvous`]: rank 0 hands an opaque blob (the NCCL unique id) to every other rank over
//!   TCP, with a timeout, retries while the master starts, and clear errors for an unreachable
//!   master, a world-size mismatch, a duplicate rank and missing ranks.
//! - [`control`]: the job-lifetime control connection (a small store on rank 0, beside the
//!   rendezvous): a failed rank stops every rank within a round trip, and ranks can check that
//!   they issue the same collectives before issuing them.
//! - [`supervisor`]: what the `zero-run` binary does: start this node's ranks with that
//!   environment, prefix their output with the rank, forward SIGINT/SIGTERM, and when ranks
//!   fail stop the others, name the rank whose failure caused the rest (the control store's
//!   record) and exit with its code.
//! - [`name_server`]: Open MPI's name server, which `zero-run` runs for ranks that join one
//!   MPI world although no MPI launcher started them.
//! - [`sync`]: locks that a panicking rank does not poison for the others.
//!
//! ```no_run
//! use burn_zero_launch::{DistEnv, Rendezvous};
//!
//! let env = DistEnv::from_env()?;
//! // Rank 0 makes the id; every rank gets the same bytes back.
//! let id = Rendezvous::new(&env).share(|| b"an NCCL unique id".to_vec())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod control;
pub mod env;
pub mod name_server;
pub mod output;
pub mod rendezvous;
pub mod signals;
pub mod supervisor;
pub mod sync;

pub use control::{ControlClient, ControlError, ControlFailure, ControlServer, establish};
pub use env::{Detected, DistEnv, EnvError, EnvSource};
pub use rendezvous::{Rendezvous, RendezvousError, RendezvousListener};
pub use supervisor::{Exit, Outcome, RunConfig, SupervisorError, run};
