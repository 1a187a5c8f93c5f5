//! Multi-process launch for burn-zero, std only (no Burn, no CUDA):
//!
//! - [`DistEnv`]: this process's place in the job (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, as `torchrun` sets them), with a clear
//!   [`EnvError`] for a missing or malformed variable.
//! - [`Rendezvous`]: rank 0 hands an opaque blob (the NCCL unique id) to every other rank over
//!   TCP, with a timeout, retries while the master starts, and clear errors for an unreachable
//!   master, a world-size mismatch, a duplicate rank and missing ranks.
//! - [`control`]: the job-lifetime control connection (a small store on rank 0, beside the
//!   rendezvous): a failed rank stops every rank within a round trip, and ranks can check that
//!   they issue the same collectives before issuing them.
//! - [`supervisor`]: what the `zero-run` binary does: start this node's ranks with that
//!   environment, prefix their output with the rank, forward SIGINT/SIGTERM, and when one rank
//!   fails stop the others and exit with its code.
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
pub mod output;
pub mod rendezvous;
pub mod signals;
pub mod supervisor;

pub use control::{ControlClient, ControlError, ControlFailure, ControlServer, establish};
pub use env::{DistEnv, EnvError};
pub use rendezvous::{Rendezvous, RendezvousError, RendezvousListener};
pub use supervisor::{Exit, Outcome, RunConfig, SupervisorError, run};
