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

use std::time::Duration;

use burn_zero_launch::{DistEnv, Rendezvous, establish};

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

fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_hex(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}
