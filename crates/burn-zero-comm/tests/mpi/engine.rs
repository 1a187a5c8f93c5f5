//! `MpiGroup` in rank processes: every collective bitwise equal to `LocalGroup`'s at 2, 3 and
//! 4 ranks, started by `mpirun` or by hand, and failures that reach every rank.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use burn_zero_testing::processes::{NameServer, allow_root, free_port, mpirun, tagged_ranks};
use burn_zero_testing::skip;

/// The variable that makes this test binary a rank (its value is the rank's mode).
const PROBE: &str = "MPI_PROBE";

/// Runs as a rank when this process was started as one: never returns then.
fn rank_side() {
    if let Ok(mode) = std::env::var(PROBE) {
        super::rank::run(&mode);
    }
}

/// This test binary, running only `test`, as a rank in `mode`.
fn this_test(command: &mut Command, test: &str, mode: &str) {
    command
        .arg(std::env::current_exe().expect("the test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(PROBE, mode);
}

/// `np` ranks of `test` in `mode` under `mpirun`; `None` when skipped.
fn under_mpirun(test: &str, np: usize, mode: &str, timeout_ms: u64) -> Option<Output> {
    let mut command = mpirun(test, np)?;
    command.args(["-x", PROBE, "-x", "PROBE_TIMEOUT_MS"]);
    this_test(&mut command, test, mode);
    command.env("PROBE_TIMEOUT_MS", timeout_ms.to_string());
    Some(command.output().expect("mpirun runs"))
}

/// `np` ranks of `test` in `mode`, started one by one with the torchrun-style variables (as
/// `zero-run` starts them) and joined through `server`; each rank's output.
fn by_hand(
    test: &str,
    np: usize,
    mode: &str,
    server: Option<&NameServer>,
    timeout_ms: u64,
) -> Vec<Output> {
    let port = free_port();
    let children: Vec<_> = (0..np)
        .map(|rank| {
            let mut command = Command::new(std::env::current_exe().expect("the test binary"));
            command
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(PROBE, mode)
                .env("PROBE_TIMEOUT_MS", timeout_ms.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", np.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", np.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env_remove("OMPI_MCA_pmix_server_uri")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            allow_root(&mut command);
            if let Some(server) = server {
                server.point(&mut command);
            }
            command.spawn().expect("a rank starts")
        })
        .collect();
    children
        .into_iter()
        .map(|child| child.wait_with_output().expect("a rank ends"))
        .collect()
}

fn text(output: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Every rank of an `mpirun` job said `ok`.
fn every_rank_ok(output: &Output, np: usize) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "mpirun failed:\n{}", text(output));
    let ranks = tagged_ranks(&stdout);
    for rank in 0..np {
        let said = ranks.get(&rank).map_or("", String::as_str);
        assert!(
            said.contains("ok ") && said.contains(&format!("rank {rank} of {np}")),
            "rank {rank} said:\n{said}\n{}",
            text(output)
        );
    }
}

#[test]
fn collectives_equal_local_group_bitwise_under_mpirun() {
    rank_side();
    let test = "engine::collectives_equal_local_group_bitwise_under_mpirun";
    for np in [2, 3, 4] {
        let Some(output) = under_mpirun(test, np, "collectives flex", 60_000) else {
            return;
        };
        every_rank_ok(&output, np);
    }
}

#[test]
fn collectives_equal_local_group_bitwise_on_ndarray_and_wgpu() {
    rank_side();
    let test = "engine::collectives_equal_local_group_bitwise_on_ndarray_and_wgpu";
    let Some(output) = under_mpirun(test, 3, "collectives ndarray", 60_000) else {
        return;
    };
    every_rank_ok(&output, 3);
    if !skip::wgpu_adapter(test) {
        return;
    }
    let Some(output) = under_mpirun(test, 2, "collectives wgpu", 120_000) else {
        return;
    };
    every_rank_ok(&output, 2);
}

#[test]
fn separately_started_ranks_join_one_world_and_agree_bitwise() {
    rank_side();
    let test = "engine::separately_started_ranks_join_one_world_and_agree_bitwise";
    let Some(server) = NameServer::start(test) else {
        return;
    };
    let np = 3;
    let outputs = by_hand(test, np, "collectives flex", Some(&server), 60_000);
    for (rank, output) in outputs.iter().enumerate() {
        let said = text(output);
        assert!(output.status.success(), "rank {rank}:\n{said}");
        assert!(
            said.contains(&format!("rank {rank} of {np}")),
            "rank {rank}:\n{said}"
        );
    }
}

/// Each rank's `error:` line and how long it waited (`after-ms`).
fn errors(outputs: &[Output]) -> Vec<(String, Option<u64>)> {
    outputs
        .iter()
        .map(|output| {
            let said = String::from_utf8_lossy(&output.stdout).into_owned();
            let error = said
                .lines()
                .skip_while(|line| !line.starts_with("error: "))
                .take_while(|line| !line.starts_with("after-ms "))
                .collect::<Vec<_>>()
                .join("\n");
            let after = said
                .lines()
                .find_map(|line| line.strip_prefix("after-ms "))
                .and_then(|ms| ms.parse().ok());
            (error, after)
        })
        .collect()
}

#[test]
fn a_panicking_rank_stops_the_others_with_its_cause() {
    rank_side();
    let test = "engine::a_panicking_rank_stops_the_others_with_its_cause";
    let Some(server) = NameServer::start(test) else {
        return;
    };
    // A long collective timeout: the others must stop because rank 1 failed, not time out.
    let started = Instant::now();
    let outputs = by_hand(test, 3, "fail 1 panic", Some(&server), 600_000);
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "{:?}",
        started.elapsed()
    );
    assert!(!outputs[1].status.success());
    assert!(
        text(&outputs[1]).contains("panics on purpose"),
        "{}",
        text(&outputs[1])
    );
    for rank in [0, 2] {
        let said = text(&outputs[rank]);
        assert_eq!(outputs[rank].status.code(), Some(3), "rank {rank}:\n{said}");
        assert!(
            said.contains("first-failure 1: rank 1 panicked"),
            "rank {rank}:\n{said}"
        );
    }
}

#[test]
fn a_rank_that_never_answers_times_the_others_out() {
    rank_side();
    let test = "engine::a_rank_that_never_answers_times_the_others_out";
    let Some(server) = NameServer::start(test) else {
        return;
    };
    let np = 3;
    let port = free_port();
    // Ranks 0 and 2 wait 2 s for rank 1, which sleeps; rank 1 is killed once they gave up.
    let mut children: Vec<_> = (0..np)
        .map(|rank| {
            let mut command = Command::new(std::env::current_exe().expect("the test binary"));
            command
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(PROBE, "fail 1 hang")
                .env("PROBE_TIMEOUT_MS", "2000")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", np.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            allow_root(&mut command);
            server.point(&mut command);
            command.spawn().expect("a rank starts")
        })
        .collect();
    let hanging = children.remove(1);
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|child| child.wait_with_output().expect("a rank ends"))
        .collect();
    let mut hanging = hanging;
    let _ = hanging.kill();
    let _ = hanging.wait();
    for ((error, after), output) in errors(&outputs).into_iter().zip(&outputs) {
        assert!(error.contains("waited"), "{}", text(output));
        let after = after.expect("an after-ms line");
        assert!((2000..30_000).contains(&after), "gave up after {after} ms");
    }
}

#[test]
fn a_diverged_schedule_is_named_on_every_rank() {
    rank_side();
    let test = "engine::a_diverged_schedule_is_named_on_every_rank";
    // Started by hand: under mpirun the first rank to exit with an error gets the others
    // killed, perhaps before they print theirs.
    let Some(server) = NameServer::start(test) else {
        return;
    };
    let outputs = by_hand(test, 3, "diverge", Some(&server), 60_000);
    for (rank, output) in outputs.iter().enumerate() {
        let said = text(output);
        assert_eq!(output.status.code(), Some(3), "rank {rank}:\n{said}");
        assert!(
            said.contains("collective schedules diverged")
                && said.contains("rank 1 called all_gather of 12 f32 as its 1st collective")
                && said.contains("reduce_scatter(sum) of 12 f32 as its 1st collective"),
            "rank {rank}:\n{said}"
        );
    }
}

#[test]
fn without_a_name_server_separately_started_ranks_are_told_what_to_do() {
    rank_side();
    let test = "engine::without_a_name_server_separately_started_ranks_are_told_what_to_do";
    if mpirun(test, 1).is_none() {
        return;
    }
    let outputs = by_hand(test, 2, "collectives flex", None, 10_000);
    for output in &outputs {
        let said = text(output);
        assert_eq!(output.status.code(), Some(3), "{said}");
        assert!(
            said.contains("mpirun -np 2") && said.contains("zero-run"),
            "{said}"
        );
    }
}
