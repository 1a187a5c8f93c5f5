//! Kernel launches counted at the backend boundary, from cubecl's execution log.
//!
//! cubecl's compute server writes a line (`Executing <kernel>`) for every kernel it runs when
//! its profiling log is at the `minimal` level, whatever issued the launch: burn-zero's
//! kernels, Burn's tensor ops, Burn's fusion layer. [`LaunchLog::install`] sends that log to a
//! file of this process; [`LaunchLog::launches`] launches a marker kernel of its own before and
//! after some work and returns the lines between the two markers. What a GPU pays per launch
//! is then counted on any machine that has a cubecl device, lavapipe included.
//!
//! The log is a file of the temporary directory named after the process
//! (`burn-zero-launches-<pid>.log`); installing one removes those of processes that have
//! ended. It is configured once per process, before the first cubecl client reads the
//! configuration: install it before anything touches a wgpu or CUDA device. Counting is one
//! window at a time (a lock), and a window counts every launch on the device in it, from
//! every thread: let only the work being measured run in it, and have it finish its device
//! work (sync) before it returns.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use burn_cubecl::CubeRuntime;
use cubecl::config::profiling::ProfilingLogLevel;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl::prelude::*;

/// The marker: a kernel nothing else launches.
#[cube(launch)]
fn launch_count_marker(out: &mut Array<f32>) {
    if ABSOLUTE_POS == 0 {
        out[0] = 1.0;
    }
}

/// How long a marker may take to reach the log before counting gives up.
const MARKER_WAIT: Duration = Duration::from_secs(30);

/// This process's cubecl execution log (see the module docs).
#[derive(Debug)]
pub struct LaunchLog {
    path: PathBuf,
    /// Markers launched so far.
    markers: AtomicUsize,
    /// One counting window at a time: the log is one stream.
    window: Mutex<()>,
}

/// Why launches could not be counted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchCountError {
    /// The device did not finish the marker.
    #[error("the device could not finish the launch counter's marker: {0}")]
    Sync(String),
    /// The marker never appeared in the log: it was installed after a client existed.
    #[error(
        "the launch counter's marker never reached cubecl's execution log ({0}): install the \
         log before the first use of the device"
    )]
    NotLogged(PathBuf),
}

/// How every process's log is named, before its pid.
const LOG_PREFIX: &str = "burn-zero-launches-";

/// The log's file name for process `pid`, under the temporary directory.
fn log_name(pid: u32) -> String {
    format!("{LOG_PREFIX}{pid}.log")
}

/// Removes the logs that processes which have ended left behind. cubecl holds the log open
/// until the process exits, and a static is never dropped, so a process cannot remove its own;
/// the next one that installs a log does. Where a process's liveness cannot be read (no
/// `/proc`), logs are left alone.
fn remove_logs_of_ended_processes() {
    let proc = std::path::Path::new("/proc");
    if !proc.join("self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix(LOG_PREFIX))
            .and_then(|rest| rest.strip_suffix(".log"))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !proc.join(pid.to_string()).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl LaunchLog {
    /// Turns cubecl's execution log on, into a file of this process, and returns the one log
    /// (later calls return the same). Must run before any cubecl client exists.
    pub fn install() -> &'static LaunchLog {
        static LOG: OnceLock<LaunchLog> = OnceLock::new();
        LOG.get_or_init(|| {
            remove_logs_of_ended_processes();
            let path = std::env::temp_dir().join(log_name(std::process::id()));
            let _ = std::fs::remove_file(&path);
            let mut config = CubeClRuntimeConfig::default();
            config.profiling.logger.level = ProfilingLogLevel::Minimal;
            config.profiling.logger.file = Some(path.clone());
            config.profiling.logger.append = true;
            CubeClRuntimeConfig::set(config);
            LaunchLog {
                path,
                markers: AtomicUsize::new(0),
                window: Mutex::new(()),
            }
        })
    }

    /// Runs `work` and returns its result with the kernels launched on `device` (runtime `R`)
    /// meanwhile, one log line each (`Executing <kernel>…`).
    pub fn launches<R: CubeRuntime, T>(
        &self,
        device: &R::Device,
        work: impl FnOnce() -> T,
    ) -> Result<(T, Vec<String>), LaunchCountError> {
        let _one_window = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let start = self.mark::<R>(device)?;
        let result = work();
        let end = self.mark::<R>(device)?;
        let launched = self.lines()[start + 1..end]
            .iter()
            .filter(|line| line.starts_with("Executing"))
            .cloned()
            .collect();
        Ok((result, launched))
    }

    fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.path)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Launches the marker and waits until the log has written it: every launch made before it
    /// on this device is then in the file. Returns the marker's line number.
    fn mark<R: CubeRuntime>(&self, device: &R::Device) -> Result<usize, LaunchCountError> {
        let client = R::client(device);
        let out = client.empty(4);
        let nth = self.markers.fetch_add(1, Ordering::SeqCst) + 1;
        // SAFETY: `out` was just allocated with room for one f32, the one element the array
        // argument declares, and the kernel writes only element 0.
        let array = unsafe { ArrayArg::from_raw_parts(out, 1) };
        launch_count_marker::launch::<R>(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            array,
        );
        cubecl::future::block_on(client.sync())
            .map_err(|error| LaunchCountError::Sync(format!("{error:?}")))?;
        let deadline = Instant::now() + MARKER_WAIT;
        loop {
            let found = self
                .lines()
                .iter()
                .enumerate()
                .filter(|(_, line)| line.contains("LaunchCountMarker"))
                .nth(nth - 1)
                .map(|(at, _)| at);
            if let Some(at) = found {
                return Ok(at);
            }
            if Instant::now() >= deadline {
                return Err(LaunchCountError::NotLogged(self.path.clone()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// A log whose process has ended is removed; one whose process runs (this test's parent)
    /// is kept, and so is a file that only looks alike.
    #[test]
    fn installing_removes_the_logs_of_ended_processes_only() {
        let dir = std::env::temp_dir();
        // Above Linux's largest pid (2^22), so no process has it.
        let ended = dir.join(log_name(u32::MAX - 1));
        let running = dir.join(log_name(std::os::unix::process::parent_id()));
        let other = dir.join(format!("{LOG_PREFIX}notes.log"));
        let running_existed = running.exists();
        for path in [&ended, &running, &other] {
            if !(path == &running && running_existed) {
                std::fs::write(path, "Executing a kernel\n").unwrap();
            }
        }
        remove_logs_of_ended_processes();
        let (ended_left, running_left, other_left) =
            (ended.exists(), running.exists(), other.exists());
        let _ = std::fs::remove_file(&other);
        if !running_existed {
            let _ = std::fs::remove_file(&running);
        }
        assert!(!ended_left, "{}: its process has ended", ended.display());
        assert!(running_left, "{}: its process runs", running.display());
        assert!(other_left, "{}: not a process's log", other.display());
    }
}
