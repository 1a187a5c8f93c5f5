//! The operating-system edge of the supervisor: catching SIGINT/SIGTERM, sending signals to
//! rank processes, and tying a rank's life to the supervisor's. Every `unsafe` block of the
//! crate is in this module.

use std::io;
use std::process::Command;
use std::sync::Once;
use std::sync::atomic::{AtomicI32, Ordering};

/// Interrupt (Ctrl-C).
pub const SIGINT: i32 = libc::SIGINT;
/// Polite termination.
pub const SIGTERM: i32 = libc::SIGTERM;
/// Forced termination.
pub const SIGKILL: i32 = libc::SIGKILL;

/// The last termination signal received and not yet taken (0: none).
static PENDING: AtomicI32 = AtomicI32::new(0);
static INSTALL: Once = Once::new();

extern "C" fn record_signal(signal: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    PENDING.store(signal, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM of this process to [`take_pending`] instead of the default
/// (terminate). Idempotent. Returns the error of the first failed `sigaction`.
pub fn catch_termination() -> io::Result<()> {
    let mut result = Ok(());
    INSTALL.call_once(|| {
        for signal in [SIGINT, SIGTERM] {
            // SAFETY: `action` is zero-initialised (a valid `sigaction`: empty mask, no flags)
            // before its fields are set; the handler only performs an atomic store, which is
            // async-signal-safe, and has the `extern "C" fn(c_int)` signature `sa_sigaction`
            // expects when SA_SIGINFO is not set.
            let status = unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = record_signal as *const () as libc::sighandler_t;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut())
            };
            if status != 0 {
                result = Err(io::Error::last_os_error());
                return;
            }
        }
    });
    result
}

/// The termination signal received since the last call, if any.
pub fn take_pending() -> Option<i32> {
    match PENDING.swap(0, Ordering::SeqCst) {
        0 => None,
        signal => Some(signal),
    }
}

/// Sends `signal` to the process group led by `pid` (a rank and whatever it started). A group
/// that no longer exists is not an error.
pub fn signal_group(pid: u32, signal: i32) -> io::Result<()> {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "pid out of range",
        ));
    };
    // SAFETY: `kill` has no memory-safety preconditions; a negative pid addresses the process
    // group `pid`, which each rank leads (it was spawned with `process_group(0)`).
    let status = unsafe { libc::kill(-pid, signal) };
    if status == 0 {
        return Ok(());
    }
    let error = io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::ESRCH) {
        Ok(())
    } else {
        Err(error)
    }
}

/// Name of a signal number, for messages.
pub fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGSEGV => "SIGSEGV".into(),
        libc::SIGABRT => "SIGABRT".into(),
        libc::SIGHUP => "SIGHUP".into(),
        libc::SIGBUS => "SIGBUS".into(),
        libc::SIGPIPE => "SIGPIPE".into(),
        other => format!("signal {other}"),
    }
}

/// Starts the rank in its own process group (so a terminal's Ctrl-C reaches only the
/// supervisor, which forwards it once) and, on Linux, asks the kernel to send it SIGTERM if the
/// supervisor dies, so no rank outlives a killed `zero-run`.
pub fn tie_to_supervisor(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    command.process_group(0);
    #[cfg(target_os = "linux")]
    {
        let supervisor = std::process::id();
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe functions may be called: `prctl` and `getppid` are system calls
        // that allocate nothing and take no locks, and the errors it returns carry an OS code
        // inline (no allocation).
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The supervisor may have died before prctl took effect. (No allocation here:
                // an OS error code is stored inline.)
                if libc::getppid() as u32 != supervisor {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
}
