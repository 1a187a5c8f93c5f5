//! Why the job stopped ([`ControlFailure`], as every rank hears it from the store) and why
//! setting up the control connection or a schedule check failed ([`ControlError`]).

use std::time::Duration;

use crate::rendezvous::RendezvousError;

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
