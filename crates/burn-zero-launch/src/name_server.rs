//! Open MPI's name server (`ompi-server`) for the ranks `zero-run` starts.
//!
//! Processes that no MPI launcher started are each an MPI job of their own; Open MPI lets
//! such jobs connect to one another (which burn-zero's MPI engine does to join them into one
//! world) only through a name server they all reach. `zero-run` starts one for the job when
//! Open MPI is installed and the job has more than one rank on one node, and tells every rank
//! where it is through [`SERVER_URI_VAR`]. Programs that do not use MPI never look at it.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// The variable through which Open MPI finds its name server (an MCA parameter), set to
/// `file:<path of the file holding the server's address>`.
pub const SERVER_URI_VAR: &str = "OMPI_MCA_pmix_server_uri";

/// The name server's program.
const PROGRAM: &str = "ompi-server";

/// How long the server may take to write its address.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A running `ompi-server`, stopped when dropped.
#[derive(Debug)]
pub(crate) struct NameServer {
    child: Child,
    uri_file: PathBuf,
}

impl NameServer {
    /// Starts `ompi-server` with its address written under `dir`, when it is installed;
    /// `None` (logged) when it is not or does not start.
    pub fn start(dir: &Path) -> Option<Self> {
        let program = find_on_path(PROGRAM)?;
        let uri_file = dir.join("ompi-server.uri");
        // Its session folder goes under `dir` (zero-run's private folder, removed at the end),
        // not the user's temporary folder.
        let child = Command::new(&program)
            .env("TMPDIR", dir)
            .arg("--no-daemonize")
            .arg("--report-uri")
            .arg(&uri_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        let mut server = match child {
            Ok(child) => NameServer { child, uri_file },
            Err(error) => {
                tracing::warn!(%error, program = %program.display(), "could not start Open MPI's name server: MPI ranks cannot join");
                return None;
            }
        };
        let started = Instant::now();
        while started.elapsed() < START_TIMEOUT {
            if std::fs::metadata(&server.uri_file).is_ok_and(|m| m.len() > 0) {
                tracing::debug!(uri_file = %server.uri_file.display(), "Open MPI's name server is up");
                return Some(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                tracing::warn!(%status, "Open MPI's name server exited at start: MPI ranks cannot join");
                return None;
            }
            thread::sleep(Duration::from_millis(5));
        }
        tracing::warn!(waited = ?START_TIMEOUT, "Open MPI's name server wrote no address: MPI ranks cannot join");
        server.stop();
        None
    }

    /// The variable and value that point a rank at this server.
    pub fn env(&self) -> (&'static str, OsString) {
        let mut value = OsString::from("file:");
        value.push(self.uri_file.as_os_str());
        (SERVER_URI_VAR, value)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NameServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `name` in a directory of `PATH`.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}
