//! The supervisor behind `zero-run`: starts this node's ranks with the launcher environment,
//! prefixes their output, forwards SIGINT/SIGTERM, and when ranks fail, stops the others and
//! reports the rank whose failure caused the rest, with its reason and exit code.
//!
//! Which rank process exits first says little about which rank failed first: a rank that
//! fails tells the others through a collective, and they may well return, print their
//! consequence and exit before it does. The job's control store, in rank 0's process, knows
//! better: it keeps the first rank that reported its failure or aborted
//! ([`crate::control::FirstCause`]). The supervisor gives every rank the path of a fresh file
//! ([`CAUSE_FILE_VAR`]), the store writes the cause there, and once the other ranks had their
//! grace to end (before any is killed, which the store would record as a lost rank), the
//! supervisor reads it and names that rank. Without the file (a node other than rank 0's, or a
//! program that runs no control store) it names the first rank to exit with a failure, and
//! says so.

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::control::{CAUSE_FILE_VAR, FirstCause};
use crate::env::DistEnv;
use crate::name_server::{NameServer, SERVER_URI_VAR};
use crate::output::{self, Sink};
use crate::signals::{self, SIGKILL, SIGTERM};

/// How often the supervisor looks at its ranks and at pending signals.
const POLL: Duration = Duration::from_millis(20);

/// What to start on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunConfig {
    /// Ranks on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`; its ranks are `node_rank * nproc_per_node ..`.
    pub node_rank: usize,
    /// Host of global rank 0 (on node 0).
    pub master_addr: String,
    /// Port of the rendezvous on the master.
    pub master_port: u16,
    /// The program every rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// How long ranks get to exit after SIGTERM (or a forwarded signal) before SIGKILL.
    pub stop_timeout: Duration,
    /// How long the other ranks get to end by themselves once a rank failed, before they are
    /// sent SIGTERM: ranks that fail together (one failed, the others learned of it) then
    /// print their own errors and exit with their own codes, rather than being cut short.
    pub failure_grace: Duration,
    /// Prefix each output line with `[rank N] `.
    pub prefix_output: bool,
    /// Run every rank of this node on this one GPU ([`RunConfig::gpu_sharing_vars`]).
    pub share_gpu: Option<usize>,
}

impl RunConfig {
    /// A single-node configuration with the defaults of `zero-run`.
    pub fn new(nproc_per_node: usize, program: impl Into<OsString>) -> Self {
        RunConfig {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            program: program.into(),
            args: Vec::new(),
            stop_timeout: Duration::from_secs(10),
            failure_grace: Duration::from_secs(3),
            prefix_output: true,
            share_gpu: None,
        }
    }

    /// Total number of ranks.
    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// Checks that the configuration describes a job.
    pub fn validate(&self) -> Result<(), SupervisorError> {
        let invalid = |reason: String| Err(SupervisorError::Invalid(reason));
        if self.nproc_per_node == 0 {
            return invalid("--nproc-per-node must be at least 1".into());
        }
        if self.nnodes == 0 {
            return invalid("--nnodes must be at least 1".into());
        }
        if self.node_rank >= self.nnodes {
            return invalid(format!(
                "--node-rank {} is not below --nnodes {}",
                self.node_rank, self.nnodes
            ));
        }
        if self.master_port == 0 {
            return invalid("--master-port must be a port, 1 to 65535".into());
        }
        if self.master_addr.trim().is_empty() {
            return invalid("--master-addr is empty".into());
        }
        if self.program.is_empty() {
            return invalid("no program to run (give it after `--`)".into());
        }
        if u32::try_from(self.world_size()).is_err() {
            return invalid("world size is too large".into());
        }
        Ok(())
    }

    /// What a rank's process is told so that every rank of this node runs on GPU
    /// [`RunConfig::share_gpu`], and NCCL accepts several ranks of one communicator there:
    /// `CUDA_VISIBLE_DEVICES` names that GPU alone (so each process sees it as device 0);
    /// `NCCL_HOSTID`, different for every rank of the job, makes NCCL before 2.30.7 take the
    /// ranks for ranks of different hosts (it refuses two ranks on one GPU of one host; they then
    /// meet over sockets: slow, correct); `NCCL_MULTI_RANK_GPU_ENABLE=1` allows it outright
    /// from NCCL 2.30.7. For testing several ranks on a machine with one GPU. Empty without
    /// `share_gpu`.
    pub fn gpu_sharing_vars(&self, rank: usize) -> Vec<(&'static str, OsString)> {
        let Some(gpu) = self.share_gpu else {
            return Vec::new();
        };
        vec![
            ("CUDA_VISIBLE_DEVICES", gpu.to_string().into()),
            (
                "NCCL_HOSTID",
                format!(
                    "burn-zero-{}-{}-rank-{rank}",
                    self.master_addr, self.master_port
                )
                .into(),
            ),
            ("NCCL_MULTI_RANK_GPU_ENABLE", "1".into()),
        ]
    }

    /// The environment of local rank `local_rank` of this node.
    pub fn rank_env(&self, local_rank: usize) -> DistEnv {
        DistEnv {
            rank: self.node_rank * self.nproc_per_node + local_rank,
            world_size: self.world_size(),
            local_rank,
            local_world_size: Some(self.nproc_per_node),
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
        }
    }
}

/// How a rank process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl Exit {
    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => Exit::Code(code),
            (None, Some(signal)) => Exit::Signal(signal),
            (None, None) => Exit::Code(1),
        }
    }

    /// Whether the rank succeeded.
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    /// The exit code a shell would report: the code, or 128 + the signal.
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(code) => code,
            Exit::Signal(signal) => 128 + signal,
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exit code {code}"),
            Exit::Signal(signal) => write!(f, "killed by {}", signals::signal_name(*signal)),
        }
    }
}

/// How the job ended on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank exited with code 0.
    Succeeded,
    /// Ranks failed (the others were stopped).
    RankFailed {
        /// The global rank whose failure caused the others: the first rank of the job that
        /// reported its failure to the control store or aborted the job (`reason` is then
        /// set), or, when no report reached this node, the first of this node's ranks to exit
        /// with a failure.
        rank: usize,
        /// How that rank ended. When the cause is a rank of another node (`on_this_node` is
        /// false), how the first of this node's ranks to fail ended.
        exit: Exit,
        /// The reason the rank gave the job's control store; `None` when no report reached
        /// this node.
        reason: Option<String>,
        /// This node's other ranks that failed or were stopped: consequences of the cause.
        consequences: Vec<usize>,
        /// Whether the cause is one of this node's ranks.
        on_this_node: bool,
    },
    /// The supervisor received a signal and passed it on to the ranks.
    Interrupted {
        /// The signal.
        signal: i32,
    },
}

impl Outcome {
    /// The exit code of `zero-run`: 0, the failed rank's code, or 128 + the signal.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Succeeded => 0,
            Outcome::RankFailed { exit, .. } => match exit.code() {
                // A failure must not read as success, whatever the code.
                0 => 1,
                code => code,
            },
            Outcome::Interrupted { signal } => 128 + signal,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Succeeded => write!(f, "every rank succeeded"),
            Outcome::Interrupted { signal } => write!(
                f,
                "interrupted by {}; the ranks were stopped",
                signals::signal_name(*signal)
            ),
            Outcome::RankFailed {
                rank,
                exit,
                reason,
                consequences,
                on_this_node,
            } => {
                match (reason, on_this_node) {
                    (Some(reason), true) => write!(
                        f,
                        "rank {rank} failed ({exit}) and caused the job's failure: {reason}"
                    )?,
                    (Some(reason), false) => write!(
                        f,
                        "rank {rank}, on another node, failed and caused the job's failure: \
                         {reason}"
                    )?,
                    (None, _) => write!(
                        f,
                        "rank {rank} failed ({exit}), the first rank to exit; no rank reported \
                         a cause to this node, so it may itself be a consequence"
                    )?,
                }
                if !consequences.is_empty() {
                    let listed = rank_list(consequences);
                    match reason {
                        Some(_) => write!(f, "; {listed} stopped as a consequence")?,
                        None => write!(f, "; {listed} also failed or were stopped")?,
                    }
                }
                Ok(())
            }
        }
    }
}

/// `rank 3` or `ranks 0, 2`.
fn rank_list(ranks: &[usize]) -> String {
    let numbers: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match numbers.as_slice() {
        [one] => format!("rank {one}"),
        _ => format!("ranks {}", numbers.join(", ")),
    }
}

/// Why the supervisor could not run the job.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// The configuration does not describe a job.
    #[error("invalid launch: {0}")]
    Invalid(String),
    /// A rank could not be started (the ranks already started were stopped).
    #[error("could not start rank {rank} ({program}): {source}")]
    Spawn {
        /// The global rank.
        rank: usize,
        /// The program.
        program: String,
        /// The system's error.
        source: io::Error,
    },
    /// The supervisor could not set up its own plumbing.
    #[error("supervisor failure: {0}")]
    Io(#[from] io::Error),
}

struct Rank {
    rank: usize,
    child: Child,
    exit: Option<Exit>,
}

/// Runs this node's ranks to completion; see the module documentation.
///
/// Installs handlers for SIGINT and SIGTERM in this process (the first forwards the signal to
/// every rank, a second one kills them).
pub fn run(config: &RunConfig) -> Result<Outcome, SupervisorError> {
    config.validate()?;
    signals::catch_termination()?;
    let program = config.program.to_string_lossy().into_owned();
    tracing::info!(
        ranks = config.nproc_per_node,
        world_size = config.world_size(),
        node = config.node_rank,
        master = %format!("{}:{}", config.master_addr, config.master_port),
        %program,
        "starting ranks"
    );
    let cause_dir = CauseDir::create()
        .inspect_err(|error| {
            tracing::warn!(%error, "no cause file: a failure will be blamed on the first rank to exit");
        })
        .ok();
    let cause_file = cause_dir.as_ref().map(CauseDir::file);
    // Ranks that use MPI join through Open MPI's name server (see `name_server`); one node's
    // ranks only: another node's zero-run has no way to learn its address.
    let name_server = (config.nnodes == 1
        && config.world_size() > 1
        && std::env::var_os(SERVER_URI_VAR).is_none())
    .then(|| {
        cause_dir
            .as_ref()
            .and_then(|dir| NameServer::start(dir.path()))
    })
    .flatten();
    let extra_env: Vec<(&str, OsString)> = name_server.iter().map(NameServer::env).collect();

    let mut ranks: Vec<Rank> = Vec::with_capacity(config.nproc_per_node);
    let mut forwarders: Vec<JoinHandle<()>> = Vec::new();
    for local_rank in 0..config.nproc_per_node {
        let env = config.rank_env(local_rank);
        match spawn_rank(
            config,
            &env,
            cause_file.as_deref(),
            &extra_env,
            &mut forwarders,
        ) {
            Ok(child) => ranks.push(Rank {
                rank: env.rank,
                child,
                exit: None,
            }),
            Err(source) => {
                stop(&mut ranks, SIGTERM, config.stop_timeout);
                join_all(forwarders);
                return Err(SupervisorError::Spawn {
                    rank: env.rank,
                    program,
                    source,
                });
            }
        }
    }

    let ended = supervise(&mut ranks, config, cause_file.as_deref());
    join_all(forwarders);
    let outcome = match ended {
        Ended::Succeeded => Outcome::Succeeded,
        Ended::Interrupted(signal) => Outcome::Interrupted { signal },
        Ended::Failed { first, cause } => {
            if cause.is_none() && config.world_size() > 1 {
                tracing::warn!("{}", no_cause_explanation(config));
            }
            let exits: Vec<(usize, Option<Exit>)> =
                ranks.iter().map(|r| (r.rank, r.exit)).collect();
            blame(&exits, first, cause)
        }
    };
    match &outcome {
        Outcome::Succeeded => tracing::info!("{outcome}"),
        Outcome::RankFailed { .. } => tracing::error!("{outcome}"),
        Outcome::Interrupted { .. } => tracing::warn!("{outcome}"),
    }
    Ok(outcome)
}

/// Why no cause was read, for the log.
fn no_cause_explanation(config: &RunConfig) -> String {
    let why = if config.node_rank == 0 {
        "no rank reported its failure to the job's control store (the program may run none)"
    } else {
        "the job's control store runs with rank 0 on node 0 and writes the cause there, not on \
         this node"
    };
    format!("{why}: naming the first rank to exit with a failure")
}

/// The cause the store wrote, if any; a file that cannot be read is logged and ignored.
fn read_cause(path: &Path) -> Option<FirstCause> {
    FirstCause::read_from(path)
        .inspect_err(|error| tracing::warn!(%error, "ignoring the cause file"))
        .ok()
        .flatten()
}

/// The outcome once every rank has ended: `exits` holds how each of this node's ranks ended,
/// `first` is the first rank to exit with a failure and `cause` what the job's control store
/// recorded.
fn blame(exits: &[(usize, Option<Exit>)], first: usize, cause: Option<FirstCause>) -> Outcome {
    let exit_of = |rank: usize| {
        exits
            .iter()
            .find(|(r, _)| *r == rank)
            .and_then(|(_, exit)| *exit)
    };
    let failed = |except: usize| -> Vec<usize> {
        exits
            .iter()
            .filter(|(r, exit)| *r != except && exit.is_some_and(|exit| !exit.success()))
            .map(|(r, _)| *r)
            .collect()
    };
    let first_exit = exit_of(first).unwrap_or(Exit::Code(1));
    match cause {
        Some(FirstCause { rank, reason }) => {
            let here = exit_of(rank);
            Outcome::RankFailed {
                rank,
                exit: here.unwrap_or(first_exit),
                reason: Some(reason),
                consequences: failed(rank),
                on_this_node: here.is_some(),
            }
        }
        None => Outcome::RankFailed {
            rank: first,
            exit: first_exit,
            reason: None,
            consequences: failed(first),
            on_this_node: true,
        },
    }
}

/// A directory of this zero-run invocation, only its user may enter, removed when dropped:
/// where rank 0's control store writes the job's first cause, and Open MPI's name server its
/// address.
struct CauseDir(tempfile::TempDir);

impl CauseDir {
    fn create() -> io::Result<Self> {
        tempfile::Builder::new()
            .prefix("zero-run-")
            .permissions(fs::Permissions::from_mode(0o700))
            .tempdir()
            .map(CauseDir)
    }

    fn path(&self) -> &Path {
        self.0.path()
    }

    fn file(&self) -> PathBuf {
        self.path().join("cause")
    }
}

fn spawn_rank(
    config: &RunConfig,
    env: &DistEnv,
    cause_file: Option<&Path>,
    extra_env: &[(&str, OsString)],
    forwarders: &mut Vec<JoinHandle<()>>,
) -> io::Result<Child> {
    let mut command = Command::new(&config.program);
    command.args(&config.args).stdin(Stdio::null());
    for (var, value) in env.to_vars() {
        command.env(var, value);
    }
    for (var, value) in extra_env
        .iter()
        .cloned()
        .chain(config.gpu_sharing_vars(env.rank))
    {
        command.env(var, value);
    }
    if let Some(file) = cause_file {
        command.env(CAUSE_FILE_VAR, file);
    }
    if config.prefix_output {
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    signals::tie_to_supervisor(&mut command);
    let mut child = command.spawn()?;
    tracing::debug!(rank = env.rank, pid = child.id(), "rank started");
    if config.prefix_output {
        let prefix = output::prefix(env.rank);
        if let Some(stdout) = child.stdout.take() {
            forwarders.push(output::forward(stdout, prefix.clone(), Sink::Stdout)?);
        }
        if let Some(stderr) = child.stderr.take() {
            forwarders.push(output::forward(stderr, prefix, Sink::Stderr)?);
        }
    }
    Ok(child)
}

/// How the ranks ended.
enum Ended {
    Succeeded,
    Interrupted(i32),
    /// `first` was the first rank to exit with a failure; every rank has ended since. `cause`
    /// is what the job's control store had recorded when the supervisor began to stop ranks.
    Failed {
        first: usize,
        cause: Option<FirstCause>,
    },
}

/// Waits for the ranks. On a signal, passes it on and stops them; on the first failure, gives
/// the others [`RunConfig::failure_grace`] to end by themselves, then stops them.
fn supervise(ranks: &mut [Rank], config: &RunConfig, cause_file: Option<&Path>) -> Ended {
    loop {
        if let Some(signal) = signals::take_pending() {
            tracing::warn!(signal = %signals::signal_name(signal), "forwarding signal to every rank");
            stop(ranks, signal, config.stop_timeout);
            return Ended::Interrupted(signal);
        }
        let (running, failed) = poll(ranks);
        if let Some((rank, exit)) = failed {
            tracing::warn!(
                rank,
                %exit,
                "a rank exited with a failure; the others get {:?} to end, then are stopped",
                config.failure_grace
            );
            let cause = settle(ranks, config, cause_file);
            return Ended::Failed { first: rank, cause };
        }
        if running == 0 {
            return Ended::Succeeded;
        }
        thread::sleep(POLL);
    }
}

/// Notes the ranks that ended since the last look. Returns how many still run and the first
/// of them that failed, if one did.
fn poll(ranks: &mut [Rank]) -> (usize, Option<(usize, Exit)>) {
    let mut running = 0;
    let mut failed = None;
    for rank in ranks.iter_mut().filter(|r| r.exit.is_none()) {
        let exit = match rank.child.try_wait() {
            Ok(Some(status)) => Exit::from_status(status),
            Ok(None) => {
                running += 1;
                continue;
            }
            Err(error) => {
                tracing::error!(rank = rank.rank, %error, "cannot wait for rank");
                Exit::Code(1)
            }
        };
        rank.exit = Some(exit);
        if exit.success() {
            tracing::debug!(rank = rank.rank, "rank finished");
        } else {
            tracing::debug!(rank = rank.rank, %exit, "rank failed");
            failed.get_or_insert((rank.rank, exit));
        }
    }
    (running, failed)
}

/// After a failure: waits up to the grace for the other ranks to end, then stops the rest
/// (at once when a signal arrives meanwhile, with that signal). Returns the cause recorded in
/// `cause_file`, read before any rank is stopped: a rank the supervisor kills is one the
/// store would record as lost, and it must not pass for the cause.
fn settle(ranks: &mut [Rank], config: &RunConfig, cause_file: Option<&Path>) -> Option<FirstCause> {
    let deadline = Instant::now() + config.failure_grace;
    let read = || cause_file.and_then(read_cause);
    loop {
        if let Some(signal) = signals::take_pending() {
            let cause = read();
            stop(ranks, signal, config.stop_timeout);
            return cause;
        }
        let (running, _) = poll(ranks);
        if running == 0 {
            return read();
        }
        if Instant::now() >= deadline {
            let cause = read();
            tracing::warn!(running, "stopping the ranks still running");
            stop(ranks, SIGTERM, config.stop_timeout);
            return cause;
        }
        thread::sleep(POLL);
    }
}

/// Sends `signal` to every rank still running, waits up to `timeout` for them to exit, then
/// kills the rest. A second SIGINT/SIGTERM to the supervisor kills them at once.
fn stop(ranks: &mut [Rank], signal: i32, timeout: Duration) {
    for rank in ranks.iter_mut().filter(|r| r.exit.is_none()) {
        if let Err(error) = signals::signal_group(rank.child.id(), signal) {
            tracing::warn!(rank = rank.rank, %error, "could not signal rank");
        }
    }
    let deadline = Instant::now() + timeout;
    loop {
        let mut running = false;
        for rank in ranks.iter_mut().filter(|r| r.exit.is_none()) {
            match rank.child.try_wait() {
                Ok(Some(status)) => {
                    let exit = Exit::from_status(status);
                    tracing::info!(rank = rank.rank, %exit, "rank stopped");
                    rank.exit = Some(exit);
                }
                Ok(None) => running = true,
                Err(_) => rank.exit = Some(Exit::Code(1)),
            }
        }
        if !running {
            return;
        }
        let forced = signals::take_pending().is_some();
        if forced || Instant::now() >= deadline {
            for rank in ranks.iter_mut().filter(|r| r.exit.is_none()) {
                tracing::warn!(rank = rank.rank, "rank did not stop in time; killing it");
                let _ = signals::signal_group(rank.child.id(), SIGKILL);
                let exit = rank
                    .child
                    .wait()
                    .map(Exit::from_status)
                    .unwrap_or(Exit::Signal(SIGKILL));
                rank.exit = Some(exit);
            }
            return;
        }
        thread::sleep(POLL);
    }
}

fn join_all(forwarders: Vec<JoinHandle<()>>) {
    for forwarder in forwarders {
        let _ = forwarder.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_numbered_node_by_node() {
        let mut config = RunConfig::new(4, "prog");
        config.nnodes = 2;
        config.node_rank = 1;
        config.master_addr = "node0".into();
        let env = config.rank_env(2);
        assert_eq!(env.rank, 6);
        assert_eq!(env.world_size, 8);
        assert_eq!(env.local_rank, 2);
        assert_eq!(env.local_world_size, Some(4));
        assert_eq!(env.master_endpoint(), "node0:29500");
    }

    #[test]
    fn ranks_sharing_a_gpu_see_it_alone_under_host_ids_of_their_own() {
        let mut config = RunConfig::new(3, "prog");
        assert!(config.gpu_sharing_vars(0).is_empty());
        config.share_gpu = Some(1);
        let vars: Vec<_> = (0..3).map(|rank| config.gpu_sharing_vars(rank)).collect();
        let value = |rank: usize, name: &str| {
            vars[rank]
                .iter()
                .find(|(var, _)| *var == name)
                .map(|(_, value)| value.clone())
                .unwrap_or_else(|| panic!("{name} for rank {rank}"))
        };
        for rank in 0..3 {
            assert_eq!(value(rank, "CUDA_VISIBLE_DEVICES"), "1");
            assert_eq!(value(rank, "NCCL_MULTI_RANK_GPU_ENABLE"), "1");
        }
        let hosts: std::collections::HashSet<_> =
            (0..3).map(|rank| value(rank, "NCCL_HOSTID")).collect();
        assert_eq!(hosts.len(), 3, "a host id per rank: {hosts:?}");
    }

    #[test]
    fn invalid_configurations_are_named() {
        let mut config = RunConfig::new(2, "prog");
        config.node_rank = 1;
        let error = config.validate().unwrap_err().to_string();
        assert!(
            error.contains("--node-rank 1 is not below --nnodes 1"),
            "{error}"
        );
        let error = RunConfig::new(0, "prog")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(error.contains("--nproc-per-node"), "{error}");
        let error = RunConfig::new(1, "").validate().unwrap_err().to_string();
        assert!(error.contains("no program"), "{error}");
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(Outcome::Succeeded.exit_code(), 0);
        let failed = |exit| Outcome::RankFailed {
            rank: 1,
            exit,
            reason: None,
            consequences: Vec::new(),
            on_this_node: true,
        };
        assert_eq!(failed(Exit::Code(3)).exit_code(), 3);
        assert_eq!(failed(Exit::Signal(9)).exit_code(), 137);
        assert_eq!(Outcome::Interrupted { signal: 2 }.exit_code(), 130);
    }

    fn cause(rank: usize, reason: &str) -> Option<FirstCause> {
        Some(FirstCause {
            rank,
            reason: reason.into(),
        })
    }

    #[test]
    fn the_reported_cause_is_named_whichever_rank_exited_first() {
        // Rank 5 exited first; rank 6 reported the failure; rank 7 succeeded.
        let exits = [
            (4, Some(Exit::Signal(SIGTERM))),
            (5, Some(Exit::Code(4))),
            (6, Some(Exit::Code(3))),
            (7, Some(Exit::Code(0))),
        ];
        let outcome = blame(&exits, 5, cause(6, "disk full"));
        assert_eq!(
            outcome,
            Outcome::RankFailed {
                rank: 6,
                exit: Exit::Code(3),
                reason: Some("disk full".into()),
                consequences: vec![4, 5],
                on_this_node: true,
            }
        );
        assert_eq!(outcome.exit_code(), 3);
        assert_eq!(
            outcome.to_string(),
            "rank 6 failed (exit code 3) and caused the job's failure: disk full; ranks 4, 5 \
             stopped as a consequence"
        );
    }

    #[test]
    fn a_cause_on_another_node_leaves_every_rank_here_a_consequence() {
        let exits = [(2, Some(Exit::Code(4))), (3, Some(Exit::Signal(SIGTERM)))];
        let outcome = blame(&exits, 2, cause(9, "out of memory"));
        assert_eq!(outcome.exit_code(), 4);
        assert_eq!(
            outcome.to_string(),
            "rank 9, on another node, failed and caused the job's failure: out of memory; ranks \
             2, 3 stopped as a consequence"
        );
    }

    #[test]
    fn without_a_report_the_first_rank_to_exit_is_named_and_said_to_be_a_guess() {
        let exits = [(0, Some(Exit::Code(0))), (1, Some(Exit::Code(2)))];
        let outcome = blame(&exits, 1, None);
        assert_eq!(outcome.exit_code(), 2);
        assert_eq!(
            outcome.to_string(),
            "rank 1 failed (exit code 2), the first rank to exit; no rank reported a cause to \
             this node, so it may itself be a consequence"
        );
    }

    #[test]
    fn the_cause_directory_is_private_and_removed() {
        let dir = CauseDir::create().unwrap();
        let path = dir.path().to_path_buf();
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        assert_eq!(dir.file().parent(), Some(path.as_path()));
        fs::write(dir.file(), "rank 0\nx").unwrap();
        drop(dir);
        assert!(!path.exists());
    }
}
