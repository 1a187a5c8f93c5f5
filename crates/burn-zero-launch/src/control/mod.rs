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
//! ranks inside the rendezvous blob ([`establish`]): nothing needs a second fixed port.
//!
//! Fingerprints are opaque bytes here (this crate knows nothing of tensors); the collective
//! layer encodes and decodes them.

mod board;
mod wire;

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use board::{Board, Verdict};
use wire::{ToRank, ToStore, send};

use crate::env::DistEnv;
use crate::rendezvous::{Rendezvous, RendezvousError, RendezvousListener};
use crate::sync::lock;

/// How long the store waits for a connected client to say who it is.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a write to one peer may block before that peer is given up.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long rank 0, done with its work, keeps the store open for ranks still finishing.
const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// How long a rank that reports its failure (or aborts) waits for the store to record it. A
/// round trip normally; bounded so that a store that is gone cannot hold a failing rank.
const REPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The environment variable naming the file where rank 0's store writes the job's first
/// cause ([`FirstCause::write_to`]). `zero-run` sets it for every rank it starts and reads the
/// file when a rank failed; without it the store writes nothing.
pub const CAUSE_FILE_VAR: &str = "BURN_ZERO_CAUSE_FILE";

/// The cause file named by [`CAUSE_FILE_VAR`] in this process's environment, if set.
pub fn cause_file_from_env() -> Option<PathBuf> {
    std::env::var_os(CAUSE_FILE_VAR)
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
}

/// The first rank of the job that failed on its own account, and why: the rank whose failure
/// caused the others to stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstCause {
    /// The rank.
    pub rank: usize,
    /// Its error or panic message, or the store's account of how it failed.
    pub reason: String,
}

impl fmt::Display for FirstCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.reason)
    }
}

/// Why a cause file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CauseFileError {
    /// The file exists but could not be read.
    #[error("cannot read the cause file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
    /// The file does not hold `rank N` on its first line.
    #[error("the cause file {path} does not start with a `rank N` line: {first_line:?}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What its first line holds.
        first_line: String,
    },
}

impl FirstCause {
    /// The file's text: `rank N` on the first line, the reason verbatim after it (so that a
    /// reason of several lines needs no escaping).
    pub fn to_text(&self) -> String {
        format!("rank {}\n{}", self.rank, self.reason)
    }

    /// Writes the cause to `path` whole: to a file beside it first, then renamed over it, so a
    /// reader never sees half of it.
    pub fn write_to(&self, path: &Path) -> io::Result<()> {
        let mut partial = OsString::from(path.as_os_str());
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        fs::write(&partial, self.to_text())?;
        fs::rename(&partial, path)
    }

    /// Reads a cause written by [`FirstCause::write_to`]; `Ok(None)` when there is no file
    /// (no rank failed, or no store of this job writes there).
    pub fn read_from(path: &Path) -> Result<Option<Self>, CauseFileError> {
        let text = match fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CauseFileError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        let (first, reason) = text.split_once('\n').unwrap_or((&text, ""));
        match first.strip_prefix("rank ").and_then(|n| n.parse().ok()) {
            Some(rank) => Ok(Some(FirstCause {
                rank,
                reason: reason.to_string(),
            })),
            None => Err(CauseFileError::Malformed {
                path: path.to_path_buf(),
                first_line: first.to_string(),
            }),
        }
    }
}

/// Why the job stopped, as every rank hears it from the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlFailure {
    /// A rank failed and said why.
    #[error("rank {rank} failed: {reason}")]
    Aborted {
        /// The failed rank.
        rank: usize,
        /// Its error or panic message.
        reason: String,
    },
    /// Two ranks were about to issue different collectives at the same position.
    #[error(
        "collective schedules diverged at collective {seq}: rank {rank} and rank {other_rank} \
         sent different fingerprints"
    )]
    Diverged {
        /// 1-based position in the ranks' schedules.
        seq: u64,
        /// The rank whose fingerprint disagreed with the first one seen.
        rank: usize,
        /// Its fingerprint.
        fingerprint: Vec<u8>,
        /// The rank that reached that position first.
        other_rank: usize,
        /// Its fingerprint.
        other_fingerprint: Vec<u8>,
    },
    /// A rank's control connection broke without a goodbye.
    #[error(
        "rank {rank} is gone: its control connection closed without a goodbye (the process \
         exited, panicked or was killed, or its network failed)"
    )]
    Lost {
        /// The rank whose connection broke.
        rank: usize,
    },
    /// This rank lost its connection to the store (rank 0).
    #[error(
        "the control connection to rank 0 at {endpoint} broke (rank 0 exited, panicked or was \
         killed, or the network failed)"
    )]
    StoreGone {
        /// The store's address.
        endpoint: String,
    },
}

/// Why setting up the control connection or a schedule check failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// The rendezvous that hands out the store's port failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// The job stopped.
    #[error(transparent)]
    Failed(#[from] ControlFailure),
    /// A rank finished its work (it will issue no more collectives) while this one waited
    /// for it in a later collective.
    #[error(
        "rank {peer} left the job after {issued} collective(s) while rank {rank} waited for it \
         in collective {seq}"
    )]
    PeerLeft {
        /// The rank that left.
        peer: usize,
        /// How many collectives it had issued.
        issued: u64,
        /// This rank.
        rank: usize,
        /// The collective this rank waited in.
        seq: u64,
    },
    /// Not every rank reached a collective within the timeout.
    #[error("rank {rank} waited {waited:?} for every rank to reach collective {seq}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The collective.
        seq: u64,
        /// How long it waited.
        waited: Duration,
    },
    /// Rank 0 closed the store in good order (its work is over).
    #[error("the control store is closed: rank 0 has finished")]
    Closed,
    /// The store could not be reached, or refused this rank.
    #[error("control connection to {endpoint}: {reason}")]
    Connection {
        /// The store's address.
        endpoint: String,
        /// What went wrong.
        reason: String,
    },
}

/// A hook run once, on the thread that learns of the failure, when the job fails.
type Hook = Box<dyn Fn(&ControlFailure) + Send + Sync>;

// ---------------------------------------------------------------------------------------------
// The store (rank 0)
// ---------------------------------------------------------------------------------------------

/// The store: rank 0 runs it for the whole job. One thread accepts connections, one per rank
/// reads that rank's messages; answers go out under one lock, so every rank hears the store's
/// verdicts in the same order.
pub struct ControlServer {
    port: u16,
    shared: Arc<ServerShared>,
    acceptor: Option<JoinHandle<()>>,
}

struct ServerShared {
    world_size: usize,
    /// Where to write the job's first cause once it is known.
    cause_file: Option<PathBuf>,
    state: Mutex<ServerState>,
    /// Signalled when a rank leaves.
    changed: Condvar,
    stopping: AtomicBool,
}

struct ServerState {
    board: Board,
    /// The write side of each rank's connection.
    peers: Vec<Option<TcpStream>>,
}

impl ControlServer {
    /// Starts the store for `world_size` ranks on a port the system picks, on every interface
    /// of `host`'s address family.
    pub fn start(host: &str, world_size: usize) -> Result<Self, ControlError> {
        Self::start_with_cause_file(host, world_size, None)
    }

    /// [`ControlServer::start`], writing the job's first cause to `cause_file` as soon as it
    /// is known ([`FirstCause::write_to`]), for the launcher that started the ranks to read.
    pub fn start_with_cause_file(
        host: &str,
        world_size: usize,
        cause_file: Option<PathBuf>,
    ) -> Result<Self, ControlError> {
        let ipv6 = host.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv6())
            || (host.contains(':') && !host.contains('.'));
        let any = if ipv6 {
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        };
        let address = SocketAddr::new(any, 0);
        let error = |e: io::Error| ControlError::Connection {
            endpoint: address.to_string(),
            reason: format!("could not listen: {e}"),
        };
        let listener = TcpListener::bind(address).map_err(error)?;
        listener.set_nonblocking(true).map_err(error)?;
        let port = listener.local_addr().map_err(error)?.port();
        let shared = Arc::new(ServerShared {
            world_size,
            cause_file,
            state: Mutex::new(ServerState {
                board: Board::new(world_size),
                peers: (0..world_size).map(|_| None).collect(),
            }),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let accepting = shared.clone();
        let acceptor = thread::Builder::new()
            .name("burn-zero-store".into())
            .spawn(move || accept_loop(&accepting, &listener))
            .map_err(|e| ControlError::Connection {
                endpoint: address.to_string(),
                reason: format!("could not start the store thread: {e}"),
            })?;
        tracing::debug!(port, world_size, "control store listening");
        Ok(ControlServer {
            port,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The port the store listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes the store once every rank has left, or after `grace`: ranks still connected
    /// then are told the store closed in good order.
    pub fn shutdown(mut self, grace: Duration) {
        self.stop(grace);
    }

    fn stop(&mut self, grace: Duration) {
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        let deadline = Instant::now() + grace;
        let mut state = lock(&self.shared.state);
        while !state.board.all_left() && state.board.failure().is_none() {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, remaining)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        self.shared.stopping.store(true, Ordering::SeqCst);
        let frame = ToRank::Shutdown.encode();
        for peer in state.peers.iter_mut().flatten() {
            let _ = send(peer, &frame);
            let _ = peer.shutdown(Shutdown::Both);
        }
        drop(state);
        let _ = acceptor.join();
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

fn accept_loop(shared: &Arc<ServerShared>, listener: &TcpListener) {
    while !shared.stopping.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, address)) => {
                let serving = shared.clone();
                let spawned = thread::Builder::new()
                    .name("burn-zero-store-peer".into())
                    .spawn(move || serve_peer(&serving, stream, address));
                if let Err(error) = spawned {
                    tracing::error!(%error, "control store: could not serve a connection");
                }
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(5));
            }
            Err(error) => {
                tracing::warn!(%error, "control store: accept failed");
                thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// Reads one rank's messages until its connection ends.
fn serve_peer(shared: &ServerShared, mut stream: TcpStream, address: SocketAddr) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let Some(rank) = admit(shared, &mut stream, address) else {
        return;
    };
    let _ = stream.set_read_timeout(None);
    tracing::debug!(rank, peer = %address, "control store: rank connected");
    loop {
        let message = ToStore::read(&mut stream);
        let mut state = lock(&shared.state);
        let had_cause = state.board.cause().is_some();
        let (verdict, reported) = match message {
            Ok(ToStore::Check { seq, fingerprint }) => {
                (state.board.check(rank, seq, fingerprint), false)
            }
            Ok(ToStore::Abort { reason }) => (state.board.abort(rank, reason), true),
            Ok(ToStore::Report { reason }) => (state.board.report(rank, reason), true),
            Ok(ToStore::Leave { issued }) => (state.board.leave(rank, issued), false),
            Ok(ToStore::Hello { .. }) | Err(_) => {
                let verdict = if shared.stopping.load(Ordering::SeqCst) {
                    Verdict::Wait
                } else {
                    state.board.lost(rank)
                };
                state.peers[rank] = None;
                announce_cause(shared, &mut state, had_cause, None);
                broadcast(&mut state, &verdict);
                shared.changed.notify_all();
                return;
            }
        };
        // The cause first: a rank told that the job failed may exit at once, and the cause
        // must be on disk by then.
        announce_cause(shared, &mut state, had_cause, reported.then_some(rank));
        broadcast(&mut state, &verdict);
        if matches!(verdict, Verdict::Left { .. } | Verdict::Failed(_)) {
            shared.changed.notify_all();
        }
    }
}

/// Reads a connection's hello and admits the rank it names, or tells it why not. Returns the
/// rank.
fn admit(shared: &ServerShared, stream: &mut TcpStream, address: SocketAddr) -> Option<usize> {
    let rank = match ToStore::read(stream) {
        Ok(ToStore::Hello { rank, world_size }) => {
            let problem = if world_size != shared.world_size {
                Some(format!(
                    "rank {rank} has WORLD_SIZE={world_size}, the store serves {}",
                    shared.world_size
                ))
            } else if rank >= world_size {
                Some(format!(
                    "rank {rank} is out of range for {world_size} rank(s)"
                ))
            } else if lock(&shared.state).peers[rank].is_some() {
                Some(format!("rank {rank} connected twice"))
            } else {
                None
            };
            if let Some(reason) = problem {
                let _ = send(stream, &ToRank::Rejected { reason }.encode());
                return None;
            }
            rank
        }
        Ok(_) | Err(_) => {
            tracing::warn!(peer = %address, "control store: dropped a connection that did not say hello");
            return None;
        }
    };
    let writer = stream.try_clone().ok()?;
    let mut state = lock(&shared.state);
    state.peers[rank] = Some(writer);
    // A rank that joins a job that already failed hears of it at once, and of its cause.
    let mut greeting = vec![ToRank::Welcome];
    greeting.extend(state.board.cause().cloned().map(ToRank::Cause));
    greeting.extend(state.board.failure().cloned().map(ToRank::Failed));
    if let Some(peer) = state.peers[rank].as_mut() {
        for message in greeting {
            let _ = send(peer, &message.encode());
        }
    }
    Some(rank)
}

/// After an event: when it gave the job its first cause, writes the cause file and tells every
/// rank; otherwise answers a rank that reported (`reporter`) with the cause already known, so
/// that its report is acknowledged either way.
fn announce_cause(
    shared: &ServerShared,
    state: &mut ServerState,
    had_cause: bool,
    reporter: Option<usize>,
) {
    let Some(cause) = state.board.cause().cloned() else {
        return;
    };
    let frame = ToRank::Cause(cause.clone()).encode();
    if had_cause {
        if let Some(peer) = reporter.and_then(|rank| state.peers[rank].as_mut()) {
            let _ = send(peer, &frame);
        }
        return;
    }
    tracing::error!(%cause, "control store: the first failure of the job");
    if let Some(path) = &shared.cause_file
        && let Err(error) = cause.write_to(path)
    {
        tracing::warn!(path = %path.display(), %error, "control store: could not write the cause file");
    }
    for peer in state.peers.iter_mut().flatten() {
        let _ = send(peer, &frame);
    }
}

/// Tells every connected rank the store's verdict.
fn broadcast(state: &mut ServerState, verdict: &Verdict) {
    let message = match verdict {
        Verdict::Wait => return,
        Verdict::Passed(seq) => ToRank::Passed { seq: *seq },
        Verdict::Failed(failure) => {
            tracing::error!(%failure, "control store: the job failed; telling every rank");
            ToRank::Failed(failure.clone())
        }
        Verdict::Left { rank, issued } => ToRank::Left {
            rank: *rank,
            issued: *issued,
        },
    };
    let frame = message.encode();
    for peer in state.peers.iter_mut().flatten() {
        // A peer that cannot be written to is noticed by its reader.
        let _ = send(peer, &frame);
    }
}

// ---------------------------------------------------------------------------------------------
// A rank's side
// ---------------------------------------------------------------------------------------------

/// One rank's connection to the store. Dropping it says goodbye (or, while the thread
/// panics, aborts the job); rank 0's also closes the store once the others are gone.
pub struct ControlClient {
    rank: usize,
    world_size: usize,
    endpoint: String,
    writer: Mutex<Option<TcpStream>>,
    shared: Arc<ClientShared>,
    reader: Option<JoinHandle<()>>,
    server: Option<ControlServer>,
    grace: Duration,
}

struct ClientShared {
    rank: usize,
    state: Mutex<ClientState>,
    changed: Condvar,
    hooks: Mutex<Vec<Hook>>,
}

#[derive(Default)]
struct ClientState {
    passed: BTreeSet<u64>,
    failure: Option<ControlFailure>,
    /// Collectives issued by each rank that left, by rank.
    departed: Vec<Option<u64>>,
    /// The job's first cause, as the store told it.
    cause: Option<FirstCause>,
    /// The store closed in good order.
    closed: bool,
    /// The connection to the store ended (closed in good order or broken): nothing more
    /// will arrive.
    disconnected: bool,
    /// This rank said goodbye.
    left: bool,
}

impl ClientShared {
    /// Records the job's failure (the first one counts) and runs the hooks once.
    fn fail(&self, failure: ControlFailure) {
        {
            let mut state = lock(&self.state);
            if state.failure.is_some() {
                return;
            }
            state.failure = Some(failure.clone());
            self.changed.notify_all();
        }
        tracing::error!(rank = self.rank, %failure, "the job failed");
        for hook in lock(&self.hooks).iter() {
            hook(&failure);
        }
    }
}

impl ControlClient {
    /// A client for a job of one rank: checks pass at once, nothing travels.
    pub fn solo() -> Self {
        ControlClient {
            rank: 0,
            world_size: 1,
            endpoint: "(none: a single rank)".into(),
            writer: Mutex::new(None),
            shared: Arc::new(ClientShared {
                rank: 0,
                state: Mutex::new(ClientState {
                    departed: vec![None],
                    ..ClientState::default()
                }),
                changed: Condvar::new(),
                hooks: Mutex::new(Vec::new()),
            }),
            reader: None,
            server: None,
            grace: DEFAULT_GRACE,
        }
    }

    /// Connects rank `rank` of `world_size` to the store at `host:port`, retrying until
    /// `timeout` while the store is not up yet.
    pub fn connect(
        host: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self, ControlError> {
        let endpoint = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let connection = |reason: String| ControlError::Connection {
            endpoint: endpoint.clone(),
            reason,
        };
        let mut stream = crate::rendezvous::connect_with_retry(host, port, timeout)
            .map_err(|e| connection(format!("could not connect within {timeout:?}: {e}")))?;
        stream
            .set_write_timeout(Some(WRITE_TIMEOUT))
            .and_then(|()| stream.set_read_timeout(Some(HELLO_TIMEOUT)))
            .and_then(|()| send(&mut stream, &ToStore::Hello { rank, world_size }.encode()))
            .map_err(|e| connection(e.to_string()))?;
        match ToRank::read(&mut stream) {
            Ok(ToRank::Welcome) => {}
            Ok(ToRank::Rejected { reason }) => {
                return Err(connection(format!(
                    "the store refused rank {rank}: {reason}"
                )));
            }
            Ok(other) => return Err(connection(format!("unexpected answer {other:?}"))),
            Err(e) => return Err(connection(format!("no welcome: {e}"))),
        }
        stream
            .set_read_timeout(None)
            .map_err(|e| connection(e.to_string()))?;
        let mut reading = stream.try_clone().map_err(|e| connection(e.to_string()))?;
        let shared = Arc::new(ClientShared {
            rank,
            state: Mutex::new(ClientState {
                departed: vec![None; world_size],
                ..ClientState::default()
            }),
            changed: Condvar::new(),
            hooks: Mutex::new(Vec::new()),
        });
        let listening = shared.clone();
        let store = endpoint.clone();
        let reader = thread::Builder::new()
            .name(format!("burn-zero-control-{rank}"))
            .spawn(move || read_loop(&listening, &mut reading, store))
            .map_err(|e| connection(format!("could not start the reader thread: {e}")))?;
        tracing::debug!(rank, %endpoint, "control connection open");
        Ok(ControlClient {
            rank,
            world_size,
            endpoint,
            writer: Mutex::new(Some(stream)),
            shared,
            reader: Some(reader),
            server: None,
            grace: DEFAULT_GRACE,
        })
    }

    /// Rank 0's connection to a store it starts itself, for a job whose ranks already reach
    /// one another some other way than the TCP rendezvous (an MPI world, where rank 0
    /// broadcasts the store's port): the store listens on every interface, on a port the
    /// system picks ([`ControlClient::store_port`]), writes the job's first cause to the file
    /// [`CAUSE_FILE_VAR`] names when the environment sets it, and closes when this client is
    /// dropped (after the others left, or a grace period).
    pub fn serve(world_size: usize, timeout: Duration) -> Result<Self, ControlError> {
        if world_size == 1 {
            return Ok(ControlClient::solo());
        }
        let server =
            ControlServer::start_with_cause_file("127.0.0.1", world_size, cause_file_from_env())?;
        let mut client =
            ControlClient::connect("127.0.0.1", server.port(), 0, world_size, timeout)?;
        client.server = Some(server);
        Ok(client)
    }

    /// The port of the store this client started ([`ControlClient::serve`], or rank 0's
    /// connection made by [`establish`]); `None` for the other ranks.
    pub fn store_port(&self) -> Option<u16> {
        self.server.as_ref().map(ControlServer::port)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks of the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// `host:port` of the store.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sets how long rank 0, dropping its client, keeps the store open for the others.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The failure that stopped the job, if it has stopped.
    pub fn failure(&self) -> Option<ControlFailure> {
        lock(&self.shared.state).failure.clone()
    }

    /// Ranks that left in good order, with the number of collectives each had issued.
    pub fn departed(&self) -> Vec<(usize, u64)> {
        lock(&self.shared.state)
            .departed
            .iter()
            .enumerate()
            .filter_map(|(rank, issued)| issued.map(|issued| (rank, issued)))
            .collect()
    }

    /// Runs `hook` when the job fails (at once if it already has). Hooks run on the thread
    /// that learns of the failure and must not block for long: abort communicators, set
    /// flags.
    pub fn on_failure(&self, hook: impl Fn(&ControlFailure) + Send + Sync + 'static) {
        let failure = {
            let mut hooks = lock(&self.shared.hooks);
            let failure = lock(&self.shared.state).failure.clone();
            if failure.is_none() {
                hooks.push(Box::new(hook));
                return;
            }
            failure
        };
        if let Some(failure) = failure {
            hook(&failure);
        }
    }

    /// Stops the job: every rank (this one included) fails with
    /// [`ControlFailure::Aborted`] carrying `reason`. Counts as a report
    /// ([`ControlClient::report`]): returns once the store has recorded it (or after a few
    /// seconds without an answer), so a rank may exit right after.
    pub fn abort(&self, reason: &str) {
        let reason = reason.to_string();
        let sent = self.tell_store(&ToStore::Abort {
            reason: reason.clone(),
        });
        self.shared.fail(ControlFailure::Aborted {
            rank: self.rank,
            reason: reason.clone(),
        });
        self.acknowledged(sent, reason);
    }

    /// Records that this rank failed on its own account, with `reason`, without stopping the
    /// job: the rank is about to tell the others through a collective (an agreement among the
    /// ranks), and they will stop because of it. The store keeps the job's first report (or
    /// abort) as its cause ([`ControlClient::cause`]), so that the job's failure is reported as
    /// this rank's rather than as whichever rank stopped first.
    ///
    /// Returns once the store has recorded it (a round trip), or after a few seconds without
    /// an answer: report before the collective, so that no rank can learn of the failure
    /// before the store has.
    pub fn report(&self, reason: &str) {
        let sent = self.tell_store(&ToStore::Report {
            reason: reason.to_string(),
        });
        self.acknowledged(sent, reason.to_string());
    }

    /// The job's first cause of failure as the store recorded it: the first rank that reported
    /// a failure or aborted (or, when none did, whose connection broke or whose schedule
    /// diverged), with its reason. `None` while no rank has failed, or before the store's word
    /// has arrived.
    pub fn cause(&self) -> Option<FirstCause> {
        lock(&self.shared.state).cause.clone()
    }

    /// Sends `message` to the store; whether it was written.
    fn tell_store(&self, message: &ToStore) -> bool {
        match lock(&self.writer).as_mut() {
            Some(stream) => send(stream, &message.encode()).is_ok(),
            None => false,
        }
    }

    /// Waits until the store has answered a report or abort with the job's cause. A job of
    /// one rank has no store: its own report is the cause.
    fn acknowledged(&self, sent: bool, reason: String) {
        let mut state = lock(&self.shared.state);
        if self.world_size == 1 {
            state.cause.get_or_insert(FirstCause {
                rank: self.rank,
                reason,
            });
            return;
        }
        // The reader thread delivers the answer: a failure hook that aborts must not wait for
        // it.
        let on_reader = self
            .reader
            .as_ref()
            .is_some_and(|reader| reader.thread().id() == thread::current().id());
        if !sent || on_reader {
            return;
        }
        let deadline = Instant::now() + REPORT_TIMEOUT;
        while state.cause.is_none() && !state.disconnected {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                tracing::warn!(
                    rank = self.rank,
                    store = %self.endpoint,
                    "the control store did not acknowledge this rank's failure report in {REPORT_TIMEOUT:?}"
                );
                return;
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, remaining)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Sends this rank's fingerprint of collective `seq` (1-based, counting every collective
    /// of the rank) and waits until every rank has sent the same for `seq`.
    pub fn check(
        &self,
        seq: u64,
        fingerprint: &[u8],
        timeout: Duration,
    ) -> Result<(), ControlError> {
        if self.world_size == 1 {
            return Ok(());
        }
        if let Some(failure) = self.failure() {
            return Err(failure.into());
        }
        let started = Instant::now();
        {
            let mut writer = lock(&self.writer);
            let Some(stream) = writer.as_mut() else {
                return Err(ControlError::Closed);
            };
            let frame = ToStore::Check {
                seq,
                fingerprint: fingerprint.to_vec(),
            }
            .encode();
            if let Err(error) = send(stream, &frame) {
                drop(writer);
                let failure = ControlFailure::StoreGone {
                    endpoint: format!("{} ({error})", self.endpoint),
                };
                self.shared.fail(failure.clone());
                return Err(failure.into());
            }
        }
        let mut state = lock(&self.shared.state);
        loop {
            if state.passed.remove(&seq) {
                return Ok(());
            }
            if let Some(failure) = &state.failure {
                return Err(failure.clone().into());
            }
            if let Some((peer, issued)) = state
                .departed
                .iter()
                .enumerate()
                .find_map(|(peer, issued)| issued.filter(|&n| n < seq).map(|n| (peer, n)))
            {
                return Err(ControlError::PeerLeft {
                    peer,
                    issued,
                    rank: self.rank,
                    seq,
                });
            }
            if state.closed {
                return Err(ControlError::Closed);
            }
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(ControlError::Timeout {
                    rank: self.rank,
                    seq,
                    waited,
                });
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, timeout - waited)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Says goodbye: this rank issued `issued` collectives and will issue no more. Ranks that
    /// wait for it in a later collective fail with [`ControlError::PeerLeft`].
    pub fn leave(&self, issued: u64) {
        let mut state = lock(&self.shared.state);
        if state.left {
            return;
        }
        state.left = true;
        drop(state);
        if let Some(stream) = lock(&self.writer).as_mut() {
            let _ = send(stream, &ToStore::Leave { issued }.encode());
        }
    }
}

impl Drop for ControlClient {
    fn drop(&mut self) {
        if thread::panicking() {
            self.abort(&format!(
                "rank {} panicked (see its output for the message)",
                self.rank
            ));
        } else {
            self.leave(u64::MAX);
        }
        if let Some(server) = self.server.take() {
            server.shutdown(self.grace);
        }
        if let Some(stream) = lock(&self.writer).take() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

/// The client's reader: turns the store's messages into state and hooks.
fn read_loop(shared: &ClientShared, stream: &mut TcpStream, endpoint: String) {
    loop {
        match ToRank::read(stream) {
            Ok(ToRank::Passed { seq }) => {
                lock(&shared.state).passed.insert(seq);
                shared.changed.notify_all();
            }
            Ok(ToRank::Failed(failure)) => shared.fail(failure),
            Ok(ToRank::Left { rank, issued }) => {
                if let Some(slot) = lock(&shared.state).departed.get_mut(rank) {
                    *slot = Some(issued);
                }
                shared.changed.notify_all();
            }
            Ok(ToRank::Cause(cause)) => {
                lock(&shared.state).cause.get_or_insert(cause);
                shared.changed.notify_all();
            }
            Ok(ToRank::Shutdown) => {
                let mut state = lock(&shared.state);
                state.closed = true;
                state.disconnected = true;
                shared.changed.notify_all();
                return;
            }
            Ok(ToRank::Welcome | ToRank::Rejected { .. }) => {}
            Err(_) => {
                let left = {
                    let mut state = lock(&shared.state);
                    state.disconnected = true;
                    state.left
                };
                if !left {
                    shared.fail(ControlFailure::StoreGone { endpoint });
                }
                shared.changed.notify_all();
                return;
            }
        }
    }
}

/// Sets up a rank's control connection and shares `make_blob`'s bytes (rank 0's) with every
/// rank through the rendezvous of `env`: rank 0 starts the store on a port the system picks
/// and sends that port along with the blob; every rank then connects to the store. Returns
/// the blob and the connection. A job of one rank needs no network.
///
/// Rank 0's store writes the job's first cause to the file named by [`CAUSE_FILE_VAR`] when
/// this process's environment sets it (`zero-run` does).
///
/// `listener` is rank 0's rendezvous socket when it was bound beforehand (to learn a port
/// the system picked); otherwise rank 0 binds `MASTER_PORT`.
pub fn establish(
    env: &DistEnv,
    timeout: Duration,
    listener: Option<RendezvousListener>,
    make_blob: impl FnOnce() -> Vec<u8>,
) -> Result<(Vec<u8>, ControlClient), ControlError> {
    if env.world_size == 1 {
        return Ok((make_blob(), ControlClient::solo()));
    }
    let rendezvous = Rendezvous::new(env).with_timeout(timeout);
    if env.rank == 0 {
        let server = ControlServer::start_with_cause_file(
            &env.master_addr,
            env.world_size,
            cause_file_from_env(),
        )?;
        let blob = make_blob();
        let mut shared = blob.clone();
        shared.extend_from_slice(&server.port().to_be_bytes());
        match listener {
            Some(listener) => rendezvous.serve_on(listener, &shared)?,
            None => rendezvous.serve(&shared)?,
        }
        let mut client =
            ControlClient::connect(&env.master_addr, server.port(), 0, env.world_size, timeout)?;
        client.server = Some(server);
        Ok((blob, client))
    } else {
        let mut shared = rendezvous.fetch()?;
        if shared.len() < 2 {
            return Err(ControlError::Connection {
                endpoint: env.master_endpoint(),
                reason: "rank 0 sent no store port".into(),
            });
        }
        let port_bytes = shared.split_off(shared.len() - 2);
        let port = u16::from_be_bytes([port_bytes[0], port_bytes[1]]);
        let client =
            ControlClient::connect(&env.master_addr, port, env.rank, env.world_size, timeout)?;
        Ok((shared, client))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(world_size: usize) -> (ControlServer, Vec<ControlClient>) {
        let server = ControlServer::start("127.0.0.1", world_size).unwrap();
        let clients = (0..world_size)
            .map(|rank| {
                ControlClient::connect(
                    "127.0.0.1",
                    server.port(),
                    rank,
                    world_size,
                    Duration::from_secs(5),
                )
                .unwrap()
            })
            .collect();
        (server, clients)
    }

    #[test]
    fn checks_pass_when_every_rank_agrees() {
        let (_server, clients) = job(3);
        thread::scope(|scope| {
            for client in &clients {
                scope.spawn(move || {
                    for seq in 1..=50u64 {
                        client
                            .check(seq, &seq.to_be_bytes(), Duration::from_secs(5))
                            .unwrap();
                    }
                });
            }
        });
    }

    #[test]
    fn a_diverged_schedule_fails_every_rank_with_both_fingerprints() {
        let (_server, clients) = job(2);
        let results: Vec<_> = thread::scope(|scope| {
            let handles: Vec<_> = clients
                .iter()
                .map(|client| {
                    scope.spawn(move || {
                        client.check(1, b"same", Duration::from_secs(5))?;
                        let mine = format!("rank {}", client.rank());
                        client.check(2, mine.as_bytes(), Duration::from_secs(5))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for result in results {
            match result {
                Err(ControlError::Failed(ControlFailure::Diverged {
                    seq: 2,
                    rank,
                    fingerprint,
                    other_rank,
                    other_fingerprint,
                })) => {
                    assert_ne!(rank, other_rank);
                    assert_eq!(fingerprint, format!("rank {rank}").into_bytes());
                    assert_eq!(other_fingerprint, format!("rank {other_rank}").into_bytes());
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn an_abort_reaches_every_rank_and_runs_its_hooks() {
        let (_server, clients) = job(3);
        let fired = Arc::new(Mutex::new(Vec::new()));
        for client in &clients {
            let fired = fired.clone();
            let rank = client.rank();
            client.on_failure(move |failure| lock(&fired).push((rank, failure.clone())));
        }
        let started = Instant::now();
        let waiting = thread::scope(|scope| {
            let waiter = scope.spawn(|| clients[2].check(1, b"x", Duration::from_secs(30)));
            thread::sleep(Duration::from_millis(50));
            clients[1].abort("out of memory");
            waiter.join().unwrap()
        });
        let expected = ControlFailure::Aborted {
            rank: 1,
            reason: "out of memory".into(),
        };
        assert_eq!(waiting, Err(ControlError::Failed(expected.clone())));
        assert!(started.elapsed() < Duration::from_secs(5));
        let deadline = Instant::now() + Duration::from_secs(5);
        while lock(&fired).len() < 3 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        let mut fired = lock(&fired).clone();
        fired.sort_by_key(|(rank, _)| *rank);
        assert_eq!(
            fired,
            (0..3)
                .map(|rank| (rank, expected.clone()))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_rank_that_left_early_is_named_by_the_ranks_waiting_for_it() {
        let (_server, mut clients) = job(2);
        let leaver = clients.pop().unwrap();
        let stayer = clients.pop().unwrap();
        thread::scope(|scope| {
            scope.spawn(|| leaver.check(1, b"a", Duration::from_secs(5)).unwrap());
            stayer.check(1, b"a", Duration::from_secs(5)).unwrap();
        });
        leaver.leave(1);
        let error = stayer.check(2, b"b", Duration::from_secs(5)).unwrap_err();
        assert_eq!(
            error,
            ControlError::PeerLeft {
                peer: 1,
                issued: 1,
                rank: 0,
                seq: 2
            }
        );
        // Leaving in good order is no failure.
        assert_eq!(stayer.failure(), None);
    }

    #[test]
    fn a_dropped_connection_without_goodbye_fails_the_job() {
        let (_server, mut clients) = job(2);
        let gone = clients.pop().unwrap();
        // Simulate a killed process: the socket closes, no goodbye is sent.
        if let Some(stream) = lock(&gone.writer).take() {
            stream.shutdown(Shutdown::Both).unwrap();
        }
        lock(&gone.shared.state).left = true; // Keep its own drop quiet.
        let error = clients[0]
            .check(1, b"a", Duration::from_secs(5))
            .unwrap_err();
        assert_eq!(
            error,
            ControlError::Failed(ControlFailure::Lost { rank: 1 })
        );
    }

    #[test]
    fn a_stranger_is_refused() {
        let server = ControlServer::start("127.0.0.1", 2).unwrap();
        let error = match ControlClient::connect(
            "127.0.0.1",
            server.port(),
            0,
            3,
            Duration::from_secs(5),
        ) {
            Err(error) => error,
            Ok(_) => panic!("a client with the wrong world size was let in"),
        };
        assert!(error.to_string().contains("WORLD_SIZE=3"), "{error}");
    }

    /// A scratch file path of this test process.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("burn-zero-control-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let _ = fs::remove_file(&path);
        path
    }

    #[test]
    fn the_first_report_is_every_ranks_cause_and_the_file_holds_it() {
        let file = scratch("report");
        let server =
            ControlServer::start_with_cause_file("127.0.0.1", 3, Some(file.clone())).unwrap();
        let clients: Vec<_> = (0..3)
            .map(|rank| {
                ControlClient::connect("127.0.0.1", server.port(), rank, 3, Duration::from_secs(5))
                    .unwrap()
            })
            .collect();
        assert_eq!(FirstCause::read_from(&file).unwrap(), None);
        // Acknowledged before `report` returns: on disk and known to the reporter at once.
        clients[2].report("disk full\nwhile saving step 7");
        let expected = FirstCause {
            rank: 2,
            reason: "disk full\nwhile saving step 7".into(),
        };
        assert_eq!(
            FirstCause::read_from(&file).unwrap(),
            Some(expected.clone())
        );
        assert_eq!(clients[2].cause(), Some(expected.clone()));
        // A report does not stop the job; later reports and aborts are consequences.
        assert_eq!(clients[2].failure(), None);
        clients[0].report("save failed on another rank");
        clients[1].abort("stopping");
        assert_eq!(
            FirstCause::read_from(&file).unwrap(),
            Some(expected.clone())
        );
        for client in &clients {
            // The abort arrives after the cause: once a rank heard of it, it knows both.
            let deadline = Instant::now() + Duration::from_secs(5);
            while client.failure().is_none() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            assert!(matches!(
                client.failure(),
                Some(ControlFailure::Aborted { rank: 1, .. })
            ));
            assert_eq!(
                client.cause(),
                Some(expected.clone()),
                "rank {}",
                client.rank()
            );
        }
    }

    #[test]
    fn a_rank_lost_without_a_report_is_the_cause() {
        let file = scratch("lost");
        let server =
            ControlServer::start_with_cause_file("127.0.0.1", 2, Some(file.clone())).unwrap();
        let stayer =
            ControlClient::connect("127.0.0.1", server.port(), 0, 2, Duration::from_secs(5))
                .unwrap();
        let gone = ControlClient::connect("127.0.0.1", server.port(), 1, 2, Duration::from_secs(5))
            .unwrap();
        if let Some(stream) = lock(&gone.writer).take() {
            stream.shutdown(Shutdown::Both).unwrap();
        }
        lock(&gone.shared.state).left = true;
        let error = stayer.check(1, b"a", Duration::from_secs(5)).unwrap_err();
        assert_eq!(
            error,
            ControlError::Failed(ControlFailure::Lost { rank: 1 })
        );
        let cause = FirstCause::read_from(&file).unwrap().unwrap();
        assert_eq!(cause.rank, 1);
        assert!(
            cause.reason.contains("without a goodbye"),
            "{}",
            cause.reason
        );
    }

    #[test]
    fn a_cause_file_reads_back_and_a_foreign_one_is_named() {
        let file = scratch("text");
        let cause = FirstCause {
            rank: 12,
            reason: "line one\nline two\n".into(),
        };
        cause.write_to(&file).unwrap();
        assert_eq!(FirstCause::read_from(&file).unwrap(), Some(cause));
        fs::write(&file, "hello\nworld").unwrap();
        let error = FirstCause::read_from(&file).unwrap_err().to_string();
        assert!(
            error.contains("does not start with a `rank N` line: \"hello\""),
            "{error}"
        );
    }

    #[test]
    fn a_single_rank_is_its_own_cause() {
        let solo = ControlClient::solo();
        assert_eq!(solo.cause(), None);
        solo.report("bad input");
        assert_eq!(
            solo.cause(),
            Some(FirstCause {
                rank: 0,
                reason: "bad input".into()
            })
        );
    }
}
