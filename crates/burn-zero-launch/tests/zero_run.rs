//! `zero-run` with a small rank program: the environment each rank sees, prefixed output, a
//! failing rank stopping the others, and Ctrl-C forwarding.

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
    assert!(stderr.contains("rank failed"), "{stderr}");
    // The other ranks sleep for a minute unless stopped.
    assert!(!stdout.contains("not stopped"), "{stdout}");
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
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
