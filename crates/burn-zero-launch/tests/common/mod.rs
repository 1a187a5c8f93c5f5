//! Helpers shared by the process-level tests.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

/// The test rank program.
pub const PROBE: &str = env!("CARGO_BIN_EXE_zero-launch-probe");
/// The launcher under test.
pub const ZERO_RUN: &str = env!("CARGO_BIN_EXE_zero-run");

/// The ports [`free_port`] handed out in this test process.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A port nobody listens on right now (bound to port 0, then released), and never handed to
/// another test of this process (tests run side by side, and the system may offer a released
/// port again before the first test's master binds it). Another process may still take it
/// before a test's master binds it: run tests that bind it through [`with_port`].
pub fn free_port() -> u16 {
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if handed_out.insert(port) {
            return port;
        }
    }
}

/// Runs `attempt` with a free port and returns the port and the processes' outputs, trying again with
/// another port when a master could not bind its port because something took it between
/// [`free_port`] and the bind ("Address already in use"), at most five times.
pub fn with_port<const N: usize>(
    mut attempt: impl FnMut(u16) -> [Output; N],
) -> (u16, [Output; N]) {
    for _ in 0..4 {
        let port = free_port();
        let outputs = attempt(port);
        let taken = outputs
            .iter()
            .any(|output| texts(output).1.contains("Address already in use"));
        if !taken {
            return (port, outputs);
        }
    }
    let port = free_port();
    (port, attempt(port))
}

/// The probe as rank `rank` of `world_size`, with the launcher environment set by hand.
pub fn probe_rank(rank: usize, world_size: usize, port: u16, args: &[&str]) -> Command {
    let mut command = Command::new(PROBE);
    command
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world_size.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Standard output and error of a finished process, as text.
pub fn texts(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}
