//! IBM LSF with `jsrun` (its CSM systems): ranks from `JSM_NAMESPACE_*`, the master from
//! `LSB_MCPU_HOSTS`, the port from `LSB_JOBID`.

use super::Reading;
use super::error::EnvError;
use super::master::{DEFAULT_PORT, Derived, derived_port};
use super::vars::{Lookup, Vars, parse_plain};

/// Rank of this process among jsrun's ranks.
pub const JSM_NAMESPACE_RANK: &str = "JSM_NAMESPACE_RANK";
/// Number of ranks jsrun started.
pub const JSM_NAMESPACE_SIZE: &str = "JSM_NAMESPACE_SIZE";
/// Rank on this node.
pub const JSM_NAMESPACE_LOCAL_RANK: &str = "JSM_NAMESPACE_LOCAL_RANK";
/// Number of ranks on this node.
pub const JSM_NAMESPACE_LOCAL_SIZE: &str = "JSM_NAMESPACE_LOCAL_SIZE";
/// The LSF job's id.
pub const LSB_JOBID: &str = "LSB_JOBID";
/// The job's hosts with their slot counts: `host1 n1 host2 n2 …`.
pub const LSB_MCPU_HOSTS: &str = "LSB_MCPU_HOSTS";

/// jsrun's rank and size, for detection.
pub(crate) fn rank_and_size(lookup: Lookup<'_>) -> Option<(usize, usize)> {
    Some((
        parse_plain(lookup, JSM_NAMESPACE_RANK)?,
        parse_plain(lookup, JSM_NAMESPACE_SIZE)?,
    ))
}

/// Reads jsrun's variables. The master: the loopback when every rank is on this node;
/// otherwise the first compute host of `LSB_MCPU_HOSTS`. On the CSM systems jsrun runs on,
/// that list starts with the launch node, which runs no rank, and jsrun places rank 0 on the
/// first compute host, the list's second entry (a one-host list is that host). The port
/// comes from `LSB_JOBID` (as [`derived_port`] with step 0; two jsrun steps of one job at once
/// need `MASTER_PORT`).
pub(crate) fn read(vars: &Vars<'_>) -> Result<Reading, EnvError> {
    let world_size = vars.required_count(&[JSM_NAMESPACE_SIZE], 1)?;
    let rank = vars.required_count(&[JSM_NAMESPACE_RANK], 0)?;
    let local_rank = vars.required_count(&[JSM_NAMESPACE_LOCAL_RANK], 0)?;
    let local_world_size = vars.count(&[JSM_NAMESPACE_LOCAL_SIZE], 1)?;
    let hosts = vars
        .text(LSB_MCPU_HOSTS)?
        .map(|text| mcpu_hosts(vars, &text))
        .transpose()?;
    let one_node = world_size.value == 1
        || local_world_size.is_some_and(|local| local.value == world_size.value);
    let addr = match hosts {
        _ if one_node => Derived::Known(
            "127.0.0.1".into(),
            "the loopback (every rank is on this node)",
        ),
        Some(hosts) if hosts.len() >= 2 => Derived::Known(
            hosts[1].clone(),
            "the first compute host of LSB_MCPU_HOSTS (after the launch node)",
        ),
        Some(hosts) => Derived::Known(hosts[0].clone(), "the one host of LSB_MCPU_HOSTS"),
        None => Derived::Unknown(format!("{LSB_MCPU_HOSTS} is not set")),
    };
    let port = match vars.count(&[LSB_JOBID], 0)? {
        Some(job) => Derived::Known(derived_port(job.value as u64, 0), "LSB_JOBID"),
        None => Derived::Known(DEFAULT_PORT, "the default port 29500"),
    };
    Ok(Reading {
        rank,
        world_size,
        local_rank,
        local_world_size,
        addr,
        port,
    })
}

/// The hosts of `LSB_MCPU_HOSTS` (`host1 n1 host2 n2 …`), in order.
fn mcpu_hosts(vars: &Vars<'_>, text: &str) -> Result<Vec<String>, EnvError> {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.is_empty() || !words.len().is_multiple_of(2) {
        return Err(vars.invalid(
            LSB_MCPU_HOSTS,
            text,
            "expected pairs of a host and its slot count",
        ));
    }
    words
        .chunks(2)
        .map(|pair| match pair[1].parse::<usize>() {
            Ok(slots) if slots >= 1 => Ok(pair[0].to_string()),
            _ => Err(vars.invalid(
                LSB_MCPU_HOSTS,
                text,
                &format!(
                    "slot count {:?} of host {} is not a positive integer",
                    pair[1], pair[0]
                ),
            )),
        })
        .collect()
}
