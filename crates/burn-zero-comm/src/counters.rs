//! `RankCounters`: what one rank's training asks of its device and its peers — collectives by
//! kind, device synchronisations, reads of device memory back to the host and uploads of host
//! memory to the device.
//!
//! On CPU ranks none of these cost much; on a GPU each is a latency the step pays (a
//! collective's launch and its wait, a synchronisation that drains the stream, a host read
//! that waits for the value, an upload over the bus). They are counted where burn-zero issues
//! them — the rank's issuing thread for collectives and the synchronisation before each, the
//! gradient reducer, the offloaded blocks, the optimizer's host reads and uploads — so a count
//! per step is exact on any machine, and a target on it holds on a GPU too.

use std::ops::{Add, Sub};
use std::sync::atomic::{AtomicU64, Ordering};

/// The kinds of collectives counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveKind {
    /// All-gather (parameter gathers, prefetches, agreements).
    AllGather,
    /// Reduce-scatter (sharded gradient buckets).
    ReduceScatter,
    /// All-reduce (replicated gradient buckets, clipping norms, loss means).
    AllReduce,
    /// Broadcast, barrier, duplicate and split.
    Other,
}

/// One rank's counts since it started, updated by every thread of the rank.
#[derive(Debug, Default)]
pub struct RankCounters {
    all_gathers: AtomicU64,
    reduce_scatters: AtomicU64,
    all_reduces: AtomicU64,
    other_collectives: AtomicU64,
    in_place: AtomicU64,
    syncs: AtomicU64,
    host_reads: AtomicU64,
    host_writes: AtomicU64,
    host_read_bytes: AtomicU64,
    host_write_bytes: AtomicU64,
    engine_waits: AtomicU64,
}

impl RankCounters {
    /// Counts one collective of `kind`.
    pub fn collective(&self, kind: CollectiveKind) {
        let counter = match kind {
            CollectiveKind::AllGather => &self.all_gathers,
            CollectiveKind::ReduceScatter => &self.reduce_scatters,
            CollectiveKind::AllReduce => &self.all_reduces,
            CollectiveKind::Other => &self.other_collectives,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one collective answered in place, without the engine (the group has one rank:
    /// its result is its input). Counted under its kind as well.
    pub fn in_place(&self) {
        self.in_place.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one device synchronisation (a wait for the device's queued work).
    pub fn sync(&self) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one wait of the host for the device inside the communication engine (a stream
    /// synchronisation, or a poll until a collective completes that had not completed when
    /// its result was asked for).
    pub fn engine_wait(&self) {
        self.engine_waits.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one read of `bytes` of device memory back to the host.
    pub fn host_read(&self, bytes: usize) {
        self.host_reads.fetch_add(1, Ordering::Relaxed);
        self.host_read_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts one upload of `bytes` of host memory to the device.
    pub fn host_write(&self, bytes: usize) {
        self.host_writes.fetch_add(1, Ordering::Relaxed);
        self.host_write_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// The counts now; two snapshots subtract to the counts between them.
    pub fn snapshot(&self) -> Counts {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Counts {
            all_gathers: load(&self.all_gathers),
            reduce_scatters: load(&self.reduce_scatters),
            all_reduces: load(&self.all_reduces),
            other_collectives: load(&self.other_collectives),
            in_place: load(&self.in_place),
            syncs: load(&self.syncs),
            host_reads: load(&self.host_reads),
            host_writes: load(&self.host_writes),
            host_read_bytes: load(&self.host_read_bytes),
            host_write_bytes: load(&self.host_write_bytes),
            engine_waits: load(&self.engine_waits),
        }
    }
}

/// Counts of one rank, since it started or between two snapshots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    /// All-gathers.
    pub all_gathers: u64,
    /// Reduce-scatters.
    pub reduce_scatters: u64,
    /// All-reduces.
    pub all_reduces: u64,
    /// Broadcasts, barriers, duplicates and splits.
    pub other_collectives: u64,
    /// Of the collectives above, those a group of one rank answered in place: no engine call,
    /// no device work, no synchronisation (the result of a collective over one rank is its
    /// input).
    pub in_place: u64,
    /// Device synchronisations.
    pub syncs: u64,
    /// Reads of device memory back to the host.
    pub host_reads: u64,
    /// Uploads of host memory to the device (offloaded parameter shards before their
    /// gathers, offloaded optimizers' updated shards).
    pub host_writes: u64,
    /// Bytes of those reads: on a GPU, what crosses the bus from the device.
    pub host_read_bytes: u64,
    /// Bytes of those uploads: on a GPU, what crosses the bus to the device.
    pub host_write_bytes: u64,
    /// Waits of the host for the device inside the communication engine, which `syncs` does
    /// not count: an NCCL group's stream synchronisations, and its polls until a collective
    /// completes, on whichever thread reads the result, when the collective had not completed
    /// by then (a prefetched gather that finished in time costs none). Engines that never wait
    /// (on CPU) count none.
    pub engine_waits: u64,
}

impl Counts {
    /// Collectives of every kind.
    pub fn collectives(&self) -> u64 {
        self.all_gathers + self.reduce_scatters + self.all_reduces + self.other_collectives
    }
}

impl Add for Counts {
    type Output = Counts;

    fn add(self, other: Counts) -> Counts {
        Counts {
            all_gathers: self.all_gathers + other.all_gathers,
            reduce_scatters: self.reduce_scatters + other.reduce_scatters,
            all_reduces: self.all_reduces + other.all_reduces,
            other_collectives: self.other_collectives + other.other_collectives,
            in_place: self.in_place + other.in_place,
            syncs: self.syncs + other.syncs,
            host_reads: self.host_reads + other.host_reads,
            host_writes: self.host_writes + other.host_writes,
            host_read_bytes: self.host_read_bytes + other.host_read_bytes,
            host_write_bytes: self.host_write_bytes + other.host_write_bytes,
            engine_waits: self.engine_waits + other.engine_waits,
        }
    }
}

impl Sub for Counts {
    type Output = Counts;

    fn sub(self, earlier: Counts) -> Counts {
        Counts {
            all_gathers: self.all_gathers - earlier.all_gathers,
            reduce_scatters: self.reduce_scatters - earlier.reduce_scatters,
            all_reduces: self.all_reduces - earlier.all_reduces,
            other_collectives: self.other_collectives - earlier.other_collectives,
            in_place: self.in_place - earlier.in_place,
            syncs: self.syncs - earlier.syncs,
            host_reads: self.host_reads - earlier.host_reads,
            host_writes: self.host_writes - earlier.host_writes,
            host_read_bytes: self.host_read_bytes - earlier.host_read_bytes,
            host_write_bytes: self.host_write_bytes - earlier.host_write_bytes,
            engine_waits: self.engine_waits - earlier.engine_waits,
        }
    }
}
