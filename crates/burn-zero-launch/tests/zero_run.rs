//! `zero-run` with a small rank program: the environment each rank sees, prefixed output, a
//! failing rank stopping the others, the rank whose failure caused the others named with its
//! reason, and Ctrl-C forwarding.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{PROBE, ZERO_RUN, texts, with_port};

fn zero_run(options: &[&str], probe_args: &[&str]) -> Command {
    let mut command = Command::new(ZERO_RUN);
    command.args(options).arg("--").arg(PROBE).args(probe_args);
    command
}

#[test]
fn ranks_get_the_environment_and_prefixed_output() {
    let (port, [output]) = with_port(|port| {
        let port = port.to_string();
        [
            zero_run(&["--nproc-per-node", "3", "--master-port", &port], &["env"])
                .output()
                .unwrap(),
        ]
    });
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for rank in 0..3 {
        let expected = [
            format!("RANK={rank}"),
            "WORLD_SIZE=3".into(),
            format!("LOCAL_RANK={rank}"),
            "LOCAL_WORLD_SIZE=3".into(),
            "MASTER_ADDR=127.0.0.1".into(),
            format!("MASTER_PORT={port}"),
            // The probe's last line has no newline: it still arrives whole, prefixed.
            "done".into(),
        ];
        for text in expected {
            let line = format!("[rank {rank}] {text}");
            assert!(
                stdout.lines().any(|l| l == line),
                "missing {line:?} in\n{stdout}"
            );
        }
        let line = format!("[rank {rank}] stderr of rank {rank}");
        assert!(
            stderr.lines().any(|l| l == line),
            "missing {line:?} in\n{stderr}"
        );
    }
    // Every line of the ranks' output is prefixed (zero-run's own log goes to stderr).
    assert!(stdout.lines().all(|l| l.starts_with("[rank ")), "{stdout}");
    assert_eq!(stdout.lines().count(), 3 * 7, "{stdout}");
}

#[test]
fn ranks_sharing_a_gpu_see_it_alone_with_host_ids_of_their_own() {
    let (_, [output]) = with_port(|port| {
        let port = port.to_string();
        [zero_run(
            &[
                "--nproc-per-node",
                "2",
                "--master-port",
                &port,
                "--share-gpu",
                "3",
            ],
            &["gpu-env"],
        )
        .output()
        .unwrap()]
    });
    let (stdout, stderr) = texts(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let mut hosts = Vec::new();
    for rank in 0..2 {
        for line in ["CUDA_VISIBLE_DEVICES=3", "NCCL_MULTI_RANK_GPU_ENABLE=1"] {
            let line = format!("[rank {rank}] {line}");
            assert!(stdout.lines().any(|l| l == line), "{line:?} in\n{stdout}");
        }
        let host = stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("[rank {rank}] NCCL_HOSTID=")))
            .unwrap_or_else(|| panic!("rank {rank}'s NCCL_HOSTID in\n{stdout}"));
        assert!(!host.is_empty());
        hosts.push(host.to_string());
    }
    assert_ne!(hosts[0], hosts[1], "each rank is a host of its own");
}

#[test]
fn ranks_of_a_second_node_are_offset() {
    let output = zero_run(
        &[
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "node0.example",
        ],
        &["env"],
    )
    .output()
    .unwrap();
    let (stdout, stderr) = texts(&output);
    assert!(output.status.success(), "{stderr}");
    for (local, global) in [(0, 2), (1, 3)] {
        for text in [
            format!("RANK={global}"),
            "WORLD_SIZE=4".into(),
            format!("LOCAL_RANK={local}"),
            "MASTER_ADDR=node0.example".into(),
            "MASTER_PORT=29500".into(),
        ] {
            let line = format!("[rank {global}] {text}");
            assert!(
                stdout.lines().any(|l| l == line),
                "missing {line:?} in\n{stdout}"
            );
        }
    }
}

#[test]
fn a_failing_rank_stops_the_others_and_sets_the_exit_code() {
    let started = Instant::now();
    let output = zero_run(&["--nproc-per-node", "3"], &["fail", "1", "7"])
        .output()
        .unwrap();
    let elapsed = started.elapsed();
    let (stdout, stderr) = texts(&output);
    assert_eq!(
        output.status.code(),
        Some(7),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stderr.contains("[rank 1] failing on purpose"), "{stderr}");
    // The probe runs no control store: zero-run says that it names the first rank to exit.
    assert!(
        stderr.contains("no rank reported its failure to the job's control store"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "rank 1 failed (exit code 7), the first rank to exit; no rank reported a cause to \
             this node, so it may itself be a consequence; ranks 0, 2 also failed or were stopped"
        ),
        "{stderr}"
    );
    // The other ranks sleep for a minute unless stopped.
    assert!(!stdout.contains("not stopped"), "{stdout}");
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
}

/// zero-run over two probe ranks in `cause CAUSE_RANK HOW` mode, with its temporary files
/// under `tmp`. Returns its exit code and standard error.
fn run_cause(cause_rank: usize, how: &str, tmp: &std::path::Path) -> (Option<i32>, String) {
    run_cause_with(&["--nproc-per-node", "2"], cause_rank, how, tmp)
}

/// [`run_cause`] with zero-run's `options`.
fn run_cause_with(
    options: &[&str],
    cause_rank: usize,
    how: &str,
    tmp: &std::path::Path,
) -> (Option<i32>, String) {
    let cause_rank = cause_rank.to_string();
    let (_, [output]) = with_port(|port| {
        let port = port.to_string();
        let mut options = options.to_vec();
        options.extend(["--master-port", &port]);
        [zero_run(&options, &["cause", &cause_rank, how])
            .env("TMPDIR", tmp)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap()]
    });
    let (stdout, stderr) = texts(&output);
    // The cause's rank prints last, well after the other rank exited: the order of exits
    // would blame the other one.
    let code = output.status.code();
    (code, format!("{stderr}\nstdout:\n{stdout}"))
}

/// A scratch directory for zero-run's temporary files, empty, removed when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("zero-run-test-{name}-"))
        .tempdir()
        .unwrap()
}

/// Ranks that fail together: rank `cause` reports its failure to the control store, both
/// ranks then exit with a failure, the other first. zero-run names the one that reported, with
/// its reason and exit code, and the other as a consequence; it leaves no file behind.
fn the_reporting_rank_is_named(cause: usize) {
    let tmp = scratch(&format!("report-{cause}"));
    let (code, stderr) = run_cause(cause, "report", tmp.path());
    let other = 1 - cause;
    assert_eq!(code, Some(5), "{stderr}");
    let expected = format!(
        "rank {cause} failed (exit code 5) and caused the job's failure: disk full on rank \
         {cause} (on purpose); rank {other} stopped as a consequence"
    );
    assert!(
        stderr.contains(&expected),
        "missing {expected:?} in\n{stderr}"
    );
    // The other rank did exit first.
    let first = stderr.find(&format!("[rank {other}] stopped:"));
    let last = stderr.find(&format!("[rank {cause}] failing on purpose"));
    assert!(first.is_some() && first < last, "{stderr}");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "zero-run left {left:?}");
}

#[test]
fn a_failure_reported_by_rank_1_is_named_though_rank_0_exits_first() {
    the_reporting_rank_is_named(1);
}

#[test]
fn a_failure_reported_by_rank_0_is_named_though_rank_1_exits_first() {
    the_reporting_rank_is_named(0);
}

#[test]
fn a_rank_that_panics_without_a_report_is_named() {
    for cause in [1, 0] {
        let tmp = scratch(&format!("panic-{cause}"));
        let (code, stderr) = run_cause(cause, "panic", tmp.path());
        assert_eq!(code, Some(101), "{stderr}");
        let expected = format!(
            "rank {cause} failed (exit code 101) and caused the job's failure: rank {cause} \
             panicked (see its output for the message); rank {} stopped as a consequence",
            1 - cause
        );
        assert!(
            stderr.contains(&expected),
            "missing {expected:?} in\n{stderr}"
        );
        assert!(
            stderr.contains(&format!("rank {cause} panics on purpose")),
            "{stderr}"
        );
    }
}

#[test]
fn a_rank_that_aborts_without_a_word_is_named() {
    let tmp = scratch("abort");
    let (code, stderr) = run_cause(1, "abort", tmp.path());
    assert_eq!(code, Some(134), "{stderr}");
    let expected = "rank 1 failed (killed by SIGABRT) and caused the job's failure: rank 1 is \
                    gone: its control connection closed without a goodbye";
    assert!(
        stderr.contains(expected),
        "missing {expected:?} in\n{stderr}"
    );
    assert!(
        stderr.contains("rank 0 stopped as a consequence"),
        "{stderr}"
    );
}

/// A rank that fails without a word leaves no cause on record; the ranks zero-run then kills
/// are recorded as lost by rank 0's store (rank 0 ignores SIGTERM and outlives them), and must
/// not pass for the cause.
#[test]
fn a_rank_the_supervisor_stopped_is_never_the_cause() {
    let tmp = scratch("quiet");
    let (code, stderr) = run_cause_with(
        &[
            "--nproc-per-node",
            "3",
            "--failure-grace",
            "0.2",
            "--stop-timeout",
            "1",
        ],
        1,
        "quiet",
        tmp.path(),
    );
    assert_eq!(code, Some(7), "{stderr}");
    assert!(
        stderr.contains(
            "rank 1 failed (exit code 7), the first rank to exit; no rank reported a cause to \
             this node, so it may itself be a consequence; ranks 0, 2 also failed or were \
             stopped"
        ),
        "{stderr}"
    );
}

#[test]
fn a_rank_killed_by_a_signal_reports_128_plus_the_signal() {
    // Rank 0 kills itself with SIGKILL (9) through the shell.
    let output = Command::new(ZERO_RUN)
        .args(["--nproc-per-node", "2", "--", "sh", "-c"])
        .arg("if [ \"$RANK\" = 0 ]; then kill -9 $$; else sleep 60; fi")
        .output()
        .unwrap();
    let (_, stderr) = texts(&output);
    assert_eq!(output.status.code(), Some(137), "{stderr}");
    assert!(stderr.contains("killed by SIGKILL"), "{stderr}");
}

#[test]
fn ctrl_c_is_forwarded_to_every_rank() {
    let mut child = zero_run(&["--nproc-per-node", "2"], &["sleep"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until both ranks run.
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut ready = 0;
    let mut line = String::new();
    while ready < 2 {
        line.clear();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "zero-run ended early"
        );
        if line.trim_end().ends_with("] ready") {
            ready += 1;
        }
    }
    let started = Instant::now();
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert_eq!(status.code(), Some(130));
    assert!(!rest.contains("not stopped"), "{rest}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_missing_program_is_a_clear_error() {
    let output = Command::new(ZERO_RUN)
        .args([
            "--nproc-per-node",
            "2",
            "--",
            "/nonexistent/zero-run-test-program",
        ])
        .output()
        .unwrap();
    let (_, stderr) = texts(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("could not start rank 0 (/nonexistent/zero-run-test-program)"),
        "{stderr}"
    );
}

#[test]
fn bad_arguments_are_refused() {
    let output = Command::new(ZERO_RUN)
        .args(["--nnodes", "2", "--node-rank", "2", "--", "true"])
        .output()
        .unwrap();
    let (_, stderr) = texts(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--node-rank 2 is not below --nnodes 2"),
        "{stderr}"
    );
}
