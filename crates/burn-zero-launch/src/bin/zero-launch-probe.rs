//! A stand-in rank program for burn-zero-launch's tests. Not meant for users.
//!
//! - `env`: prints the launcher variables on stdout and one line on stderr.
//! - `fail RANK CODE`: rank RANK exits with CODE after a short pause; every other rank sleeps
//!   for a minute (the supervisor must stop it).
//! - `sleep`: says `ready`, then sleeps for a minute.
//! - `rendezvous TIMEOUT_MS [BLOB_HEX]`: joins the rendezvous described by the environment
//!   (rank 0 shares BLOB_HEX) and prints `blob <hex>`, or the error and exits with code 3.
//! - `job TIMEOUT_MS [FAIL_RANK]`: a job without collectives, from whatever launcher started
//!   it: prints `launcher NAME` and `rank R of W, local L of N, master HOST:PORT`, meets the
//!   other ranks through the rendezvous and the control store, checks one schedule position
//!   (`joined`), then rank FAIL_RANK aborts the job and exits with code 1 while the others
//!   print `stopped: E` and exit with code 4; without FAIL_RANK every rank prints `done`.
//!   A launcher environment or rendezvous that fails prints `error: E` and exits with code 3.
//! - `cause CAUSE_RANK HOW`: ranks meet as in `job`, then rank CAUSE_RANK fails and is the last
//!   to exit, so that a launcher blaming the first rank to exit would name a consequence. HOW:
//!   `report`: it reports `disk full on rank R (on purpose)` to the control store, every rank
//!   then checks a second position (as an agreement that tells the others), and it exits with
//!   code 5 half a second after the others exit with code 4; `panic`: it panics (its control
//!   connection aborts the job) and lingers half a second before exiting with 101, while the
//!   others, told by the store, exit with code 4; `abort`: it aborts the process (SIGABRT, no
//!   word to the store) and the others exit with code 4; `quiet`: it says goodbye to the store
//!   and exits with code 7 without reporting anything, while the others sleep for a minute,
//!   rank 0 ignoring SIGTERM (so its store sees the others killed before it goes).

use std::time::Duration;

use burn_zero_launch::{ControlClient, DistEnv, Rendezvous, establish};

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| "<unset>".into())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("env");
    match mode {
        "env" => {
            for name in [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            ] {
                println!("{name}={}", var(name));
            }
            eprintln!("stderr of rank {}", var("RANK"));
            // A last line with no newline.
            print!("done");
        }
        "gpu-env" => {
            for name in [
                "CUDA_VISIBLE_DEVICES",
                "NCCL_HOSTID",
                "NCCL_MULTI_RANK_GPU_ENABLE",
            ] {
                println!("{name}={}", var(name));
            }
        }
        "fail" => {
            let failing: String = args.get(1).cloned().unwrap_or_default();
            let code: i32 = args.get(2).and_then(|c| c.parse().ok()).unwrap_or(1);
            println!("ready");
            if var("RANK") == failing {
                std::thread::sleep(Duration::from_millis(300));
                eprintln!("failing on purpose");
                std::process::exit(code);
            }
            std::thread::sleep(Duration::from_secs(60));
            println!("not stopped");
        }
        "sleep" => {
            println!("ready");
            std::thread::sleep(Duration::from_secs(60));
            println!("not stopped");
        }
        "rendezvous" => {
            let timeout: u64 = args.get(1).and_then(|t| t.parse().ok()).unwrap_or(5000);
            let blob = args.get(2).cloned().unwrap_or_default();
            let result = DistEnv::from_env()
                .map_err(|e| e.to_string())
                .and_then(|env| {
                    Rendezvous::new(&env)
                        .with_timeout(Duration::from_millis(timeout))
                        .share(|| decode_hex(&blob))
                        .map_err(|e| e.to_string())
                });
            match result {
                Ok(bytes) => println!("blob {}", encode_hex(&bytes)),
                Err(error) => {
                    eprintln!("error: {error}");
                    std::process::exit(3);
                }
            }
        }
        "job" => {
            let timeout: u64 = args.get(1).and_then(|t| t.parse().ok()).unwrap_or(10_000);
            let fail_rank = args.get(2).and_then(|r| r.parse().ok());
            std::process::exit(job(Duration::from_millis(timeout), fail_rank));
        }
        "cause" => {
            let cause_rank = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(1);
            let how = args.get(2).cloned().unwrap_or_default();
            std::process::exit(cause(cause_rank, &how));
        }
        other => {
            eprintln!("unknown mode {other}");
            std::process::exit(2);
        }
    }
}

/// The `job` mode; returns the exit code.
fn job(timeout: Duration, fail_rank: Option<usize>) -> i32 {
    let detected = match DistEnv::detect() {
        Ok(detected) => detected,
        Err(error) => {
            eprintln!("error: {error}");
            return 3;
        }
    };
    let env = &detected.env;
    println!("launcher {}", detected.source.name());
    let local_world_size = env
        .local_world_size
        .map_or_else(|| "?".to_string(), |n| n.to_string());
    println!(
        "rank {} of {}, local {} of {}, master {}",
        env.rank,
        env.world_size,
        env.local_rank,
        local_world_size,
        env.master_endpoint()
    );
    let client = match establish(env, timeout, None, Vec::new) {
        Ok((_, client)) => client,
        Err(error) => {
            eprintln!("error: {error}");
            return 3;
        }
    };
    if let Err(error) = client.check(1, b"job", timeout) {
        eprintln!("error: {error}");
        return 3;
    }
    println!("joined");
    if fail_rank == Some(env.rank) {
        std::thread::sleep(Duration::from_millis(200));
        client.abort(&format!("rank {} fails on purpose", env.rank));
        // Give the store a moment to pass the abort on before this process is gone.
        std::thread::sleep(Duration::from_millis(200));
        return 1;
    }
    match client.check(2, b"job", timeout) {
        Ok(()) => {
            println!("done");
            0
        }
        Err(error) => {
            println!("stopped: {error}");
            4
        }
    }
}

/// While the thread unwinds from a panic, holds the process a moment before it exits.
struct Linger(Duration);

impl Drop for Linger {
    fn drop(&mut self) {
        if std::thread::panicking() {
            std::thread::sleep(self.0);
        }
    }
}

/// The `cause` mode; returns the exit code.
fn cause(cause_rank: usize, how: &str) -> i32 {
    const LATE: Duration = Duration::from_millis(500);
    let timeout = Duration::from_secs(10);
    // Dropped after the control connection: a panicking rank aborts the job, then lingers.
    let _linger = Linger(LATE);
    let env = match DistEnv::from_env() {
        Ok(env) => env,
        Err(error) => {
            eprintln!("error: {error}");
            return 3;
        }
    };
    let client = match establish(&env, timeout, None, Vec::new) {
        Ok((_, client)) => client,
        Err(error) => {
            eprintln!("error: {error}");
            return 3;
        }
    };
    if let Err(error) = client.check(1, b"cause", timeout) {
        eprintln!("error: {error}");
        return 3;
    }
    let is_cause = env.rank == cause_rank;
    if how == "quiet" {
        return quiet(&client, is_cause, env.rank);
    }
    match how {
        "report" if is_cause => {
            client.report(&format!("disk full on rank {} (on purpose)", env.rank))
        }
        "panic" if is_cause => panic!("rank {} panics on purpose", env.rank),
        "abort" if is_cause => std::process::abort(),
        _ => {}
    }
    // The agreement through which the other ranks learn that this one failed.
    let agreed = client.check(2, b"cause", timeout);
    if is_cause {
        std::thread::sleep(LATE);
        eprintln!("failing on purpose");
        return 5;
    }
    match agreed {
        Ok(()) => eprintln!("stopped: rank {cause_rank} failed (the agreement says so)"),
        Err(error) => eprintln!("stopped: {error}"),
    }
    // At once, without the goodbye (rank 0 would keep its store open for the others).
    std::process::exit(4)
}

/// The `quiet` case of the `cause` mode.
fn quiet(client: &ControlClient, is_cause: bool, rank: usize) -> i32 {
    if is_cause {
        client.leave(1);
        eprintln!("failing on purpose");
        std::process::exit(7);
    }
    if rank == 0 {
        // SAFETY: ignoring a signal installs no handler code; nothing else in this process
        // depends on SIGTERM's disposition.
        unsafe {
            libc::signal(libc::SIGTERM, libc::SIG_IGN);
        }
    }
    println!("ready");
    std::thread::sleep(Duration::from_secs(60));
    println!("not stopped");
    0
}

fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_hex(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}
