//! `zero-run`: starts one process per rank with the torchrun environment, like `torchrun`.
//!
//! ```text
//! zero-run --nproc-per-node 4 -- ./train --epochs 3
//! zero-run --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 -- ./train
//! zero-run --nproc-per-node 3 --share-gpu 0 -- ./train    # three ranks on one GPU, for testing
//! ```

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use burn_zero_launch::{RunConfig, run};
use clap::Parser;
use tracing::Level;

/// Start the ranks of a burn-zero job on this node.
///
/// Every rank runs PROGRAM with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
/// MASTER_PORT set. Output lines are prefixed with `[rank N] `. Ctrl-C (SIGINT) and SIGTERM are
/// passed on to the ranks (a second one kills them).
///
/// When ranks fail, the others get --failure-grace seconds to end, then are stopped. zero-run
/// names the rank whose failure caused the others (the first to report it to the job's control
/// store, which runs in rank 0's process and writes it to the file BURN_ZERO_CAUSE_FILE names)
/// with its reason, lists the other failed ranks as consequences, and exits with the cause's
/// exit code (128 + signal if a signal killed it). Where no report arrives (on a node other than
/// rank 0's, or for a program without a control store), it names the first rank to exit with a
/// failure and says so.
#[derive(Debug, Parser)]
#[command(name = "zero-run", version)]
struct Cli {
    /// Ranks (processes) to start on this node, usually one per GPU.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes taking part in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// Index of this node, 0..nnodes; node 0 hosts global rank 0.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host name or address of node 0, where the ranks meet.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port on node 0 for the rendezvous.
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Seconds the ranks get to exit after a stop signal before they are killed.
    #[arg(long, default_value_t = 10.0)]
    stop_timeout: f64,
    /// Seconds the other ranks get to end by themselves once a rank failed, before they are
    /// sent SIGTERM (so that ranks failing together exit with their own codes and messages).
    #[arg(long, default_value_t = 3.0)]
    failure_grace: f64,
    /// Pass the ranks' output through without the `[rank N] ` prefix.
    #[arg(long)]
    no_prefix: bool,
    /// Run every rank on this one GPU (its index on this node), for trying several ranks on a
    /// machine with one GPU: each rank sees only that GPU, and NCCL is told to accept several
    /// ranks on it (NCCL_HOSTID per rank, NCCL_MULTI_RANK_GPU_ENABLE=1). The ranks share the
    /// GPU's time and memory, and before NCCL 2.30.7 they talk over sockets: for correctness,
    /// not speed.
    #[arg(long, value_name = "GPU")]
    share_gpu: Option<usize>,
    /// zero-run's own log level (error, warn, info, debug, trace).
    #[arg(long, default_value = "info", env = "ZERO_RUN_LOG")]
    log_level: Level,
    /// The program every rank runs, and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(cli.log_level)
        .with_target(false)
        .init();

    for (flag, seconds) in [
        ("--stop-timeout", cli.stop_timeout),
        ("--failure-grace", cli.failure_grace),
    ] {
        if !(seconds.is_finite() && seconds >= 0.0) {
            eprintln!("zero-run: {flag} must be a non-negative number of seconds");
            return ExitCode::from(2);
        }
    }
    let mut command = cli.command.into_iter();
    let program = command.next().unwrap_or_default();
    let config = RunConfig {
        nproc_per_node: cli.nproc_per_node,
        nnodes: cli.nnodes,
        node_rank: cli.node_rank,
        master_addr: cli.master_addr,
        master_port: cli.master_port,
        program,
        args: command.collect(),
        stop_timeout: Duration::from_secs_f64(cli.stop_timeout),
        failure_grace: Duration::from_secs_f64(cli.failure_grace),
        prefix_output: !cli.no_prefix,
        share_gpu: cli.share_gpu,
    };
    match run(&config) {
        Ok(outcome) => ExitCode::from(outcome.exit_code().clamp(0, 255) as u8),
        Err(error) => {
            eprintln!("zero-run: {error}");
            ExitCode::from(1)
        }
    }
}
