//! `DistEnv`: who this process is in a multi-process job, read from the variables of the
//! launcher that started it: zero-run or torchrun, Kubeflow's PyTorchJob, Open MPI, MPICH or
//! Intel MPI (PMI), LSF's jsrun, or Slurm's srun ([`EnvSource`]).
//!
//! [`DistEnv::detect`] finds the launcher; [`DistEnv::from_source`] reads a named one. When
//! launchers nest (zero-run under `srun`, `mpirun` in a batch script) the innermost wins, in
//! the order of [`EnvSource::ALL`]: torchrun-style variables, Kubeflow, Open MPI, PMI, jsrun,
//! Slurm; an outer launcher's leftovers are ignored. `BURN_ZERO_LAUNCHER` names the launcher
//! (or `none`) instead of detecting it.
//!
//! Where the launcher gives no master address or port, they are derived: Slurm's rank 0 runs
//! on the first node of the step's node list, on port [`derived_port`] of the job and step
//! ids; jsrun's on the first compute host of `LSB_MCPU_HOSTS`, on a port from `LSB_JOBID`; an
//! MPI job whose ranks are all on this node meets on the loopback, at port 29500. Otherwise
//! `MASTER_ADDR` must say. `MASTER_ADDR` and `MASTER_PORT` always override.
//!
//! Every value is checked before any network call: a malformed or contradictory environment
//! is an [`EnvError`] naming the launcher and the variable, never a rendezvous that waits out
//! its timeout.

mod device;
mod error;
pub mod hostlist;
mod launcher;
pub mod lsf;
mod master;
pub mod mpi;
pub mod slurm;
mod source;
mod torchrun;
mod vars;

use std::fmt;

pub use device::{DeviceChoiceError, choose_device};
pub use error::EnvError;
pub use hostlist::{HostListError, expand_hostlist};
pub use launcher::EnvSource;
pub use master::{
    DEFAULT_PORT, DERIVED_PORT_BASE, DERIVED_PORT_SPAN, MASTER_ADDR, MASTER_PORT, MasterOrigin,
    derived_port,
};
pub use source::{KUBERNETES_SERVICE_HOST, LAUNCHER};

use master::Derived;
use vars::{Counted, Vars};

/// Global rank of this process, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Number of processes in the job, over every node.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank of this process on its node; usually the index of its GPU.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of processes on this node (optional: `torchrun` sets it, older launchers do not).
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";

/// The launcher's variables, parsed and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Number of ranks on this node, when the launcher said.
    pub local_world_size: Option<usize>,
    /// Where rank 0 listens.
    pub master_addr: String,
    /// The port rank 0 listens on.
    pub master_port: u16,
}

/// A [`DistEnv`] with the launcher it was read from and where its master came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detected {
    /// The launcher whose variables were read.
    pub source: EnvSource,
    /// This rank's place in the job.
    pub env: DistEnv,
    /// Whether the master's address and port were given or derived, and how.
    pub master_origin: MasterOrigin,
}

impl fmt::Display for Detected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} from {} ({})",
            self.env, self.source, self.master_origin
        )
    }
}

/// What one launcher's variables say, before the common checks and the master.
pub(crate) struct Reading {
    pub rank: Counted,
    pub world_size: Counted,
    pub local_rank: Counted,
    pub local_world_size: Option<Counted>,
    pub addr: Derived<String>,
    pub port: Derived<u16>,
}

impl DistEnv {
    /// Reads this process's launcher environment ([`DistEnv::detect`]), without the source.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::detect().map(|detected| detected.env)
    }

    /// Finds the launcher that started this process and reads its variables; logs the result.
    pub fn detect() -> Result<Detected, EnvError> {
        let detected = Self::detect_with(process_lookup)?;
        log_detected(&detected);
        Ok(detected)
    }

    /// Reads the variables of `source`, whatever else is set; logs the result.
    pub fn from_source(source: EnvSource) -> Result<Detected, EnvError> {
        let detected = Self::from_source_with(source, process_lookup)?;
        log_detected(&detected);
        Ok(detected)
    }

    /// Whether this process looks like one rank of a launched job (some launcher's variables
    /// are set, and `BURN_ZERO_LAUNCHER` is not `none`); a program can fall back to a
    /// single-process run otherwise. A malformed environment counts as launched, so that
    /// [`DistEnv::from_env`] reports it.
    pub fn is_launched() -> bool {
        source::detect(&process_lookup).map_or(true, |source| source.is_some())
    }

    /// Parses the variables from `lookup`, which answers `None` for an unset variable and
    /// `Err(lossy text)` for a value that is not valid UTF-8: [`DistEnv::detect_with`] without
    /// the source. Used by [`DistEnv::from_env`] and by tests.
    pub fn from_lookup<L>(lookup: L) -> Result<Self, EnvError>
    where
        L: Fn(&str) -> Option<Result<String, String>>,
    {
        Self::detect_with(lookup).map(|detected| detected.env)
    }

    /// [`DistEnv::detect`] on the variables `lookup` answers (as in [`DistEnv::from_lookup`]).
    pub fn detect_with<L>(lookup: L) -> Result<Detected, EnvError>
    where
        L: Fn(&str) -> Option<Result<String, String>>,
    {
        match source::detect(&lookup)? {
            Some(source) => Self::from_source_with(source, lookup),
            None => Err(EnvError::NotLaunched),
        }
    }

    /// [`DistEnv::from_source`] on the variables `lookup` answers.
    pub fn from_source_with<L>(source: EnvSource, lookup: L) -> Result<Detected, EnvError>
    where
        L: Fn(&str) -> Option<Result<String, String>>,
    {
        let vars = Vars::new(&lookup, source);
        let reading = match source {
            EnvSource::Torchrun => torchrun::read(&vars)?,
            EnvSource::Kubeflow => torchrun::read_kubeflow(&vars)?,
            EnvSource::OpenMpi | EnvSource::Pmi => mpi::read(&vars)?,
            EnvSource::Lsf => lsf::read(&vars)?,
            EnvSource::Slurm => slurm::read(&vars)?,
        };
        finish(&vars, reading)
    }

    /// The environment of a single-process job (rank 0 of 1, master on the loopback).
    pub fn single_process(master_port: u16) -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            master_addr: "127.0.0.1".into(),
            master_port,
        }
    }

    /// The variables that describe this rank, as `zero-run` sets them.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = vec![
            (RANK, self.rank.to_string()),
            (WORLD_SIZE, self.world_size.to_string()),
            (LOCAL_RANK, self.local_rank.to_string()),
        ];
        if let Some(local_world_size) = self.local_world_size {
            vars.push((LOCAL_WORLD_SIZE, local_world_size.to_string()));
        }
        vars.push((MASTER_ADDR, self.master_addr.clone()));
        vars.push((MASTER_PORT, self.master_port.to_string()));
        vars
    }

    /// `host:port` of the master.
    pub fn master_endpoint(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            // A bare IPv6 address.
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// This rank's device among the `visible` ones ([`choose_device`]): 0 when the process
    /// sees one device, its local rank when it sees one per rank of its node.
    pub fn device_index(&self, visible: usize) -> Result<usize, DeviceChoiceError> {
        choose_device(visible, self.local_rank, self.local_world_size)
    }
}

impl fmt::Display for DistEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {} (local rank {}), master {}",
            self.rank,
            self.world_size,
            self.local_rank,
            self.master_endpoint()
        )
    }
}

/// The checks every launcher shares, then the master.
fn finish(vars: &Vars<'_>, reading: Reading) -> Result<Detected, EnvError> {
    let Reading {
        rank,
        world_size,
        local_rank,
        local_world_size,
        addr,
        port,
    } = reading;
    vars.check_below(rank, world_size.value, world_size.var)?;
    if let Some(local) = local_world_size {
        vars.check_below(local_rank, local.value, local.var)?;
        if local.value > world_size.value {
            return Err(vars.inconsistent(format!(
                "{}={} is larger than {}={}",
                local.var, local.value, world_size.var, world_size.value
            )));
        }
    }
    let (master_addr, master_port, master_origin) = master::resolve(vars, addr, port)?;
    Ok(Detected {
        source: vars.launcher(),
        env: DistEnv {
            rank: rank.value,
            world_size: world_size.value,
            local_rank: local_rank.value,
            local_world_size: local_world_size.map(|local| local.value),
            master_addr,
            master_port,
        },
        master_origin,
    })
}

fn log_detected(detected: &Detected) {
    tracing::info!(
        launcher = %detected.source,
        rank = detected.env.rank,
        world_size = detected.env.world_size,
        local_rank = detected.env.local_rank,
        master = %detected.env.master_endpoint(),
        origin = %detected.master_origin,
        "launcher environment read"
    );
}

/// The process environment, as `Lookup` answers.
fn process_lookup(var: &str) -> Option<Result<String, String>> {
    std::env::var_os(var).map(|value| match value.into_string() {
        Ok(text) => Ok(text),
        Err(raw) => Err(raw.to_string_lossy().into_owned()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<DistEnv, EnvError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(|var| map.get(var).cloned().map(Ok))
    }

    const FULL: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];

    fn with(var: &str, value: Option<&str>) -> Vec<(&'static str, String)> {
        FULL.iter()
            .filter(|(k, _)| *k != var)
            .map(|(k, v)| (*k, v.to_string()))
            .chain(value.map(|v| {
                let key = FULL.iter().find(|(k, _)| *k == var).unwrap().0;
                (key, v.to_string())
            }))
            .collect()
    }

    fn parse_owned(vars: &[(&'static str, String)]) -> Result<DistEnv, EnvError> {
        let borrowed: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        parse(&borrowed)
    }

    #[test]
    fn reads_torchrun_variables() {
        let env = parse(FULL).unwrap();
        assert_eq!(
            env,
            DistEnv {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                local_world_size: Some(2),
                master_addr: "node0".into(),
                master_port: 29500,
            }
        );
        assert_eq!(env.master_endpoint(), "node0:29500");
        // Round trip through the variables zero-run sets.
        let vars: Vec<(&str, String)> = env.to_vars();
        assert_eq!(parse_owned(&vars).unwrap(), env);
    }

    #[test]
    fn local_world_size_is_optional() {
        let env = parse_owned(&with("LOCAL_WORLD_SIZE", None)).unwrap();
        assert_eq!(env.local_world_size, None);
    }

    #[test]
    fn missing_variables_are_named() {
        for var in [RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT] {
            let error = parse_owned(&with(var, None)).unwrap_err();
            assert_eq!(
                error,
                EnvError::Missing {
                    launcher: EnvSource::Torchrun,
                    var
                }
            );
            assert!(error.to_string().contains(var), "{error}");
        }
    }

    #[test]
    fn malformed_values_are_rejected() {
        let cases = [
            (RANK, "-1"),
            (RANK, "two"),
            (WORLD_SIZE, "0"),
            (LOCAL_RANK, ""),
            (MASTER_PORT, "0"),
            (MASTER_PORT, "70000"),
            (MASTER_ADDR, "  "),
        ];
        for (var, value) in cases {
            match parse_owned(&with(var, Some(value))) {
                Err(EnvError::Invalid { var: got, .. }) => assert_eq!(got, var, "{var}={value}"),
                other => panic!("{var}={value:?}: expected Invalid, got {other:?}"),
            }
        }
    }

    #[test]
    fn rank_must_be_below_world_size() {
        let error = parse_owned(&with(RANK, Some("8"))).unwrap_err();
        assert_eq!(
            error.to_string(),
            "zero-run/torchrun: RANK=8 is not below 8 (WORLD_SIZE)"
        );
    }

    #[test]
    fn local_rank_must_fit_the_node() {
        let error = parse_owned(&with(LOCAL_RANK, Some("2"))).unwrap_err();
        assert!(
            matches!(
                error,
                EnvError::OutOfRange {
                    var: LOCAL_RANK,
                    size_of: LOCAL_WORLD_SIZE,
                    ..
                }
            ),
            "{error}"
        );
        let error = parse_owned(&with(LOCAL_WORLD_SIZE, Some("9"))).unwrap_err();
        assert!(matches!(error, EnvError::Inconsistent { .. }), "{error}");
    }

    #[test]
    fn non_utf8_values_are_reported() {
        let error = DistEnv::from_lookup(|var| match var {
            "RANK" => Some(Err("\u{fffd}".into())),
            "WORLD_SIZE" | "LOCAL_RANK" | "MASTER_ADDR" | "MASTER_PORT" => Some(Ok("1".into())),
            _ => None,
        })
        .unwrap_err();
        assert!(
            matches!(error, EnvError::Invalid { var: "RANK", .. }),
            "{error}"
        );
    }

    #[test]
    fn ipv6_master_is_bracketed() {
        let mut env = DistEnv::single_process(1234);
        env.master_addr = "::1".into();
        assert_eq!(env.master_endpoint(), "[::1]:1234");
    }

    #[test]
    fn nothing_set_is_not_launched() {
        assert_eq!(parse(&[]), Err(EnvError::NotLaunched));
    }
}
