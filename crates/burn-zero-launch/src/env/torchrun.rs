//! The torchrun-style variables (zero-run, torchrun, torchelastic), and Kubeflow's PyTorchJob,
//! which sets the same names for one rank per pod.

use super::error::EnvError;
use super::master::Derived;
use super::vars::{Counted, Vars};
use super::{LOCAL_RANK, LOCAL_WORLD_SIZE, RANK, Reading, WORLD_SIZE};

/// `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (all required), `LOCAL_WORLD_SIZE` (optional: older
/// launchers do not set it), `MASTER_ADDR` and `MASTER_PORT` (required).
pub(crate) fn read(vars: &Vars<'_>) -> Result<Reading, EnvError> {
    let world_size = vars.required_count(&[WORLD_SIZE], 1)?;
    let rank = vars.required_count(&[RANK], 0)?;
    let local_rank = vars.required_count(&[LOCAL_RANK], 0)?;
    let local_world_size = vars.count(&[LOCAL_WORLD_SIZE], 1)?;
    Ok(Reading {
        rank,
        world_size,
        local_rank,
        local_world_size,
        addr: Derived::Required,
        port: Derived::Required,
    })
}

/// Kubeflow's PyTorchJob without an elastic policy: one rank per pod, so local rank 0 of 1.
/// (With `nprocPerNode` above one the pod runs torchrun, whose `LOCAL_RANK` selects
/// [`read`] instead.)
pub(crate) fn read_kubeflow(vars: &Vars<'_>) -> Result<Reading, EnvError> {
    let world_size = vars.required_count(&[WORLD_SIZE], 1)?;
    let rank = vars.required_count(&[RANK], 0)?;
    let one_per_pod = "one rank per pod";
    Ok(Reading {
        rank,
        world_size,
        local_rank: Counted {
            var: one_per_pod,
            value: 0,
        },
        local_world_size: Some(Counted {
            var: one_per_pod,
            value: 1,
        }),
        addr: Derived::Required,
        port: Derived::Required,
    })
}
