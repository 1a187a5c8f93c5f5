//! The supervisor behind `zero-run`: starts this node's ranks with the launcher environment,
//! prefixes their output, forwards SIGINT/SIGTERM, and when one rank fails, stops the others
//! and reports that rank's exit code.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::env::DistEnv;
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
    /// Prefix each output line with `[rank N] `.
    pub prefix_output: bool,
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
            prefix_output: true,
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
    /// A rank failed first (the others were stopped).
    RankFailed {
        /// The global rank.
        rank: usize,
        /// How it ended.
        exit: Exit,
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

    let mut ranks: Vec<Rank> = Vec::with_capacity(config.nproc_per_node);
    let mut forwarders: Vec<JoinHandle<()>> = Vec::new();
    for local_rank in 0..config.nproc_per_node {
        let env = config.rank_env(local_rank);
        match spawn_rank(config, &env, &mut forwarders) {
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

    let outcome = supervise(&mut ranks, config.stop_timeout);
    join_all(forwarders);
    match &outcome {
        Outcome::Succeeded => tracing::info!("every rank succeeded"),
        Outcome::RankFailed { rank, exit } => {
            tracing::error!(rank, %exit, "rank failed; the other ranks were stopped")
        }
        Outcome::Interrupted { signal } => {
            tracing::warn!(signal = %signals::signal_name(*signal), "interrupted; ranks stopped")
        }
    }
    Ok(outcome)
}

fn spawn_rank(
    config: &RunConfig,
    env: &DistEnv,
    forwarders: &mut Vec<JoinHandle<()>>,
) -> io::Result<Child> {
    let mut command = Command::new(&config.program);
    command.args(&config.args).stdin(Stdio::null());
    for (var, value) in env.to_vars() {
        command.env(var, value);
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

/// Waits for the ranks; stops them all on the first failure or signal.
fn supervise(ranks: &mut [Rank], stop_timeout: Duration) -> Outcome {
    loop {
        if let Some(signal) = signals::take_pending() {
            tracing::warn!(signal = %signals::signal_name(signal), "forwarding signal to every rank");
            stop(ranks, signal, stop_timeout);
            return Outcome::Interrupted { signal };
        }
        let mut running = 0;
        let mut failed = None;
        for rank in ranks.iter_mut() {
            if rank.exit.is_some() {
                continue;
            }
            match rank.child.try_wait() {
                Ok(Some(status)) => {
                    let exit = Exit::from_status(status);
                    rank.exit = Some(exit);
                    if exit.success() {
                        tracing::debug!(rank = rank.rank, "rank finished");
                    } else if failed.is_none() {
                        failed = Some((rank.rank, exit));
                    }
                }
                Ok(None) => running += 1,
                Err(error) => {
                    tracing::error!(rank = rank.rank, %error, "cannot wait for rank");
                    if failed.is_none() {
                        failed = Some((rank.rank, Exit::Code(1)));
                    }
                }
            }
        }
        if let Some((rank, exit)) = failed {
            tracing::error!(rank, %exit, "rank failed; stopping the other ranks");
            stop(ranks, SIGTERM, stop_timeout);
            return Outcome::RankFailed { rank, exit };
        }
        if running == 0 {
            return Outcome::Succeeded;
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
        let failed = |exit| Outcome::RankFailed { rank: 1, exit };
        assert_eq!(failed(Exit::Code(3)).exit_code(), 3);
        assert_eq!(failed(Exit::Signal(9)).exit_code(), 137);
        assert_eq!(Outcome::Interrupted { signal: 2 }.exit_code(), 130);
    }
}
