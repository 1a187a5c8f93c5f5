//! The rendezvous across real processes on the loopback: every rank gets rank 0's bytes, and
//! misconfigured jobs fail with a clear message instead of hanging.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{PROBE, ZERO_RUN, free_port, probe_rank, texts, with_port};

/// 128 bytes, the size of an NCCL unique id.
fn blob_hex() -> String {
    (0..128u32)
        .map(|i| format!("{:02x}", (i * 37 + 11) % 256))
        .collect()
}

#[test]
fn ids_are_exchanged_between_processes() {
    let blob = blob_hex();
    let (_, [output]) = with_port(|port| {
        [Command::new(ZERO_RUN)
            .args([
                "--nproc-per-node",
                "4",
                "--master-port",
                &port.to_string(),
                "--",
            ])
            .args([PROBE, "rendezvous", "10000", &blob])
            .output()
            .unwrap()]
    });
    let (stdout, stderr) = texts(&output);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for rank in 0..4 {
        let line = format!("[rank {rank}] blob {blob}");
        assert!(
            stdout.lines().any(|l| l == line),
            "missing {line:?} in\n{stdout}"
        );
    }
}

#[test]
fn wrong_world_size_is_rejected() {
    let (_, [master, peer]) = with_port(|port| {
        let master = probe_rank(0, 2, port, &["rendezvous", "10000", "abcd"])
            .spawn()
            .unwrap();
        let peer = probe_rank(1, 3, port, &["rendezvous", "10000"])
            .output()
            .unwrap();
        [master.wait_with_output().unwrap(), peer]
    });

    let (_, master_err) = texts(&master);
    assert_eq!(master.status.code(), Some(3), "{master_err}");
    assert!(
        master_err.contains(
            "world size mismatch: rank 1 was started with WORLD_SIZE=3, rank 0 with WORLD_SIZE=2"
        ),
        "{master_err}"
    );
    let (_, peer_err) = texts(&peer);
    assert_eq!(peer.status.code(), Some(3), "{peer_err}");
    assert!(
        peer_err.contains("rank 0 rejected rank 1: world size mismatch"),
        "{peer_err}"
    );
}

#[test]
fn duplicate_rank_is_rejected() {
    let (_, outputs) = with_port(|port| {
        let master = probe_rank(0, 3, port, &["rendezvous", "10000", "abcd"])
            .spawn()
            .unwrap();
        let first = probe_rank(1, 3, port, &["rendezvous", "10000"])
            .spawn()
            .unwrap();
        let second = probe_rank(1, 3, port, &["rendezvous", "10000"])
            .spawn()
            .unwrap();
        [master, first, second].map(|child| child.wait_with_output().unwrap())
    });
    for output in &outputs {
        let (_, stderr) = texts(output);
        assert_eq!(output.status.code(), Some(3), "{stderr}");
        assert!(
            stderr.contains("rank 1 joined the rendezvous twice"),
            "{stderr}"
        );
    }
}

#[test]
fn unreachable_master_times_out_with_a_clear_error() {
    let port = free_port();
    let started = Instant::now();
    let output = probe_rank(1, 2, port, &["rendezvous", "500"])
        .output()
        .unwrap();
    let elapsed = started.elapsed();
    let (_, stderr) = texts(&output);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "rank 1 could not reach the master at 127.0.0.1:{port} within"
        )),
        "{stderr}"
    );
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
}

#[test]
fn missing_variables_are_reported() {
    let output = Command::new(PROBE)
        .args(["rendezvous", "500"])
        .env_remove("RANK")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    let (_, stderr) = texts(&output);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("environment variable RANK is not set"),
        "{stderr}"
    );
}
