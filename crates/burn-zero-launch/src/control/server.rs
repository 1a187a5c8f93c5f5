//! The store, rank 0's side of the control connection ([`ControlServer`]): it admits each
//! rank, feeds what the ranks send to the [`Board`], records and announces the job's first
//! cause, and tells every rank the board's verdicts.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::board::{Board, Verdict};
use super::error::ControlError;
use super::wire::{HELLO_TIMEOUT, ToRank, ToStore, WRITE_TIMEOUT, send};
use crate::sync::lock;

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
    /// is known ([`FirstCause::write_to`](super::first_cause::FirstCause::write_to)), for the
    /// launcher that started the ranks to read.
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
