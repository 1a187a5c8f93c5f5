//! Rank processes started the way a cluster starts them, on this machine: each gets an
//! environment cleared of everything but one launcher's variables (Slurm's `srun`, Open MPI's
//! `mpirun`), and the ranks meet through the rendezvous and the control store, agree on rank
//! and world size, and stop together when one fails.

mod common;

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use burn_zero_launch::env::derived_port;
use common::{PROBE, texts, with_port};

/// The probe with only `vars` in its environment.
fn probe(vars: &[(&str, String)], args: &[&str]) -> Command {
    let mut command = Command::new(PROBE);
    command
        .args(args)
        .env_clear()
        .envs(vars.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Starts every rank at once and waits for all of them.
fn run_ranks<const N: usize>(ranks: [Command; N]) -> [Output; N] {
    ranks
        .map(|mut command| command.spawn().unwrap())
        .map(|child| child.wait_with_output().unwrap())
}

/// Task `rank` of `srun` step `job.0` on two nodes, one task each; the nodes are two loopback
/// addresses of this machine.
fn srun_task(job: u64, rank: usize) -> Vec<(&'static str, String)> {
    let text = |s: &str| s.to_string();
    vec![
        ("SLURM_JOB_ID", job.to_string()),
        ("SLURM_JOBID", job.to_string()),
        ("SLURM_STEP_ID", text("0")),
        ("SLURM_STEPID", text("0")),
        ("SLURM_PROCID", rank.to_string()),
        ("SLURM_LOCALID", text("0")),
        ("SLURM_NODEID", rank.to_string()),
        ("SLURM_NTASKS", text("2")),
        ("SLURM_NNODES", text("2")),
        ("SLURM_STEP_NUM_TASKS", text("2")),
        ("SLURM_STEP_NUM_NODES", text("2")),
        ("SLURM_STEP_NODELIST", text("127.0.0.[1-2]")),
        ("SLURM_STEP_TASKS_PER_NODE", text("1(x2)")),
        ("SLURM_JOB_NODELIST", text("127.0.0.[1-2]")),
        ("SLURM_TASKS_PER_NODE", text("1(x2)")),
    ]
}

/// Rank `rank` of two started by Open MPI's `mpirun -np 2` on this node.
fn mpirun_rank(rank: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("OMPI_COMM_WORLD_RANK", rank.to_string()),
        ("OMPI_COMM_WORLD_SIZE", "2".into()),
        ("OMPI_COMM_WORLD_LOCAL_RANK", rank.to_string()),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
        ("OMPI_COMM_WORLD_NODE_RANK", rank.to_string()),
        // Open MPI does not say where rank 0 listens; on one node it is the loopback, and the
        // port is given so that the test does not depend on 29500 being free.
        ("MASTER_PORT", port.to_string()),
    ]
}

/// Runs the two Slurm tasks with a job id whose derived port is free now, trying other ids
/// while something takes that port before rank 0 binds it.
fn run_srun_step(args: &[&str]) -> (u16, [Output; 2]) {
    let mut job = 40_000 + u64::from(std::process::id() % 10_000);
    for _ in 0..5 {
        while TcpListener::bind(("0.0.0.0", derived_port(job, 0))).is_err() {
            job += 1;
        }
        let outputs = run_ranks([0, 1].map(|rank| probe(&srun_task(job, rank), args)));
        if !outputs
            .iter()
            .any(|output| texts(output).1.contains("Address already in use"))
        {
            return (derived_port(job, 0), outputs);
        }
        job += 1;
    }
    panic!("no free derived port");
}

fn assert_line(output: &Output, line: &str) {
    let (stdout, stderr) = texts(output);
    assert!(
        stdout.lines().any(|l| l == line),
        "missing {line:?} in\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
}

#[test]
fn srun_tasks_meet_and_finish() {
    let (port, outputs) = run_srun_step(&["job", "20000"]);
    for (rank, output) in outputs.iter().enumerate() {
        let (stdout, stderr) = texts(output);
        assert!(output.status.success(), "rank {rank}:\n{stdout}\n{stderr}");
        assert_line(output, "launcher slurm");
        // Rank 0 runs on the first host of the node list; the port comes from the job id.
        assert_line(
            output,
            &format!("rank {rank} of 2, local 0 of 1, master 127.0.0.1:{port}"),
        );
        assert_line(output, "joined");
        assert_line(output, "done");
    }
}

#[test]
fn a_failing_srun_task_stops_the_other() {
    let (_, [first, second]) = run_srun_step(&["job", "20000", "1"]);
    let both = format!("{:?}\n{:?}", texts(&first), texts(&second));
    assert_eq!(second.status.code(), Some(1), "{both}");
    assert_line(&second, "joined");
    assert_eq!(first.status.code(), Some(4), "{both}");
    assert_line(&first, "stopped: rank 1 failed: rank 1 fails on purpose");
}

#[test]
fn mpirun_ranks_meet_and_finish() {
    let (port, outputs) = with_port(|port| {
        run_ranks([0, 1].map(|rank| probe(&mpirun_rank(rank, port), &["job", "20000"])))
    });
    for (rank, output) in outputs.iter().enumerate() {
        let (stdout, stderr) = texts(output);
        assert!(output.status.success(), "rank {rank}:\n{stdout}\n{stderr}");
        assert_line(output, "launcher openmpi");
        assert_line(
            output,
            &format!("rank {rank} of 2, local {rank} of 2, master 127.0.0.1:{port}"),
        );
        assert_line(output, "done");
    }
}

#[test]
fn a_failing_mpirun_rank_stops_the_other() {
    let (_, [first, second]) = with_port(|port| {
        run_ranks([0, 1].map(|rank| probe(&mpirun_rank(rank, port), &["job", "20000", "0"])))
    });
    let both = format!("{:?}\n{:?}", texts(&first), texts(&second));
    assert_eq!(first.status.code(), Some(1), "{both}");
    assert_eq!(second.status.code(), Some(4), "{both}");
    assert_line(&second, "stopped: rank 0 failed: rank 0 fails on purpose");
}

/// The Slurm variables a batch script leaves to everything it starts (2 nodes × 8 tasks).
fn sbatch_leftovers() -> Vec<(&'static str, String)> {
    [
        ("SLURM_JOB_ID", "777"),
        ("SLURM_JOBID", "777"),
        ("SLURM_PROCID", "0"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "0"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_NNODES", "2"),
        ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ("SLURM_TASKS_PER_NODE", "8(x2)"),
    ]
    .map(|(k, v)| (k, v.to_string()))
    .to_vec()
}

#[test]
fn mpirun_inside_a_batch_script_ignores_its_leftovers() {
    let (_, outputs) = with_port(|port| {
        run_ranks([0, 1].map(|rank| {
            let mut vars = sbatch_leftovers();
            vars.extend(mpirun_rank(rank, port));
            probe(&vars, &["job", "20000"])
        }))
    });
    for output in &outputs {
        assert!(output.status.success(), "{:?}", texts(output));
        assert_line(output, "launcher openmpi");
        assert_line(output, "done");
    }
}

#[test]
fn a_program_in_a_batch_script_is_refused_at_once() {
    let started = Instant::now();
    let output = probe(&sbatch_leftovers(), &["job", "20000"])
        .output()
        .unwrap();
    let (_, stderr) = texts(&output);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains(
            "Slurm job 777 has 16 tasks (SLURM_NTASKS=16) but this process was not started by srun"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("Start the ranks with srun"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_cleared_environment_is_not_a_launch() {
    let output = probe(&[], &["job", "1000"]).output().unwrap();
    let (_, stderr) = texts(&output);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("no launcher environment found"), "{stderr}");
}
