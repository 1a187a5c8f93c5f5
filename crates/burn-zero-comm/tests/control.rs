//! The job-lifetime control connection across real processes on the loopback, without NCCL:
//! a failed rank stops every rank within seconds (whether it says so, exits silently or
//! panics), a diverged schedule is reported by every rank with both ranks' calls, and a rank
//! that finished early is named by the rank that waits for it. Every rank learns the job's
//! first cause: the rank that reported its failure, aborted, panicked or vanished.
//!
//! Rank 0 binds its rendezvous on a port the system picks and prints it; the other ranks are
//! started with that port, so no test depends on a port staying free.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_control-rank-probe");

struct Finished {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn rank(rank: usize, world_size: usize, port: u16, args: &[&str]) -> Command {
    let mut command = Command::new(PROBE);
    if rank == 0 {
        command.arg("--pick-port");
    }
    command
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world_size.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn finish(mut child: Child, mut stdout: String) -> Finished {
    if let Some(mut out) = child.stdout.take() {
        out.read_to_string(&mut stdout).unwrap();
    }
    let mut stderr = String::new();
    if let Some(mut err) = child.stderr.take() {
        err.read_to_string(&mut stderr).unwrap();
    }
    let status = child.wait().unwrap();
    Finished {
        code: status.code(),
        stdout,
        stderr,
    }
}

/// Runs a job of `world_size` probe processes with `args` and returns each rank's outcome.
fn job(world_size: usize, args: &[&str]) -> Vec<Finished> {
    // Any valid port: rank 0 replaces it with one the system picks.
    let mut master = rank(0, world_size, 1, args).spawn().unwrap();
    let mut lines = BufReader::new(master.stdout.take().unwrap());
    let mut first = String::new();
    lines.read_line(&mut first).unwrap();
    let port: u16 = first
        .trim()
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("rank 0 said {first:?}"));
    let peers: Vec<Child> = (1..world_size)
        .map(|r| rank(r, world_size, port, args).spawn().unwrap())
        .collect();
    let mut rest = String::new();
    lines.read_to_string(&mut rest).unwrap();
    let mut outcomes = vec![finish(master, rest)];
    outcomes.extend(peers.into_iter().map(|child| finish(child, String::new())));
    outcomes
}

fn error_of(outcome: &Finished) -> &str {
    outcome
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix("error: "))
        .unwrap_or_else(|| panic!("no error in\n{}\n{}", outcome.stdout, outcome.stderr))
}

fn first_failure(outcome: &Finished) -> Option<&str> {
    outcome
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix("first-failure "))
}

fn elapsed_ms(outcome: &Finished) -> u64 {
    outcome
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix("after-ms "))
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(u64::MAX)
}

#[test]
fn agreeing_ranks_pass_their_checks() {
    for outcome in job(3, &["schedule", "200", "0", "0"]) {
        assert_eq!(
            outcome.code,
            Some(0),
            "{}\n{}",
            outcome.stdout,
            outcome.stderr
        );
        assert!(outcome.stdout.lines().any(|l| l == "ok"));
    }
}

#[test]
fn a_diverged_schedule_names_both_calls_on_every_rank() {
    let outcomes = job(3, &["schedule", "10", "2", "5"]);
    for (r, outcome) in outcomes.iter().enumerate() {
        assert_eq!(outcome.code, Some(3), "rank {r}: {}", outcome.stdout);
        let error = error_of(outcome);
        assert!(
            error.starts_with("collective schedules diverged: "),
            "{error}"
        );
        assert!(
            error.contains("all_gather of 4096 f32 as its 5th collective"),
            "{error}"
        );
        assert!(
            error.contains("rank 2 called reduce_scatter(sum) of 8192 f32 as its 5th collective"),
            "{error}"
        );
    }
}

fn assert_everyone_stops(how: &str, expected: &str, cause: &str) {
    let started = Instant::now();
    let outcomes = job(3, &["fail", "1", how]);
    assert!(started.elapsed() < Duration::from_secs(20));
    for (r, outcome) in outcomes.iter().enumerate() {
        if r == 1 {
            assert_ne!(outcome.code, Some(0), "the failing rank succeeded");
            continue;
        }
        assert_eq!(
            outcome.code,
            Some(3),
            "rank {r}: {}\n{}",
            outcome.stdout,
            outcome.stderr
        );
        let error = error_of(outcome);
        assert!(error.contains(expected), "rank {r}: {error}");
        // The ranks wait with a 60 s timeout: they stopped because they were told.
        assert!(
            elapsed_ms(outcome) < 5_000,
            "rank {r} took {} ms",
            elapsed_ms(outcome)
        );
        // The store recorded the failing rank as the job's cause, and told every rank.
        let first = first_failure(outcome).unwrap_or_default();
        assert!(first.starts_with(cause), "rank {r}: {first:?}");
    }
}

#[test]
fn a_rank_that_reports_its_failure_stops_every_rank() {
    assert_everyone_stops(
        "abort",
        "rank 1 failed: out of memory (on purpose)",
        "1: out of memory (on purpose)",
    );
}

#[test]
fn a_rank_that_exits_without_a_word_stops_every_rank() {
    assert_everyone_stops(
        "exit",
        "rank 1 is gone: its control connection closed",
        "1: rank 1 is gone",
    );
}

#[test]
fn a_rank_that_panics_stops_every_rank() {
    assert_everyone_stops(
        "panic",
        "rank 1 failed: rank 1 panicked",
        "1: rank 1 panicked",
    );
}

#[test]
fn a_reported_failure_is_every_ranks_first_failure_and_the_job_goes_on() {
    for outcome in job(3, &["report", "2"]) {
        assert_eq!(
            outcome.code,
            Some(0),
            "{}\n{}",
            outcome.stdout,
            outcome.stderr
        );
        // Known to every rank once the next collective passed: the report was acknowledged
        // before the reporting rank entered it.
        assert_eq!(
            first_failure(&outcome),
            Some("2: disk full (on purpose)"),
            "{}",
            outcome.stdout
        );
    }
}

#[test]
fn a_rank_waiting_for_one_that_finished_names_it() {
    let outcomes = job(2, &["leave"]);
    assert_eq!(outcomes[1].code, Some(0), "{}", outcomes[1].stdout);
    assert_eq!(outcomes[0].code, Some(3), "{}", outcomes[0].stdout);
    let error = error_of(&outcomes[0]);
    assert_eq!(
        error,
        "rank 1 left the group while rank 0 waited in all_gather of 4096 f32 as its 2nd collective"
    );
}
