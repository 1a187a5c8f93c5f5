//! `DistEnv`: who this process is in a multi-process job, read from the environment variables
//! that `zero-run` (and PyTorch's `torchrun`) set for every rank.

pub mod hostlist;

use std::fmt;

pub use hostlist::{HostListError, expand_hostlist};

/// Global rank of this process, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Number of processes in the job, over every node.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank of this process on its node; usually the index of its GPU.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of processes on this node (optional: `torchrun` sets it, older launchers do not).
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Host name or address of the rank-0 process, where the others meet.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// TCP port rank 0 listens on for the rendezvous.
pub const MASTER_PORT: &str = "MASTER_PORT";

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

/// A launcher variable that is missing or malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A required variable is not set.
    #[error(
        "environment variable {var} is not set: start the ranks with `zero-run` (or torchrun), \
         or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself"
    )]
    Missing {
        /// The variable.
        var: &'static str,
    },
    /// A variable whose value does not parse or is out of its range.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value (lossily decoded when it is not UTF-8).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Two variables that contradict each other.
    #[error("inconsistent launcher environment: {0}")]
    Inconsistent(String),
}

impl DistEnv {
    /// Reads the variables of this process.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|var| {
            std::env::var_os(var).map(|value| match value.into_string() {
                Ok(text) => Ok(text),
                Err(raw) => Err(raw.to_string_lossy().into_owned()),
            })
        })
    }

    /// Whether this process looks like one rank of a launched job (`RANK` and `WORLD_SIZE` are
    /// set); a program can fall back to a single-process run otherwise.
    pub fn is_launched() -> bool {
        std::env::var_os(RANK).is_some() && std::env::var_os(WORLD_SIZE).is_some()
    }

    /// Parses the variables from `lookup`, which answers `None` for an unset variable and
    /// `Err(lossy text)` for a value that is not valid UTF-8. Used by [`DistEnv::from_env`] and
    /// by tests.
    pub fn from_lookup<L>(lookup: L) -> Result<Self, EnvError>
    where
        L: Fn(&str) -> Option<Result<String, String>>,
    {
        let read = |var: &'static str| -> Result<Option<String>, EnvError> {
            match lookup(var) {
                None => Ok(None),
                Some(Ok(text)) => Ok(Some(text)),
                Some(Err(lossy)) => Err(EnvError::Invalid {
                    var,
                    value: lossy,
                    reason: "not valid UTF-8".into(),
                }),
            }
        };
        let required = |var: &'static str| read(var)?.ok_or(EnvError::Missing { var });

        let world_size = parse_count(WORLD_SIZE, &required(WORLD_SIZE)?, 1)?;
        let rank = parse_count(RANK, &required(RANK)?, 0)?;
        if rank >= world_size {
            return Err(EnvError::Invalid {
                var: RANK,
                value: rank.to_string(),
                reason: format!("must be below WORLD_SIZE={world_size}"),
            });
        }
        let local_rank = parse_count(LOCAL_RANK, &required(LOCAL_RANK)?, 0)?;
        let local_world_size = read(LOCAL_WORLD_SIZE)?
            .map(|text| parse_count(LOCAL_WORLD_SIZE, &text, 1))
            .transpose()?;
        if let Some(local_world_size) = local_world_size {
            if local_rank >= local_world_size {
                return Err(EnvError::Inconsistent(format!(
                    "LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}"
                )));
            }
            if local_world_size > world_size {
                return Err(EnvError::Inconsistent(format!(
                    "LOCAL_WORLD_SIZE={local_world_size} is larger than WORLD_SIZE={world_size}"
                )));
            }
        }
        let master_addr = required(MASTER_ADDR)?;
        if master_addr.trim().is_empty() {
            return Err(EnvError::Invalid {
                var: MASTER_ADDR,
                value: master_addr,
                reason: "empty host name".into(),
            });
        }
        let port_text = required(MASTER_PORT)?;
        let master_port = match port_text.trim().parse::<u16>() {
            Ok(0) | Err(_) => {
                return Err(EnvError::Invalid {
                    var: MASTER_PORT,
                    value: port_text,
                    reason: "expected a TCP port, 1 to 65535".into(),
                });
            }
            Ok(port) => port,
        };
        Ok(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: master_addr.trim().to_string(),
            master_port,
        })
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

/// Parses a non-negative integer that must be at least `min`.
fn parse_count(var: &'static str, text: &str, min: usize) -> Result<usize, EnvError> {
    match text.trim().parse::<usize>() {
        Ok(value) if value >= min => Ok(value),
        Ok(_) => Err(EnvError::Invalid {
            var,
            value: text.to_string(),
            reason: format!("must be at least {min}"),
        }),
        Err(_) => Err(EnvError::Invalid {
            var,
            value: text.to_string(),
            reason: "expected a non-negative integer".into(),
        }),
    }
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
            assert_eq!(error, EnvError::Missing { var });
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
        assert!(
            error.to_string().contains("must be below WORLD_SIZE=8"),
            "{error}"
        );
    }

    #[test]
    fn local_rank_must_fit_the_node() {
        let error = parse_owned(&with(LOCAL_RANK, Some("2"))).unwrap_err();
        assert!(matches!(error, EnvError::Inconsistent(_)), "{error}");
    }

    #[test]
    fn non_utf8_values_are_reported() {
        let error = DistEnv::from_lookup(|var| match var {
            "RANK" => Some(Err("\u{fffd}".into())),
            _ => Some(Ok("1".into())),
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
}
