//! Collective communication for burn-zero.
//!
//! - [`Communicator`]: rank, world size and the collectives (all-gather, reduce-scatter,
//!   all-reduce, broadcast, barrier) on a backend's float tensors.
//! - [`LocalGroup`]: the in-process engine, one thread per rank, built on Burn tensor ops so it
//!   runs on every backend. Reductions run in rank order: results are bitwise reproducible.
//! - [`launch()`]: runs a closure once per rank on its own thread with a [`RankContext`], and
//!   turns a failed rank into an error on every other rank instead of a hang.
//! - [`OrderedComm`]: a rank's collectives issued from one thread, in the order its training
//!   thread fixes, whichever thread submits them (what NCCL needs when gradient reduction
//!   overlaps backward).
//! - [`Issued`]: a collective queued on the device, whose completion the thread that reads
//!   its result waits for ([`Communicator::issue`]), not the thread that issued it.
//! - [`JobControl`]: a rank's side of the job-lifetime control connection (aborts that reach
//!   every process, schedules compared across processes before data moves).
//! - `mpi` (feature `mpi`): `MpiGroup`, the MPI engine for ranks in separate processes on any
//!   backend, started by `mpirun`, `srun` or `zero-run`.
//! - `nccl` (feature `cuda`): `NcclGroup`, the NCCL engine for Burn's CUDA backend (fused or
//!   plain), within one process or across processes started by `zero-run`.
//! - [`device_capacity`]: a CUDA device's total and free memory, from its driver.
//! - [`libraries`]: the CUDA libraries loaded at run time and a [`MissingLibrary`] error that
//!   names the one that is missing and how to provide it.
//!
//! Every collective carries a fingerprint ([`CollectiveCall`]: sequence number, op, dtype,
//! size); ranks that disagree get a [`CommError::Mismatch`] naming both sides, and a rank that
//! never arrives becomes a [`CommError::Timeout`].
//!
//! ```
//! use burn::backend::NdArray;
//! use burn::tensor::Tensor;
//! use burn_zero_comm::{launch, ReduceOp};
//!
//! let device = Default::default();
//! let sums = launch::<NdArray, _, _, _>(3, &[device], |ctx| {
//!     let mine = Tensor::<NdArray, 1>::from_floats([ctx.rank() as f32; 4], ctx.device());
//!     let total = ctx.comm().all_reduce(mine, ReduceOp::Sum)?;
//!     Ok::<_, burn_zero_comm::CommError>(total.into_data().to_vec::<f32>().unwrap())
//! })
//! .unwrap();
//! assert_eq!(sums, vec![vec![3.0; 4]; 3]);
//! ```

pub mod agree;
pub mod call;
pub mod capacity;
pub mod communicator;
pub mod control;
pub mod counters;
pub mod error;
pub mod issued;
pub mod launch;
pub mod libraries;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod ordered;
mod parked;
mod plane;
pub mod rank_order;

/// Locks that a panicking rank does not poison for the others.
pub use burn_zero_launch::sync;
pub use call::{CollectiveCall, CollectiveOp, ReduceOp};
pub use capacity::{CapacityError, DeviceCapacity, device_capacity};
pub use communicator::{Communicator, DataOp};
pub use control::JobControl;
pub use counters::{CollectiveKind, Counts, RankCounters};
pub use error::{CommError, LaunchError, RankFailure};
pub use issued::{Completion, Issued};
pub use launch::{LaunchOptions, RankContext, launch, launch_with};
pub use libraries::{CudaLibrary, MissingLibrary};
pub use local::{GroupOptions, LocalGroup};
#[cfg(feature = "mpi")]
pub use mpi::{MpiGroup, MpiOptions};
#[cfg(feature = "cuda")]
pub use nccl::{FusedCudaBackend, NcclGroup, NcclOptions, launch_nccl};
pub use ordered::{Deferred, OrderedComm, Pending, Reservation};
pub use rank_order::RankOrderReduction;
