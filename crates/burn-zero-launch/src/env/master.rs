//! Where rank 0 listens: `MASTER_ADDR` and `MASTER_PORT` when set, otherwise what the
//! launcher's own variables imply (its first node, the loopback, a port from the job's ids).

use std::fmt;

use super::error::EnvError;
use super::vars::Vars;

/// Host name or address of the rank-0 process, where the others meet.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// TCP port rank 0 listens on for the rendezvous.
pub const MASTER_PORT: &str = "MASTER_PORT";

/// The port when neither `MASTER_PORT` nor the launcher gives one (torchrun's default).
pub const DEFAULT_PORT: u16 = 29500;
/// First port of the range a scheduler job's port is derived into.
pub const DERIVED_PORT_BASE: u16 = 20000;
/// Size of that range: 20000–29999, below Linux's ephemeral ports (32768 and up), so that no
/// outgoing connection holds the port when rank 0 binds it.
pub const DERIVED_PORT_SPAN: u16 = 10000;

/// The rendezvous port of a scheduler's job step, when `MASTER_PORT` is not set:
/// `20000 + (97 × (job mod 10000) + step) mod 10000`.
///
/// Every rank of a step computes the same port without talking to the others. Two steps of
/// one job whose ids differ by less than 10000 get different ports (so concurrent `srun`
/// steps do not collide), and so do step 0 of two jobs whose ids differ by less than 10000
/// (97 and 10000 share no factor). A collision with another program's port is still
/// possible: `MASTER_PORT` overrides.
pub fn derived_port(job_id: u64, step_id: u64) -> u16 {
    let span = u64::from(DERIVED_PORT_SPAN);
    let offset = ((job_id % span) * 97 + step_id % span) % span;
    DERIVED_PORT_BASE + offset as u16
}

/// A master address or port as the launcher implies it, before `MASTER_ADDR` and
/// `MASTER_PORT` override it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Derived<T> {
    /// This value, derived as the text says.
    Known(T, &'static str),
    /// The launcher does not say, for this reason: the variable is required.
    Unknown(String),
    /// The launcher always sets `MASTER_ADDR`/`MASTER_PORT` itself: missing is an error.
    Required,
}

/// Where the master's address and port came from, for logs and errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MasterOrigin {
    /// `MASTER_ADDR`, or how the address was derived.
    pub addr: &'static str,
    /// `MASTER_PORT`, or how the port was derived.
    pub port: &'static str,
}

impl fmt::Display for MasterOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "address from {}, port from {}", self.addr, self.port)
    }
}

/// The master's address and port: `MASTER_ADDR`/`MASTER_PORT` when set, else `addr`/`port`.
pub(crate) fn resolve(
    vars: &Vars<'_>,
    addr: Derived<String>,
    port: Derived<u16>,
) -> Result<(String, u16, MasterOrigin), EnvError> {
    let (addr, addr_origin) = match (vars.text(MASTER_ADDR)?, addr) {
        (Some(text), _) => {
            if text.trim().is_empty() {
                return Err(vars.invalid(MASTER_ADDR, &text, "empty host name"));
            }
            (text.trim().to_string(), MASTER_ADDR)
        }
        (None, Derived::Known(addr, origin)) => (addr, origin),
        (None, Derived::Unknown(reason)) => {
            return Err(EnvError::MasterUnknown {
                launcher: vars.launcher(),
                reason,
            });
        }
        (None, Derived::Required) => return Err(vars.missing(MASTER_ADDR)),
    };
    let (port, port_origin) = match (vars.text(MASTER_PORT)?, port) {
        (Some(text), _) => (parse_port(vars, &text)?, MASTER_PORT),
        (None, Derived::Known(port, origin)) => (port, origin),
        (None, Derived::Unknown(reason)) => {
            return Err(EnvError::MasterUnknown {
                launcher: vars.launcher(),
                reason,
            });
        }
        (None, Derived::Required) => return Err(vars.missing(MASTER_PORT)),
    };
    let origin = MasterOrigin {
        addr: addr_origin,
        port: port_origin,
    };
    Ok((addr, port, origin))
}

fn parse_port(vars: &Vars<'_>, text: &str) -> Result<u16, EnvError> {
    match text.trim().parse::<u16>() {
        Ok(0) | Err(_) => Err(vars.invalid(MASTER_PORT, text, "expected a TCP port, 1 to 65535")),
        Ok(port) => Ok(port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ports_stay_in_their_range() {
        for job in [0, 1, 9_999, 10_000, 4_294_967_295, u64::MAX] {
            for step in [0, 1, 9_999, u64::MAX] {
                let port = derived_port(job, step);
                assert!((20_000..30_000).contains(&port), "{job}.{step}: {port}");
            }
        }
    }

    #[test]
    fn steps_of_one_job_get_different_ports() {
        let ports: std::collections::BTreeSet<u16> = (0..10_000)
            .map(|step| derived_port(123_456, step))
            .collect();
        assert_eq!(ports.len(), 10_000);
    }

    #[test]
    fn first_steps_of_nearby_jobs_get_different_ports() {
        let ports: std::collections::BTreeSet<u16> =
            (500_000..510_000).map(|job| derived_port(job, 0)).collect();
        assert_eq!(ports.len(), 10_000);
    }
}
