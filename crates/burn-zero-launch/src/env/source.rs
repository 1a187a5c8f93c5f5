//! Which launcher started this process: the precedence that picks one [`EnvSource`] when
//! several left their variables (launchers nest), and a launcher named by hand.

use std::str::FromStr;

use super::error::EnvError;
use super::launcher::EnvSource;
use super::vars::{Lookup, is_set, parse_plain};
use super::{lsf, mpi, slurm};

/// Names the launcher explicitly (`slurm`, `openmpi`, …), or `none` for a process that runs
/// alone whatever the environment says. Unset or empty: detect.
pub const LAUNCHER: &str = "BURN_ZERO_LAUNCHER";
/// Set by Kubernetes in every pod.
pub const KUBERNETES_SERVICE_HOST: &str = "KUBERNETES_SERVICE_HOST";

impl FromStr for EnvSource {
    type Err = EnvError;

    /// The short names of [`EnvSource::name`], case-insensitive, and a few aliases:
    /// `zero-run`, `torchelastic`, `open-mpi`, `ompi`, `mpich`, `intel-mpi`, `hydra`, `jsrun`,
    /// `srun`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let name = text.trim().to_ascii_lowercase();
        Ok(match name.as_str() {
            "torchrun" | "zero-run" | "torchelastic" => EnvSource::Torchrun,
            "kubeflow" => EnvSource::Kubeflow,
            "openmpi" | "open-mpi" | "ompi" => EnvSource::OpenMpi,
            "pmi" | "mpich" | "intel-mpi" | "hydra" => EnvSource::Pmi,
            "lsf" | "jsrun" => EnvSource::Lsf,
            "slurm" | "srun" => EnvSource::Slurm,
            _ => {
                return Err(EnvError::UnknownLauncher {
                    value: text.to_string(),
                });
            }
        })
    }
}

/// The launcher this process's variables come from, `None` when there is none (or
/// `BURN_ZERO_LAUNCHER=none`). Only presence is looked at here; the chosen launcher's reader
/// checks the values.
///
/// Precedence, innermost launcher first, because an outer launcher's variables stay in the
/// environment of everything started inside it:
///
/// 1. `BURN_ZERO_LAUNCHER`, when set, decides.
/// 2. Torchrun-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`): a
///    launcher set them for this very process (zero-run or torchrun under `srun`, `mpirun` or
///    in a pod). With `RANK` and `WORLD_SIZE` but neither local variable, inside a Kubernetes
///    pod: Kubeflow.
/// 3. Open MPI, then PMI (MPICH, Intel MPI): `mpirun` inside a Slurm batch script leaves the
///    script's `SLURM_PROCID=0` to every rank, and inside an allocation it starts its daemons
///    with `srun`, whose `SLURM_PROCID` is the node's index, not the rank.
/// 4. LSF's jsrun, then Slurm.
///
/// One exception: MPI variables that only repeat the scheduler's own rank and size (`srun
/// --mpi=pmi2`, jsrun with Spectrum MPI set both) defer to the scheduler, which also says
/// where rank 0 runs.
pub(crate) fn detect(lookup: Lookup<'_>) -> Result<Option<EnvSource>, EnvError> {
    if let Some(named) = named(lookup)? {
        return Ok(named);
    }
    let torchrun = [
        super::RANK,
        super::WORLD_SIZE,
        super::LOCAL_RANK,
        super::LOCAL_WORLD_SIZE,
    ];
    if torchrun.iter().any(|var| is_set(lookup, var)) {
        let one_per_pod = !is_set(lookup, super::LOCAL_RANK)
            && !is_set(lookup, super::LOCAL_WORLD_SIZE)
            && is_set(lookup, KUBERNETES_SERVICE_HOST);
        return Ok(Some(if one_per_pod {
            EnvSource::Kubeflow
        } else {
            EnvSource::Torchrun
        }));
    }
    let scheduler = if is_set(lookup, lsf::JSM_NAMESPACE_RANK) {
        Some(EnvSource::Lsf)
    } else if slurm::is_present(lookup) {
        Some(EnvSource::Slurm)
    } else {
        None
    };
    for mpi in [EnvSource::OpenMpi, EnvSource::Pmi] {
        let (rank_var, size_var) = mpi::rank_and_size_vars(mpi);
        if !is_set(lookup, rank_var) {
            continue;
        }
        let mpi_job = (parse_plain(lookup, rank_var), parse_plain(lookup, size_var));
        let repeated = match scheduler {
            Some(EnvSource::Lsf) => lsf::rank_and_size(lookup),
            Some(EnvSource::Slurm) => slurm::step_rank_and_size(lookup),
            _ => None,
        };
        return Ok(match (scheduler, repeated) {
            (Some(scheduler), Some((rank, size))) if mpi_job == (Some(rank), Some(size)) => {
                Some(scheduler)
            }
            _ => Some(mpi),
        });
    }
    Ok(scheduler)
}

/// `BURN_ZERO_LAUNCHER`: `None` when unset or empty (detect), `Some(None)` for `none`.
fn named(lookup: Lookup<'_>) -> Result<Option<Option<EnvSource>>, EnvError> {
    match lookup(LAUNCHER) {
        None => Ok(None),
        Some(Err(lossy)) => Err(EnvError::UnknownLauncher { value: lossy }),
        Some(Ok(text)) if text.trim().is_empty() => Ok(None),
        Some(Ok(text)) if text.trim().eq_ignore_ascii_case("none") => Ok(Some(None)),
        Some(Ok(text)) => text.parse().map(|source| Some(Some(source))),
    }
}
