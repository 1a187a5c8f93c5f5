//! A rank's side of the control connection ([`ControlClient`]): it sends the rank's schedule
//! checks, reports, aborts and goodbye to the store, and a reader thread turns the store's
//! answers into the rank's view of the job and runs its failure hooks. Rank 0's client also
//! owns the store it started, and closes it when dropped.

use std::collections::BTreeSet;
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::error::{ControlError, ControlFailure};
use super::first_cause::{FirstCause, cause_file_from_env};
use super::server::ControlServer;
use super::wire::{HELLO_TIMEOUT, ToRank, ToStore, WRITE_TIMEOUT, send};
use crate::sync::lock;

/// How long rank 0, done with its work, keeps the store open for ranks still finishing.
const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// How long a rank that reports its failure (or aborts) waits for the store to record it. A
/// round trip normally; bounded so that a store that is gone cannot hold a failing rank.
const REPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// A hook run once, on the thread that learns of the failure, when the job fails.
type Hook = Box<dyn Fn(&ControlFailure) + Send + Sync>;

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
    /// [`CAUSE_FILE_VAR`](super::first_cause::CAUSE_FILE_VAR) names when the environment sets
    /// it, and closes when this client is dropped (after the others left, or a grace period).
    pub fn serve(world_size: usize, timeout: Duration) -> Result<Self, ControlError> {
        if world_size == 1 {
            return Ok(ControlClient::solo());
        }
        let server =
            ControlServer::start_with_cause_file("127.0.0.1", world_size, cause_file_from_env())?;
        let client = ControlClient::connect("127.0.0.1", server.port(), 0, world_size, timeout)?;
        Ok(client.hosting(server))
    }

    /// Makes this client (rank 0's) the owner of the store it connected to: dropping the
    /// client then closes the store, once the other ranks left or after the grace period.
    pub(super) fn hosting(mut self, server: ControlServer) -> Self {
        self.server = Some(server);
        self
    }

    /// The port of the store this client started ([`ControlClient::serve`], or rank 0's
    /// connection made by [`establish`](super::establish::establish)); `None` for the other
    /// ranks.
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

#[cfg(test)]
mod tests {
    use super::super::scratch;

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

    #[test]
    fn the_first_report_is_every_ranks_cause_and_the_file_holds_it() {
        let (_dir, file) = scratch("report");
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
        let (_dir, file) = scratch("lost");
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
