//! The control connection: a small store that rank 0 keeps open for the whole job, beside the
//! rendezvous, as PyTorch's TCPStore is kept beside its process groups.
//!
//! It carries two things, never tensors:
//!
//! - **Aborts.** A rank that fails tells the store ([`ControlClient::abort`]); a rank whose
//!   connection breaks without a goodbye (its process panicked, was killed, or its node lost the
//!   network) is noticed by the store. Either way the store tells every rank at once, and each
//!   rank runs its failure hooks ([`ControlClient::on_failure`]), which abort its
//!   communicators. So one failed rank stops the whole job within a round trip, on every node,
//!   instead of leaving the others blocked in a collective until their timeout.
//! - **Schedule checks.** Before a collective, a rank may send its fingerprint
//!   ([`ControlClient::check`]) and wait until every rank has sent the same one for the same
//!   position of its schedule. Two different fingerprints at one position fail the job with
//!   [`ControlFailure::Diverged`], which names both ranks and both fingerprints, before any
//!   buffer of the diverged collective is touched.
//!
//! It also keeps the job's **first cause**: the first rank that failed on its own account, with
//! its reason ([`FirstCause`]). A rank that fails and is about to tell the others through a
//! collective (an agreement among the ranks) reports its failure first
//! ([`ControlClient::report`]); an abort counts as a report, and so does a rank lost or a
//! diverged schedule when no rank reported before. The other ranks then stop because of it, in
//! whatever order their processes end; the store remembers who came first, tells every rank
//! ([`ControlClient::cause`]), and writes it to the file named by [`CAUSE_FILE_VAR`] when the
//! rank's launcher set it. That file is how `zero-run` names the cause rather than whichever
//! rank process happened to exit first.
//!
//! The store listens on a port the system picks (port 0) and that port travels to the other
//! ranks inside the rendezvous blob ([`establish()`]): nothing needs a second fixed port.
//!
//! Fingerprints are opaque bytes here (this crate knows nothing of tensors); the collective
//! layer encodes and decodes them.
//!
//! The files, from the bottom up: `first_cause` (the first cause and its file), `error` (why
//! the job or a call failed), `wire` (the messages and their framing), `board` (the store's
//! rules, without I/O), `server` (the store), `client` (a rank's side), `establish` (the
//! connection set up through the rendezvous).

mod board;
mod client;
mod error;
mod establish;
mod first_cause;
mod server;
mod wire;

/// A path named `name` in a new directory, for the control store's tests of cause files; the
/// directory is removed when the returned guard drops.
#[cfg(test)]
fn scratch(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("burn-zero-control-")
        .tempdir()
        .unwrap();
    let path = dir.path().join(name);
    (dir, path)
}

pub use client::ControlClient;
pub use error::{ControlError, ControlFailure};
pub use establish::establish;
pub use first_cause::{CAUSE_FILE_VAR, CauseFileError, FirstCause, cause_file_from_env};
pub use server::ControlServer;
