//! MPI launchers: Open MPI's `mpirun` and the PMI variables of MPICH's and Intel MPI's Hydra
//! (`mpiexec`). Neither says where rank 0 runs: on one node that is the loopback; across
//! nodes `MASTER_ADDR` must say.

use super::Reading;
use super::error::EnvError;
use super::launcher::EnvSource;
use super::master::{DEFAULT_PORT, Derived};
use super::vars::Vars;

/// Rank of this process among all of Open MPI's ranks.
pub const OMPI_COMM_WORLD_RANK: &str = "OMPI_COMM_WORLD_RANK";
/// Number of ranks Open MPI started.
pub const OMPI_COMM_WORLD_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
/// Rank of this process on its node.
pub const OMPI_COMM_WORLD_LOCAL_RANK: &str = "OMPI_COMM_WORLD_LOCAL_RANK";
/// Number of ranks on this node.
pub const OMPI_COMM_WORLD_LOCAL_SIZE: &str = "OMPI_COMM_WORLD_LOCAL_SIZE";
/// Rank, as Hydra (MPICH, Intel MPI) sets it.
pub const PMI_RANK: &str = "PMI_RANK";
/// Number of ranks, as Hydra sets it.
pub const PMI_SIZE: &str = "PMI_SIZE";
/// Rank on this node, as Hydra sets it.
pub const MPI_LOCALRANKID: &str = "MPI_LOCALRANKID";
/// Number of ranks on this node, as Hydra sets it.
pub const MPI_LOCALNRANKS: &str = "MPI_LOCALNRANKS";

/// The four variables of one MPI launcher.
struct Names {
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

fn names(source: EnvSource) -> Names {
    match source {
        EnvSource::Pmi => Names {
            rank: PMI_RANK,
            size: PMI_SIZE,
            local_rank: MPI_LOCALRANKID,
            local_size: MPI_LOCALNRANKS,
        },
        _ => Names {
            rank: OMPI_COMM_WORLD_RANK,
            size: OMPI_COMM_WORLD_SIZE,
            local_rank: OMPI_COMM_WORLD_LOCAL_RANK,
            local_size: OMPI_COMM_WORLD_LOCAL_SIZE,
        },
    }
}

/// The rank and size variables of `source` (Open MPI or PMI), for detection.
pub(crate) fn rank_and_size_vars(source: EnvSource) -> (&'static str, &'static str) {
    let names = names(source);
    (names.rank, names.size)
}

/// Reads the MPI launcher of `vars` (Open MPI or PMI). The master is the loopback when every
/// rank is on this node, else unknown; the port is [`DEFAULT_PORT`].
pub(crate) fn read(vars: &Vars<'_>) -> Result<Reading, EnvError> {
    let names = names(vars.launcher());
    let world_size = vars.required_count(&[names.size], 1)?;
    let rank = vars.required_count(&[names.rank], 0)?;
    let local_rank = vars.required_count(&[names.local_rank], 0)?;
    let local_world_size = vars.count(&[names.local_size], 1)?;
    let addr = match local_world_size {
        _ if world_size.value == 1 => {
            Derived::Known("127.0.0.1".into(), "the loopback (a one-rank job)")
        }
        Some(local) if local.value == world_size.value => Derived::Known(
            "127.0.0.1".into(),
            "the loopback (every rank is on this node)",
        ),
        Some(local) => Derived::Unknown(format!(
            "the {} ranks span several nodes ({}={}) and {} does not say which host runs \
             rank 0",
            world_size.value,
            local.var,
            local.value,
            vars.launcher()
        )),
        None => Derived::Unknown(format!(
            "{} is not set, so whether every rank is on this node is unknown",
            names.local_size
        )),
    };
    Ok(Reading {
        rank,
        world_size,
        local_rank,
        local_world_size,
        addr,
        port: Derived::Known(DEFAULT_PORT, "the default port 29500"),
    })
}
