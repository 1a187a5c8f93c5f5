//! One rank of a multi-process job that exercises the control connection without NCCL, for
//! burn-zero-comm's process tests (not meant for users).
//!
//! Started with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. With `--pick-port`, rank 0
//! binds the rendezvous on a port the system picks and prints `port N` first (the test hands
//! it to the other ranks). Modes:
//!
//! - `schedule CALLS DIVERGE_RANK DIVERGE_AT`: checks CALLS fingerprints (all-gathers of 4096
//!   f32); rank DIVERGE_RANK's call DIVERGE_AT is a reduce-scatter of 8192 instead (0: none).
//! - `fail FAIL_RANK HOW`: every rank checks one call; then FAIL_RANK fails (`abort`: says so
//!   and exits 1, `exit`: exits 1 without a word, `panic`: panics) while the others wait in
//!   their second call.
//! - `report FAIL_RANK`: every rank checks one call; FAIL_RANK reports a failure
//!   (`disk full (on purpose)`) without stopping the job; every rank checks a second call (as
//!   the agreement that tells the others) and succeeds.
//! - `leave`: rank 1 finishes after one call; the others wait in a second.
//! - `bench CALLS`: times CALLS checks and prints `per-check-us X`.
//!
//! Prints `ok` (exit 0), or `error: E` and `after-ms T` (exit 3); then, when the store has
//! recorded the job's first cause, `first-failure R: REASON`.

use std::time::{Duration, Instant};

use burn::tensor::DType;
use burn_zero_comm::{CollectiveCall, CollectiveOp, CommError, JobControl, ReduceOp};
use burn_zero_launch::{DistEnv, Rendezvous, establish};

fn arg(args: &[String], index: usize) -> usize {
    args.get(index).and_then(|a| a.parse().ok()).unwrap_or(0)
}

fn call(seq: u64, diverge: bool) -> CollectiveCall {
    if diverge {
        CollectiveCall {
            seq,
            op: CollectiveOp::ReduceScatter(ReduceOp::Sum),
            dtype: Some(DType::F32),
            numel: 8192,
        }
    } else {
        CollectiveCall {
            seq,
            op: CollectiveOp::AllGather,
            dtype: Some(DType::F32),
            numel: 4096,
        }
    }
}

fn connect(pick_port: bool) -> Result<JobControl, String> {
    let mut env = DistEnv::from_env().map_err(|e| e.to_string())?;
    let listener = if pick_port && env.rank == 0 {
        env.master_port = 0;
        let listener = Rendezvous::new(&env).bind().map_err(|e| e.to_string())?;
        println!("port {}", listener.port().map_err(|e| e.to_string())?);
        Some(listener)
    } else {
        None
    };
    let (_, client) =
        establish(&env, Duration::from_secs(20), listener, Vec::new).map_err(|e| e.to_string())?;
    Ok(JobControl::new(client, true, Duration::from_secs(60)))
}

fn run(args: &[String], control: &JobControl) -> Result<(), CommError> {
    let rank = control.rank();
    match args.first().map(String::as_str) {
        Some("schedule") => {
            let (calls, diverge_rank, diverge_at) = (arg(args, 1), arg(args, 2), arg(args, 3));
            for seq in 1..=calls as u64 {
                control.check(&call(seq, rank == diverge_rank && seq == diverge_at as u64))?;
            }
        }
        Some("fail") => {
            control.check(&call(1, false))?;
            if rank == arg(args, 1) {
                std::thread::sleep(Duration::from_millis(100));
                match args.get(2).map(String::as_str) {
                    Some("abort") => {
                        control.abort("out of memory (on purpose)");
                        std::process::exit(1);
                    }
                    Some("panic") => panic!("rank {rank} panics on purpose"),
                    _ => std::process::exit(1),
                }
            }
            control.check(&call(2, false))?;
        }
        Some("report") => {
            control.check(&call(1, false))?;
            if rank == arg(args, 1) {
                control.report("disk full (on purpose)");
            }
            control.check(&call(2, false))?;
        }
        Some("leave") => {
            control.check(&call(1, false))?;
            if rank != 1 {
                control.check(&call(2, false))?;
            } else {
                control.leave(1);
            }
        }
        Some("bench") => {
            let calls = arg(args, 1).max(1);
            let started = Instant::now();
            for seq in 1..=calls as u64 {
                control.check(&call(seq, false))?;
            }
            let per_check = started.elapsed().as_secs_f64() * 1e6 / calls as f64;
            println!("per-check-us {per_check:.1}");
        }
        other => {
            return Err(CommError::InvalidGroup(format!("unknown mode {other:?}")));
        }
    }
    Ok(())
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let pick_port = args.first().is_some_and(|a| a == "--pick-port");
    if pick_port {
        args.remove(0);
    }
    let control = match connect(pick_port) {
        Ok(control) => control,
        Err(error) => {
            println!("error: {error}");
            std::process::exit(3);
        }
    };
    let started = Instant::now();
    let result = run(&args, &control);
    match &result {
        Ok(()) => println!("ok"),
        Err(error) => {
            println!("error: {error}");
            println!("after-ms {}", started.elapsed().as_millis());
        }
    }
    if let Some((rank, reason)) = control.first_failure() {
        println!("first-failure {rank}: {reason}");
    }
    if result.is_err() {
        drop(control);
        std::process::exit(3);
    }
}
