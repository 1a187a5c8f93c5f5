//! Slurm: a task of an `srun` step, read from the step's variables. Rank 0 runs on the step's
//! first node, and the port comes from the job and step ids.
//!
//! What tells an `srun` task from the batch script (or an `salloc` shell): `srun` sets
//! `SLURM_STEP_ID` (and its older spelling `SLURM_STEPID`), `SLURM_STEP_NUM_TASKS`,
//! `SLURM_STEP_NODELIST` and `SLURM_STEP_TASKS_PER_NODE` for each task; the batch script has
//! `SLURM_PROCID=0`, `SLURM_LOCALID=0` and the job's `SLURM_NTASKS`, but no step id. A
//! program started there is one process of a job that asked for N tasks: with N > 1 it is
//! refused ([`EnvError::NotAnSrunStep`]) instead of waiting for ranks that never start.

use super::Reading;
use super::error::EnvError;
use super::hostlist::{MAX_HOSTS, expand_hostlist};
use super::master::{Derived, derived_port};
use super::vars::{Counted, Lookup, Vars, is_set, parse_plain};

/// The job's id.
pub const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
/// The job's id, older spelling.
pub const SLURM_JOBID: &str = "SLURM_JOBID";
/// The step's id, set by `srun` only.
pub const SLURM_STEP_ID: &str = "SLURM_STEP_ID";
/// The step's id, older spelling.
pub const SLURM_STEPID: &str = "SLURM_STEPID";
/// Rank of this task in the step.
pub const SLURM_PROCID: &str = "SLURM_PROCID";
/// Rank of this task on its node.
pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
/// Index of this task's node in the step.
pub const SLURM_NODEID: &str = "SLURM_NODEID";
/// Tasks in the step.
pub const SLURM_STEP_NUM_TASKS: &str = "SLURM_STEP_NUM_TASKS";
/// Tasks in the step under `srun`, in the job in the batch script.
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
/// Older spelling of `SLURM_NTASKS`.
pub const SLURM_NPROCS: &str = "SLURM_NPROCS";
/// The step's nodes, as a compressed host list.
pub const SLURM_STEP_NODELIST: &str = "SLURM_STEP_NODELIST";
/// The job's nodes.
pub const SLURM_JOB_NODELIST: &str = "SLURM_JOB_NODELIST";
/// The job's nodes, older spelling.
pub const SLURM_NODELIST: &str = "SLURM_NODELIST";
/// Tasks on each node of the step (`4(x2),3`).
pub const SLURM_STEP_TASKS_PER_NODE: &str = "SLURM_STEP_TASKS_PER_NODE";
/// Tasks on each node of the job.
pub const SLURM_TASKS_PER_NODE: &str = "SLURM_TASKS_PER_NODE";

/// Step ids from here up are Slurm's own steps (batch script, extern, interactive shell),
/// never an `srun` step of the program.
const FIRST_RESERVED_STEP_ID: u64 = 0xFFFF_FFF0;
const TASK_COUNTS: [&str; 3] = [SLURM_STEP_NUM_TASKS, SLURM_NTASKS, SLURM_NPROCS];
const NODE_LISTS: [&str; 3] = [SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST];
const TASKS_PER_NODE: [&str; 2] = [SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE];

/// Whether this process runs inside a Slurm job.
pub(crate) fn is_present(lookup: Lookup<'_>) -> bool {
    [SLURM_JOB_ID, SLURM_JOBID, SLURM_PROCID]
        .iter()
        .any(|var| is_set(lookup, var))
}

/// The rank and size of the `srun` step this process is a task of, for detection (`None`
/// outside a step).
pub(crate) fn step_rank_and_size(lookup: Lookup<'_>) -> Option<(usize, usize)> {
    let step = [SLURM_STEP_ID, SLURM_STEPID]
        .iter()
        .find_map(|var| parse_plain(lookup, var))?;
    if step as u64 >= FIRST_RESERVED_STEP_ID {
        return None;
    }
    let size = TASK_COUNTS
        .iter()
        .find_map(|var| parse_plain(lookup, var))?;
    Some((parse_plain(lookup, SLURM_PROCID)?, size))
}

/// Reads this task's place in its `srun` step; refuses a process outside a step when the
/// job has more than one task.
pub(crate) fn read(vars: &Vars<'_>) -> Result<Reading, EnvError> {
    let (job_var, job_text) = vars
        .first(&[SLURM_JOB_ID, SLURM_JOBID])?
        .ok_or_else(|| vars.missing(SLURM_JOB_ID))?;
    let job_id = job_text
        .trim()
        .parse::<u64>()
        .map_err(|_| vars.invalid(job_var, &job_text, "expected a job id (an integer)"))?;
    match step_id(vars)? {
        Some(step) => read_step(vars, job_id, step),
        None => outside_step(vars, job_text.trim(), job_id),
    }
}

/// The `srun` step's id, `None` when this process is not a task of one.
fn step_id(vars: &Vars<'_>) -> Result<Option<u64>, EnvError> {
    let Some((var, text)) = vars.first(&[SLURM_STEP_ID, SLURM_STEPID])? else {
        return Ok(None);
    };
    match text.trim().parse::<u64>() {
        Ok(step) if step < FIRST_RESERVED_STEP_ID => Ok(Some(step)),
        Ok(_) => Ok(None),
        Err(_) if ["batch", "extern", "interactive"].contains(&text.trim()) => Ok(None),
        Err(_) => Err(vars.invalid(var, &text, "expected a step id (an integer)")),
    }
}

/// A process of the job that `srun` did not start: one rank of one when the job has one task.
fn outside_step(vars: &Vars<'_>, job_text: &str, job_id: u64) -> Result<Reading, EnvError> {
    let tasks = vars.count(&[SLURM_NTASKS, SLURM_NPROCS], 1)?;
    if let Some(tasks) = tasks.filter(|tasks| tasks.value > 1) {
        return Err(EnvError::NotAnSrunStep {
            job_id: job_text.to_string(),
            tasks: tasks.value,
            tasks_var: tasks.var,
        });
    }
    let alone = "a process of the job outside any srun step";
    let one = |value| Counted { var: alone, value };
    Ok(Reading {
        rank: one(0),
        world_size: one(1),
        local_rank: one(0),
        local_world_size: Some(one(1)),
        addr: Derived::Known("127.0.0.1".into(), "the loopback (a one-rank job)"),
        port: Derived::Known(derived_port(job_id, FIRST_RESERVED_STEP_ID), "SLURM_JOB_ID"),
    })
}

/// A task of `srun` step `job_id.step`.
fn read_step(vars: &Vars<'_>, job_id: u64, step: u64) -> Result<Reading, EnvError> {
    let world_size = vars.required_count(&TASK_COUNTS, 1)?;
    let rank = vars.required_count(&[SLURM_PROCID], 0)?;
    vars.check_below(rank, world_size.value, world_size.var)?;
    let local_rank = vars.required_count(&[SLURM_LOCALID], 0)?;
    let layout = Layout::read(vars, world_size)?;
    let node = match vars.count(&[SLURM_NODEID], 0)? {
        Some(node) => node,
        None => Counted {
            var: "the node of SLURM_PROCID under block distribution",
            value: layout.block_node(rank.value).unwrap_or(0),
        },
    };
    if let Some(nodes) = layout.node_count() {
        vars.check_below(node, nodes, "the nodes of the step")?;
    }
    let local_world_size = layout.tasks.as_ref().map(|(var, tasks)| Counted {
        var,
        value: tasks[node.value],
    });
    let addr = match (&layout.hosts, layout.block_node(0)) {
        (Some((_, hosts)), first) => Derived::Known(
            hosts[first.unwrap_or(0)].clone(),
            "the host of rank 0 in the step's node list (block distribution)",
        ),
        (None, _) if layout.node_count() == Some(1) => Derived::Known(
            "127.0.0.1".into(),
            "the loopback (every rank is on this node)",
        ),
        (None, _) => Derived::Unknown(format!("{SLURM_STEP_NODELIST} is not set")),
    };
    Ok(Reading {
        rank,
        world_size,
        local_rank,
        local_world_size,
        addr,
        port: Derived::Known(derived_port(job_id, step), "SLURM_JOB_ID and SLURM_STEP_ID"),
    })
}

/// The step's nodes and tasks per node, checked against each other and the task count.
struct Layout {
    tasks: Option<(&'static str, Vec<usize>)>,
    hosts: Option<(&'static str, Vec<String>)>,
}

impl Layout {
    fn read(vars: &Vars<'_>, world_size: Counted) -> Result<Layout, EnvError> {
        let tasks = match vars.first(&TASKS_PER_NODE)? {
            Some((var, text)) => {
                let tasks =
                    expand_tasks_per_node(&text).map_err(|r| vars.invalid(var, &text, r))?;
                let total: usize = tasks.iter().sum();
                if total != world_size.value {
                    return Err(vars.inconsistent(format!(
                        "{var}={text:?} adds up to {total} tasks but {}={}",
                        world_size.var, world_size.value
                    )));
                }
                Some((var, text, tasks))
            }
            None => None,
        };
        let hosts = match vars.first(&NODE_LISTS)? {
            Some((var, text)) => {
                let hosts = expand_hostlist(&text)
                    .map_err(|error| vars.invalid(var, &text, &error.to_string()))?;
                Some((var, text, hosts))
            }
            None => None,
        };
        if let (Some((tasks_var, tasks_text, tasks)), Some((nodes_var, nodes_text, hosts))) =
            (&tasks, &hosts)
            && tasks.len() != hosts.len()
        {
            return Err(EnvError::NodeListMismatch {
                launcher: vars.launcher(),
                tasks_var,
                tasks: tasks_text.clone(),
                task_nodes: tasks.len(),
                nodes_var,
                nodes: nodes_text.clone(),
                listed_nodes: hosts.len(),
            });
        }
        Ok(Layout {
            tasks: tasks.map(|(var, _, tasks)| (var, tasks)),
            hosts: hosts.map(|(var, _, hosts)| (var, hosts)),
        })
    }

    fn node_count(&self) -> Option<usize> {
        match (&self.tasks, &self.hosts) {
            (Some((_, tasks)), _) => Some(tasks.len()),
            (None, Some((_, hosts))) => Some(hosts.len()),
            (None, None) => None,
        }
    }

    /// The node of `rank` when the step's tasks fill the nodes in order (Slurm's block
    /// distribution, its default); `None` without a tasks-per-node list.
    fn block_node(&self, rank: usize) -> Option<usize> {
        let (_, tasks) = self.tasks.as_ref()?;
        let mut first = 0;
        tasks.iter().position(|&count| {
            first += count;
            rank < first
        })
    }
}

/// Expands Slurm's tasks-per-node form (`4(x2),3` is `4 4 3`).
pub(crate) fn expand_tasks_per_node(text: &str) -> Result<Vec<usize>, &'static str> {
    const FORM: &str = "expected counts like 4(x2),3";
    let mut tasks = Vec::new();
    for item in text.trim().split(',') {
        let (count, repeat) = match item.split_once('(') {
            Some((count, rest)) => {
                let repeat = rest
                    .strip_prefix('x')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or(FORM)?;
                (count, repeat.parse::<usize>().map_err(|_| FORM)?)
            }
            None => (item, 1),
        };
        let count = count.parse::<usize>().map_err(|_| FORM)?;
        if count == 0 || repeat == 0 {
            return Err("a node with no tasks, or a repeat of zero");
        }
        if tasks.len() + repeat > MAX_HOSTS {
            return Err("more nodes than any cluster has");
        }
        tasks.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_per_node_forms() {
        assert_eq!(expand_tasks_per_node("4(x2),3"), Ok(vec![4, 4, 3]));
        assert_eq!(expand_tasks_per_node("8"), Ok(vec![8]));
        assert_eq!(expand_tasks_per_node("2,1(x3)"), Ok(vec![2, 1, 1, 1]));
        for bad in ["", "4(x)", "4(2)", "4(x2", "x", "0", "4(x0)", "4,,3", "-1"] {
            assert!(expand_tasks_per_node(bad).is_err(), "{bad:?}");
        }
        assert!(expand_tasks_per_node("1(x99999999)").is_err());
    }
}
