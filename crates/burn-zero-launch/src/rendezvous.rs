//! TCP rendezvous: rank 0 hands one opaque blob (the NCCL unique id) to every other rank.
//!
//! Rank 0 listens on `MASTER_PORT`; every other rank connects to `MASTER_ADDR:MASTER_PORT`,
//! retrying until the master is up or the timeout passes (also past a peer on that port that is
//! not the master), and says who it is. Once every rank
//! has joined, rank 0 answers each with the blob. A rank with another world size, a rank that
//! joins twice and a rank out of range fail the rendezvous on every rank that is connected,
//! with the reason; ranks that never join become a [`RendezvousError::Timeout`] naming them.
//!
//! This is the only network traffic of burn-zero outside NCCL: the collectives themselves never
//! go through it.
//!
//! Wire format (big-endian): a joining rank sends `MAGIC, rank: u32, world_size: u32`; the
//! master answers `MAGIC, status: u8 (0 accepted, 1 rejected), length: u32, bytes` where the
//! bytes are the blob or, when rejected, the reason as UTF-8.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use crate::env::DistEnv;

/// Identifies the protocol and its version on the wire.
const MAGIC: [u8; 4] = *b"BZR1";
const ACCEPTED: u8 = 0;
const REJECTED: u8 = 1;
/// Upper bound on a blob or a reason, so a stray client cannot make a rank allocate gigabytes.
const MAX_MESSAGE: usize = 1 << 20;
/// The longest a rank waits between two connection attempts.
const MAX_RETRY_INTERVAL: Duration = Duration::from_secs(1);
/// How long a rank waits before connecting again after meeting a peer that is not the master.
const STRANGER_RETRY_INTERVAL: Duration = Duration::from_millis(100);
/// How long the master waits for a connected client to say who it is.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the rendezvous failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// A rank could not open a connection to the master before the timeout.
    #[error(
        "rank {rank} could not reach the master at {endpoint} within {waited:?} (last error: \
         {last_error}); is rank 0 running, and do MASTER_ADDR and MASTER_PORT point at it?"
    )]
    Unreachable {
        /// The rank that gave up.
        rank: usize,
        /// `host:port` it tried.
        endpoint: String,
        /// How long it tried.
        waited: Duration,
        /// The error of its last attempt.
        last_error: String,
    },
    /// The master waited the whole timeout and some ranks never joined.
    #[error(
        "rendezvous at {endpoint} timed out after {waited:?}: rank(s) {missing:?} never joined"
    )]
    Timeout {
        /// The master's endpoint.
        endpoint: String,
        /// How long the master waited.
        waited: Duration,
        /// Ranks that never joined.
        missing: Vec<usize>,
    },
    /// A rank reached the master but got no answer before its timeout.
    #[error(
        "rank {rank} joined the rendezvous at {endpoint} but got no answer within {waited:?} \
         (other ranks may be missing)"
    )]
    NoAnswer {
        /// The waiting rank.
        rank: usize,
        /// The master's endpoint.
        endpoint: String,
        /// How long it waited.
        waited: Duration,
    },
    /// Two ranks disagree on the world size.
    #[error(
        "world size mismatch: rank {rank} was started with WORLD_SIZE={theirs}, rank 0 with \
         WORLD_SIZE={ours}"
    )]
    WorldSizeMismatch {
        /// The joining rank.
        rank: usize,
        /// Its world size.
        theirs: usize,
        /// Rank 0's world size.
        ours: usize,
    },
    /// Two processes claim the same rank.
    #[error("rank {rank} joined the rendezvous twice: two processes were started with RANK={rank}")]
    DuplicateRank {
        /// The rank claimed twice.
        rank: usize,
    },
    /// A rank outside `0..world_size`.
    #[error("rank {rank} is out of range for a world of {world_size} rank(s)")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// The master turned this rank away; `reason` is the master's error.
    #[error("rank 0 rejected rank {rank}: {reason}")]
    Rejected {
        /// The rejected rank.
        rank: usize,
        /// Why, as the master put it.
        reason: String,
    },
    /// Rank 0 could not listen on the port.
    #[error("rank 0 could not listen on {endpoint}: {reason} (is MASTER_PORT free?)")]
    Bind {
        /// The address it tried.
        endpoint: String,
        /// The system's error.
        reason: String,
    },
    /// The other side broke the protocol or the connection.
    #[error("rendezvous connection with {peer} failed: {reason}")]
    Connection {
        /// The other side.
        peer: String,
        /// What went wrong.
        reason: String,
    },
}

/// Rank 0's rendezvous socket, bound ahead of [`Rendezvous::serve_on`].
#[derive(Debug)]
pub struct RendezvousListener {
    listener: TcpListener,
}

impl RendezvousListener {
    /// The port it listens on (the one the system picked, for port 0).
    pub fn port(&self) -> Result<u16, RendezvousError> {
        self.listener
            .local_addr()
            .map(|address| address.port())
            .map_err(|error| RendezvousError::Bind {
                endpoint: "the rendezvous socket".into(),
                reason: error.to_string(),
            })
    }
}

/// One rank's side of the rendezvous. Build it from the launcher's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    host: String,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

impl Rendezvous {
    /// The default timeout: long enough for every rank of a large job to start.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

    /// The rendezvous described by `env`, with the default timeout.
    pub fn new(env: &DistEnv) -> Self {
        Rendezvous {
            host: env.master_addr.clone(),
            port: env.master_port,
            rank: env.rank,
            world_size: env.world_size,
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    /// Sets how long rank 0 waits for every rank, and every other rank for rank 0.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks that take part.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `host:port` of the master.
    pub fn endpoint(&self) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Rank 0 calls `make` and hands its blob to every rank; every other rank receives it.
    /// Every rank returns the same bytes.
    pub fn share(&self, make: impl FnOnce() -> Vec<u8>) -> Result<Vec<u8>, RendezvousError> {
        self.check_rank()?;
        if self.rank == 0 {
            let blob = make();
            self.serve(&blob)?;
            Ok(blob)
        } else {
            self.fetch()
        }
    }

    /// Rank 0's side: waits until every other rank has joined, then sends each `blob`.
    pub fn serve(&self, blob: &[u8]) -> Result<(), RendezvousError> {
        self.check_rank()?;
        if self.world_size == 1 {
            return Ok(());
        }
        let listener = self.bind()?;
        self.serve_on(listener, blob)
    }

    /// Rank 0 binds its socket now, before serving: with port 0 in the rendezvous, the
    /// system picks a free port, which [`RendezvousListener::port`] tells (for the other
    /// ranks' `MASTER_PORT`).
    pub fn bind(&self) -> Result<RendezvousListener, RendezvousError> {
        self.check_rank()?;
        Ok(RendezvousListener {
            listener: self.listen()?,
        })
    }

    /// [`Rendezvous::serve`] on a socket bound beforehand with [`Rendezvous::bind`].
    pub fn serve_on(
        &self,
        listener: RendezvousListener,
        blob: &[u8],
    ) -> Result<(), RendezvousError> {
        self.check_rank()?;
        if self.world_size == 1 {
            return Ok(());
        }
        let listener = listener.listener;
        check_blob_size(blob)?;
        let started = Instant::now();
        let deadline = started + self.timeout;
        tracing::debug!(endpoint = %self.endpoint(), world_size = self.world_size, "rendezvous: waiting for ranks");
        let mut peers = self.gather(&listener, started, deadline)?;
        hand_out(&mut peers, blob)?;
        tracing::debug!(elapsed = ?started.elapsed(), "rendezvous: every rank has the blob");
        Ok(())
    }

    /// Rank 0 waits until every other rank has joined, and returns their connections:
    /// element `r` is rank `r`'s (`None` for rank 0). A connection that does not say hello is
    /// passed over; a rank that does not fit the job, or the deadline, ends the wait with an
    /// error that every rank already waiting is told too, so that none of them waits for a
    /// blob that will not come.
    fn gather(
        &self,
        listener: &TcpListener,
        started: Instant,
        deadline: Instant,
    ) -> Result<Vec<Option<TcpStream>>, RendezvousError> {
        // peers[r] is the connection of rank r (None for rank 0 and ranks not yet joined).
        let mut peers: Vec<Option<TcpStream>> = (0..self.world_size).map(|_| None).collect();
        let mut joined = 1;
        while joined < self.world_size {
            let now = Instant::now();
            if now >= deadline {
                let error = self.missing_ranks(&peers, started);
                reject_all(&mut peers, &error);
                return Err(error);
            }
            let Some((mut stream, address)) = accept_waiting(listener) else {
                continue;
            };
            let hello_deadline = (now + HELLO_TIMEOUT).min(deadline);
            let (rank, world_size) = match read_hello(&mut stream, hello_deadline) {
                Ok(hello) => hello,
                Err(error) => {
                    // Not one of our ranks (or one that died mid-way): ignore the connection.
                    tracing::warn!(peer = %address, %error, "rendezvous: dropped a connection that did not say hello");
                    continue;
                }
            };
            if let Some(error) = self.misfit(rank, world_size, &peers) {
                // A misconfigured job: tell this client and every rank already waiting.
                let _ = send_reply(&mut stream, REJECTED, error.to_string().as_bytes());
                reject_all(&mut peers, &error);
                return Err(error);
            }
            tracing::debug!(rank, peer = %address, "rendezvous: rank joined");
            peers[rank] = Some(stream);
            joined += 1;
        }
        Ok(peers)
    }

    /// The timeout error of a wait begun at `started`, naming the ranks that have not joined
    /// (those without a connection in `peers`).
    fn missing_ranks(&self, peers: &[Option<TcpStream>], started: Instant) -> RendezvousError {
        let missing: Vec<usize> = (1..self.world_size)
            .filter(|&r| peers[r].is_none())
            .collect();
        RendezvousError::Timeout {
            endpoint: self.endpoint(),
            waited: started.elapsed(),
            missing,
        }
    }

    /// Why a joining rank that said hello with `rank` and `world_size` does not fit this job:
    /// another world size, a rank out of range, or a rank that has already joined (or is 0,
    /// this rank's own). `None` when it fits.
    fn misfit(
        &self,
        rank: usize,
        world_size: usize,
        peers: &[Option<TcpStream>],
    ) -> Option<RendezvousError> {
        if world_size != self.world_size {
            Some(RendezvousError::WorldSizeMismatch {
                rank,
                theirs: world_size,
                ours: self.world_size,
            })
        } else if rank >= self.world_size {
            Some(RendezvousError::RankOutOfRange {
                rank,
                world_size: self.world_size,
            })
        } else if rank == 0 || peers[rank].is_some() {
            Some(RendezvousError::DuplicateRank { rank })
        } else {
            None
        }
    }

    /// The side of every rank but 0: joins rank 0 and returns its blob.
    ///
    /// Something other than the master may hold the port for a moment before rank 0 binds it
    /// (a program that just released it, another job's socket drawn from the same range). A
    /// peer that closes the connection without answering, or answers in another protocol, is
    /// not the master: the rank connects again until its timeout, as it does while nobody
    /// listens. Only the master's own answer, or its silence past the timeout, ends the wait.
    pub fn fetch(&self) -> Result<Vec<u8>, RendezvousError> {
        self.check_rank()?;
        if self.rank == 0 {
            return Err(RendezvousError::DuplicateRank { rank: 0 });
        }
        let started = Instant::now();
        let deadline = started + self.timeout;
        loop {
            let mut stream = self.connect(started, deadline)?;
            let stranger = match self.join(&mut stream, started, deadline) {
                Joined::Answer(result) => return result,
                Joined::NotTheMaster(stranger) => stranger,
            };
            tracing::debug!(rank = self.rank, %stranger, "rendezvous: not the master, trying again");
            thread::sleep(
                STRANGER_RETRY_INTERVAL.min(deadline.saturating_duration_since(Instant::now())),
            );
            // A last attempt needs time for an answer: with less than one interval left, an
            // attempt could only end in a timeout that blames the wrong peer.
            if deadline.saturating_duration_since(Instant::now()) < STRANGER_RETRY_INTERVAL {
                return Err(RendezvousError::Connection {
                    peer: format!("rank 0 at {}", self.endpoint()),
                    reason: format!(
                        "{stranger}, and no rendezvous master answered there within {:?}",
                        self.timeout
                    ),
                });
            }
        }
    }

    /// Says who this rank is on `stream` and reads the answer.
    fn join(&self, stream: &mut TcpStream, started: Instant, deadline: Instant) -> Joined {
        let connection = |error: io::Error| RendezvousError::Connection {
            peer: format!("rank 0 at {}", self.endpoint()),
            reason: error.to_string(),
        };
        let mut hello = Vec::with_capacity(12);
        hello.extend_from_slice(&MAGIC);
        hello.extend_from_slice(&(self.rank as u32).to_be_bytes());
        hello.extend_from_slice(&(self.world_size as u32).to_be_bytes());
        if let Err(error) = stream.write_all(&hello) {
            return match went_away(&error) {
                true => {
                    Joined::NotTheMaster(format!("the peer went away before the hello ({error})"))
                }
                false => Joined::Answer(Err(connection(error))),
            };
        }
        Joined::Answer(match read_reply(stream, deadline) {
            Ok((ACCEPTED, blob)) => {
                tracing::debug!(rank = self.rank, elapsed = ?started.elapsed(), "rendezvous: received the blob");
                Ok(blob)
            }
            Ok((_, reason)) => Err(RendezvousError::Rejected {
                rank: self.rank,
                reason: String::from_utf8_lossy(&reason).into_owned(),
            }),
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(RendezvousError::NoAnswer {
                    rank: self.rank,
                    endpoint: self.endpoint(),
                    waited: started.elapsed(),
                })
            }
            Err(error) if error.kind() == io::ErrorKind::InvalidData => {
                return Joined::NotTheMaster(format!("the peer answered: {error}"));
            }
            Err(error) if went_away(&error) => {
                return Joined::NotTheMaster(format!(
                    "the peer closed the connection without answering ({error})"
                ));
            }
            Err(error) => Err(connection(error)),
        })
    }

    fn check_rank(&self) -> Result<(), RendezvousError> {
        if self.rank >= self.world_size {
            return Err(RendezvousError::RankOutOfRange {
                rank: self.rank,
                world_size: self.world_size,
            });
        }
        Ok(())
    }

    /// Listens on every interface of the master address's family.
    fn listen(&self) -> Result<TcpListener, RendezvousError> {
        let ipv6 = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut addrs| addrs.next())
            .is_some_and(|addr| addr.is_ipv6());
        let any = if ipv6 {
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        };
        let address = SocketAddr::new(any, self.port);
        let bind_error = |error: io::Error| RendezvousError::Bind {
            endpoint: address.to_string(),
            reason: error.to_string(),
        };
        let listener = TcpListener::bind(address).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        Ok(listener)
    }

    /// Connects to the master, retrying with a growing interval until `deadline`.
    fn connect(&self, started: Instant, deadline: Instant) -> Result<TcpStream, RendezvousError> {
        let stream = connect_until(&self.host, self.port, deadline).map_err(|error| {
            RendezvousError::Unreachable {
                rank: self.rank,
                endpoint: self.endpoint(),
                waited: started.elapsed(),
                last_error: error.to_string(),
            }
        })?;
        tracing::debug!(rank = self.rank, "rendezvous: connected to rank 0");
        Ok(stream)
    }
}

/// Connects to `host:port`, retrying with a growing interval for `timeout` while nobody
/// listens there yet (the other side is still starting).
pub(crate) fn connect_with_retry(
    host: &str,
    port: u16,
    timeout: Duration,
) -> io::Result<TcpStream> {
    connect_until(host, port, Instant::now() + timeout)
}

/// [`connect_with_retry`] with a deadline; the error is the last attempt's.
fn connect_until(host: &str, port: u16, deadline: Instant) -> io::Result<TcpStream> {
    let mut interval = Duration::from_millis(20);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let remaining = deadline.saturating_duration_since(Instant::now());
        let attempt = match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                let mut connected = None;
                for addr in addrs {
                    let limit = remaining.clamp(Duration::from_millis(1), Duration::from_secs(5));
                    match TcpStream::connect_timeout(&addr, limit) {
                        Ok(stream) if is_self_connection(&stream) => {
                            last = io::Error::new(
                                io::ErrorKind::ConnectionRefused,
                                "nobody listens yet (the connection met itself)",
                            );
                        }
                        Ok(stream) => {
                            connected = Some(stream);
                            break;
                        }
                        Err(error) => last = error,
                    }
                }
                connected.ok_or(last)
            }
            Err(error) => Err(error),
        };
        match attempt {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Err(error) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(error);
                }
                if attempts == 1 || attempts.is_multiple_of(20) {
                    tracing::debug!(host, port, attempts, %error, "not reachable yet");
                }
                thread::sleep(interval.min(deadline - now));
                interval = (interval * 2).min(MAX_RETRY_INTERVAL);
            }
        }
    }
}

/// What a joining rank learned from the peer it connected to.
enum Joined {
    /// The master's answer: the blob, or why the rendezvous failed.
    Answer(Result<Vec<u8>, RendezvousError>),
    /// The peer is not a rendezvous master (it closed without answering, or spoke another
    /// protocol); the text says what it did.
    NotTheMaster(String),
}

/// Whether `error` means the peer closed or dropped the connection.
fn went_away(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Whether `stream` is connected to itself. While nobody listens on a loopback port in the
/// ephemeral range, a connection attempt may be given that very port as its own source port,
/// and TCP's simultaneous open then connects the socket to itself: it would read back its own
/// hello and never meet the master. Such a connection is dropped and the attempt repeated.
fn is_self_connection(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(local), Ok(peer)) if local == peer)
}

/// Refuses a blob over [`MAX_MESSAGE`], the most a joining rank reads, before any rank is
/// waited for.
fn check_blob_size(blob: &[u8]) -> Result<(), RendezvousError> {
    if blob.len() > MAX_MESSAGE {
        return Err(RendezvousError::Connection {
            peer: "every rank".into(),
            reason: format!(
                "a blob of {} bytes is over the limit of {MAX_MESSAGE}",
                blob.len()
            ),
        });
    }
    Ok(())
}

/// One connection waiting on rank 0's non-blocking `listener`, or `None` when there is none
/// yet: then it sleeps a moment first (as after a failed accept, which it logs), so that the
/// wait does not spin; an interrupted accept is retried at once.
fn accept_waiting(listener: &TcpListener) -> Option<(TcpStream, SocketAddr)> {
    match listener.accept() {
        Ok(accepted) => Some(accepted),
        Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
            thread::sleep(Duration::from_millis(5));
            None
        }
        Err(error) if error.kind() == io::ErrorKind::Interrupted => None,
        Err(error) => {
            tracing::warn!(%error, "rendezvous: accept failed");
            thread::sleep(Duration::from_millis(5));
            None
        }
    }
}

/// Sends `blob` to every rank that joined, in rank order; the first rank that cannot be
/// written to fails the rendezvous.
fn hand_out(peers: &mut [Option<TcpStream>], blob: &[u8]) -> Result<(), RendezvousError> {
    for (rank, stream) in peers.iter_mut().enumerate() {
        if let Some(stream) = stream {
            send_reply(stream, ACCEPTED, blob).map_err(|error| RendezvousError::Connection {
                peer: format!("rank {rank}"),
                reason: error.to_string(),
            })?;
        }
    }
    Ok(())
}

/// Tells every connected rank why the rendezvous failed.
fn reject_all(peers: &mut [Option<TcpStream>], error: &RendezvousError) {
    let reason = error.to_string();
    for stream in peers.iter_mut().flatten() {
        let _ = send_reply(stream, REJECTED, reason.as_bytes());
    }
}

fn send_reply(stream: &mut TcpStream, status: u8, body: &[u8]) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(HELLO_TIMEOUT))?;
    let mut message = Vec::with_capacity(9 + body.len());
    message.extend_from_slice(&MAGIC);
    message.push(status);
    message.extend_from_slice(&(body.len() as u32).to_be_bytes());
    message.extend_from_slice(body);
    stream.write_all(&message)?;
    stream.flush()
}

/// Reads `buf.len()` bytes, waiting at most until `deadline`.
fn read_until(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        stream.set_read_timeout(Some(remaining))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the other side closed the connection",
                ));
            }
            Ok(n) => filled += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

fn read_hello(stream: &mut TcpStream, deadline: Instant) -> io::Result<(usize, usize)> {
    stream.set_nonblocking(false)?;
    let mut hello = [0u8; 12];
    read_until(stream, &mut hello, deadline)?;
    if hello[..4] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a burn-zero rendezvous client",
        ));
    }
    let rank = u32::from_be_bytes([hello[4], hello[5], hello[6], hello[7]]) as usize;
    let world_size = u32::from_be_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
    Ok((rank, world_size))
}

fn read_reply(stream: &mut TcpStream, deadline: Instant) -> io::Result<(u8, Vec<u8>)> {
    let mut header = [0u8; 9];
    read_until(stream, &mut header, deadline)?;
    if header[..4] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the master does not speak the burn-zero rendezvous protocol",
        ));
    }
    let status = header[4];
    let length = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) as usize;
    if length > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("announced message of {length} bytes is over the limit"),
        ));
    }
    let mut body = vec![0u8; length];
    read_until(stream, &mut body, deadline)?;
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket bound to a loopback port and connected to that same port, where nobody
    /// listens, connects to itself (TCP's simultaneous open), as a rank's retry may when its
    /// source port happens to be the master's port: it is told apart from a real connection.
    #[test]
    fn a_connection_that_met_itself_is_told_apart() {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        let own = socket.local_addr().unwrap();
        socket.connect(&own).unwrap();
        let looped = TcpStream::from(socket);
        assert_eq!(looped.peer_addr().unwrap(), looped.local_addr().unwrap());
        assert!(is_self_connection(&looped));

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let real = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(!is_self_connection(&real));
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn rendezvous(port: u16, rank: usize, world_size: usize, timeout_ms: u64) -> Rendezvous {
        let mut env = DistEnv::single_process(port);
        env.rank = rank;
        env.world_size = world_size;
        Rendezvous::new(&env).with_timeout(Duration::from_millis(timeout_ms))
    }

    /// Runs every `(rank, world_size)` on its own thread; rank 0 shares `blob`. Rank 0 binds a
    /// port the system picks before the others start (no port is assumed free between asking
    /// and binding), and the others connect to it.
    fn run(
        ranks: &[(usize, usize)],
        timeout_ms: u64,
        blob: &[u8],
    ) -> Vec<Result<Vec<u8>, RendezvousError>> {
        let (master, master_size) = ranks[0];
        assert_eq!(master, 0, "the first entry is the master");
        let server = rendezvous(0, 0, master_size, timeout_ms);
        let listener = server.bind().unwrap();
        let port = listener.port().unwrap();
        thread::scope(|scope| {
            let master = scope.spawn(|| server.serve_on(listener, blob).map(|()| blob.to_vec()));
            let peers: Vec<_> = ranks[1..]
                .iter()
                .map(|&(rank, world_size)| {
                    scope.spawn(move || rendezvous(port, rank, world_size, timeout_ms).fetch())
                })
                .collect();
            std::iter::once(master)
                .chain(peers)
                .map(|h| h.join().unwrap())
                .collect()
        })
    }

    #[test]
    fn every_rank_receives_the_blob() {
        let blob: Vec<u8> = (0..128).map(|i| (i * 7 + 3) as u8).collect();
        let results = run(&[(0, 4), (1, 4), (2, 4), (3, 4)], 10_000, &blob);
        for result in results {
            assert_eq!(result.unwrap(), blob);
        }
    }

    #[test]
    fn single_rank_needs_no_network() {
        // Port 1 is never ours to bind: a world of one must not try.
        let result = rendezvous(1, 0, 1, 100).share(|| vec![1, 2, 3]);
        assert_eq!(result.unwrap(), vec![1, 2, 3]);
    }

    #[test]
    fn world_size_mismatch_fails_both_sides() {
        let results = run(&[(0, 2), (1, 3)], 10_000, b"id");
        assert_eq!(
            results[0],
            Err(RendezvousError::WorldSizeMismatch {
                rank: 1,
                theirs: 3,
                ours: 2
            })
        );
        match &results[1] {
            Err(RendezvousError::Rejected { rank: 1, reason }) => {
                assert!(reason.contains("WORLD_SIZE=3"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn duplicate_rank_is_rejected() {
        let results = run(&[(0, 3), (1, 3), (1, 3)], 10_000, b"id");
        assert_eq!(results[0], Err(RendezvousError::DuplicateRank { rank: 1 }));
        for result in &results[1..] {
            match result {
                Err(RendezvousError::Rejected { reason, .. }) => {
                    assert!(reason.contains("joined the rendezvous twice"), "{reason}")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn out_of_range_rank_is_refused_before_connecting() {
        let error = rendezvous(free_port(), 3, 3, 100)
            .share(Vec::new)
            .unwrap_err();
        assert_eq!(
            error,
            RendezvousError::RankOutOfRange {
                rank: 3,
                world_size: 3
            }
        );
    }

    #[test]
    fn missing_ranks_are_named() {
        let started = Instant::now();
        let results = run(&[(0, 4), (2, 4)], 400, b"id");
        match &results[0] {
            Err(RendezvousError::Timeout { missing, .. }) => assert_eq!(missing, &[1, 3]),
            other => panic!("{other:?}"),
        }
        match &results[1] {
            Err(RendezvousError::Rejected { reason, .. }) => {
                assert!(reason.contains("never joined"), "{reason}")
            }
            // The joined rank's own deadline may pass first.
            Err(RendezvousError::NoAnswer { .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn unreachable_master_times_out() {
        let port = free_port();
        let started = Instant::now();
        let error = rendezvous(port, 1, 2, 300).fetch().unwrap_err();
        let waited = started.elapsed();
        match &error {
            RendezvousError::Unreachable { endpoint, .. } => {
                assert_eq!(endpoint, &format!("127.0.0.1:{port}"))
            }
            other => panic!("{other:?}"),
        }
        assert!(error.to_string().contains("could not reach the master"));
        assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(3));
    }

    /// A listener that takes a rank's connection on the master's port before rank 0 binds it,
    /// then closes it silently or answers in another protocol, does not end the rank's wait:
    /// it connects again and gets the blob from the master that comes up on the port.
    #[test]
    fn a_peer_that_is_not_the_master_is_passed_over() {
        for answer in [&b""[..], b"HTTP/1.1 400 Bad Request\r\n\r\n"] {
            let stray = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = stray.local_addr().unwrap().port();
            let blob = b"unique id".to_vec();
            let (master, peer) = thread::scope(|scope| {
                let peer = scope.spawn(move || rendezvous(port, 1, 2, 10_000).fetch());
                let (mut stream, _) = stray.accept().unwrap();
                let mut hello = [0u8; 12];
                stream.read_exact(&mut hello).unwrap();
                stream.write_all(answer).unwrap();
                drop(stream);
                drop(stray);
                let master = rendezvous(port, 0, 2, 10_000).serve(&blob);
                (master, peer.join().unwrap())
            });
            master.unwrap();
            assert_eq!(peer.unwrap(), blob, "after a stray answer of {answer:?}");
        }
    }

    /// With only a stranger on the port, the rank gives up at its timeout and says what it met.
    #[test]
    fn only_a_stranger_on_the_port_times_out_naming_it() {
        let stray = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = stray.local_addr().unwrap().port();
        stray.set_nonblocking(true).unwrap();
        let started = Instant::now();
        let error = thread::scope(|scope| {
            let peer = scope.spawn(move || rendezvous(port, 1, 2, 400).fetch());
            while !peer.is_finished() {
                match stray.accept() {
                    Ok((stream, _)) => drop(stream),
                    Err(_) => thread::sleep(Duration::from_millis(2)),
                }
            }
            peer.join().unwrap().unwrap_err()
        });
        match &error {
            RendezvousError::Connection { reason, .. } => {
                assert!(reason.contains("without answering"), "{reason}");
                assert!(reason.contains("no rendezvous master answered"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_stray_client_is_ignored() {
        let blob = b"unique id".to_vec();
        let server = rendezvous(0, 0, 2, 10_000);
        let listener = server.bind().unwrap();
        let port = listener.port().unwrap();
        let results = thread::scope(|scope| {
            let master = scope.spawn(|| server.serve_on(listener, &blob).map(|()| blob.clone()));
            // Something that is not a rank connects first and sends garbage.
            let mut stray = loop {
                match TcpStream::connect(("127.0.0.1", port)) {
                    Ok(stream) => break stream,
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            };
            stray.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            let peer = scope.spawn(|| rendezvous(port, 1, 2, 10_000).fetch());
            (master.join().unwrap(), peer.join().unwrap())
        });
        assert_eq!(results.0.unwrap(), blob);
        assert_eq!(results.1.unwrap(), blob);
    }
}
