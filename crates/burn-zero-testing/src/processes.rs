//! Rank processes for tests: `mpirun` jobs, Open MPI's name server for ranks started by hand,
//! programs built beside the test binary, and each rank's output.
//!
//! A test that needs Open MPI's `mpirun` and finds none prints `SKIPPED: <test>: <reason>`, or
//! fails where `BURN_ZERO_REQUIRE_MPI=1` says the machine must have it (CI, after installing
//! it).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::skip::skip;

/// The variable that turns a missing `mpirun` into a failure.
pub const REQUIRE_MPI: &str = "BURN_ZERO_REQUIRE_MPI";

/// `name` in a directory of `PATH`.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Skips `test` (or fails it under [`REQUIRE_MPI`]) for lack of Open MPI's `program`.
fn absent(test: &str, program: &str) {
    let reason = format!("no {program} on PATH (install Open MPI: openmpi-bin)");
    if std::env::var(REQUIRE_MPI).is_ok_and(|v| !v.is_empty() && v != "0") {
        panic!("{test}: {reason}, and {REQUIRE_MPI} is set: this machine must have it");
    }
    skip(test, reason);
}

/// Whether this process runs as root (Open MPI refuses root unless told it is meant).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find(|line| line.starts_with("Uid:"))
            .and_then(|line| line.split_whitespace().nth(2))
            == Some("0")
    })
}

/// Lets Open MPI's programs run as root, as a container's tests often do.
pub fn allow_root(command: &mut Command) -> &mut Command {
    if is_root() {
        command
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    command
}

/// `mpirun` starting `np` processes on this machine, more than its cores if need be, each
/// output line tagged with its rank (see [`tagged_ranks`]); `None` when there is no `mpirun`
/// (and `test` was skipped). Add the program and its arguments.
pub fn mpirun(test: &str, np: usize) -> Option<Command> {
    let Some(mpirun) = on_path("mpirun") else {
        absent(test, "mpirun");
        return None;
    };
    let mut command = Command::new(mpirun);
    allow_root(&mut command);
    command
        .args(["--oversubscribe", "--bind-to", "none", "--tag-output"])
        .args(["-np", &np.to_string()])
        .stdin(Stdio::null());
    Some(command)
}

/// Each rank's text in `mpirun --tag-output`'s output, by rank: every piece after a tag
/// `[job,rank]<stdout>:` or `<stderr>:` up to the next tag, which may come in the middle of a
/// line when a rank's line was not finished (a test harness's `test … ` before the result).
pub fn tagged_ranks(output: &str) -> BTreeMap<usize, String> {
    let mut ranks: BTreeMap<usize, String> = BTreeMap::new();
    let mut rest = output;
    let mut current: Option<usize> = None;
    while !rest.is_empty() {
        let (text, tag) = match next_tag(rest) {
            Some((start, end, rank)) => {
                let text = &rest[..start];
                rest = &rest[end..];
                (text, Some(rank))
            }
            None => {
                let text = rest;
                rest = "";
                (text, None)
            }
        };
        if let Some(rank) = current {
            ranks.entry(rank).or_default().push_str(text);
        }
        if tag.is_some() {
            current = tag;
        }
    }
    ranks
}

/// The first tag of `mpirun --tag-output` in `text`: its start, its end and its rank.
fn next_tag(text: &str) -> Option<(usize, usize, usize)> {
    let mut from = 0;
    while let Some(offset) = text[from..].find('[') {
        let start = from + offset;
        let tail = &text[start + 1..];
        if let Some(close) = tail.find(']') {
            let inside = &tail[..close];
            let after = &tail[close + 1..];
            let stream = ["<stdout>:", "<stderr>:"]
                .into_iter()
                .find(|stream| after.starts_with(stream));
            if let (Some(stream), Some(rank)) = (
                stream,
                inside
                    .split_once(',')
                    .and_then(|(_, rank)| rank.parse::<usize>().ok()),
            ) {
                return Some((start, start + 1 + close + 1 + stream.len(), rank));
            }
        }
        from = start + 1;
    }
    None
}

/// Each rank's lines of `zero-run`'s output (`[rank N] line`), by rank.
pub fn prefixed_ranks(output: &str) -> BTreeMap<usize, String> {
    let mut ranks: BTreeMap<usize, String> = BTreeMap::new();
    for line in output.lines() {
        let Some(rest) = line.strip_prefix("[rank ") else {
            continue;
        };
        let Some((rank, text)) = rest.split_once("] ") else {
            continue;
        };
        if let Ok(rank) = rank.parse() {
            let lines = ranks.entry(rank).or_default();
            lines.push_str(text);
            lines.push('\n');
        }
    }
    ranks
}

/// Open MPI's name server, for ranks a test starts by hand (as separate programs that join
/// one MPI world); stopped when dropped.
pub struct NameServer {
    child: Child,
    dir: PathBuf,
}

impl NameServer {
    /// Starts `ompi-server`; `None` when it is missing (and `test` was skipped).
    pub fn start(test: &str) -> Option<Self> {
        let Some(program) = on_path("ompi-server") else {
            absent(test, "ompi-server");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("burn-zero-ns-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let uri = dir.join("uri");
        let mut command = Command::new(program);
        allow_root(&mut command);
        let child = command
            .arg("--no-daemonize")
            .arg("--report-uri")
            .arg(&uri)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("ompi-server starts");
        let server = NameServer { child, dir };
        let started = Instant::now();
        while !std::fs::metadata(&uri).is_ok_and(|m| m.len() > 0) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "ompi-server wrote no address"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        Some(server)
    }

    /// Points `command`'s MPI at this server.
    pub fn point(&self, command: &mut Command) {
        let mut value = std::ffi::OsString::from("file:");
        value.push(self.dir.join("uri").as_os_str());
        command.env("OMPI_MCA_pmix_server_uri", value);
    }
}

impl Drop for NameServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A program built into the target folder this test runs from (`relative` to the profile's
/// folder, such as `zero-run` or `examples/train_gpt`), or `variable`'s path when set (a test
/// binary carried to another machine is told where the programs are).
///
/// # Panics
/// When it is missing, saying how to build it.
pub fn built(variable: &str, relative: &str, build: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return path.into();
    }
    // A test binary is <target>/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("a test binary under <target>/<profile>/deps");
    let path = profile.join(relative);
    assert!(
        path.exists(),
        "{} is missing: build it ({build}) or set {variable}",
        path.display()
    );
    path
}

/// A TCP port for a job's rendezvous that nothing else is about to take.
///
/// A port the kernel hands out for `:0` comes from its ephemeral range, from which every
/// outgoing connection also takes its local port: between this call and the job's listen,
/// MPI's daemons or another test's connections may take it ("Address already in use"). So the
/// port comes from below that range (`/proc/sys/net/ipv4/ip_local_port_range`; 32768 where it
/// cannot be read), where only an explicit bind takes a port; it is free on every address, as
/// the rank that listens binds them all; and no two calls of this process return the same one
/// (tests of one binary run side by side), while processes start at places spread by their id.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral.saturating_sub(FIRST).max(1);
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = (FIRST + offset) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free TCP port from {FIRST} up to the ephemeral range's start ({ephemeral})")
}

/// `command`'s text for messages.
pub fn describe(command: &Command) -> String {
    let args: Vec<&OsStr> = command.get_args().collect();
    format!(
        "{} {}",
        command.get_program().to_string_lossy(),
        args.iter()
            .map(|arg| arg.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    )
}
