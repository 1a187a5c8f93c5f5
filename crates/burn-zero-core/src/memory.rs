//! Per-rank accounting of model data: what the decorator holds, by kind, current and peak.

use std::sync::atomic::{AtomicI64, Ordering};

use burn_zero_comm::Counts;
use serde::Serialize;

/// Kinds of memory the decorator accounts for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// This rank's shards of sharded parameters.
    ParameterShards,
    /// Parameters replicated on every rank: all of them at stages 0–2, those below the
    /// persistence threshold at stage 3.
    PersistentParameters,
    /// This rank's shards of reduced gradients.
    GradientShards,
    /// Full parameters gathered for compute (the cache plus the gather in flight). A rank
    /// alone gathers in place: a parameter whose shard is on the device is then its shard's
    /// buffer (a view, where the backend's alignment allows one), counted here all the same,
    /// so at world size 1 this kind is an upper bound.
    Gathered,
    /// Gradient buckets: full gradients waiting for their bucket, and packed buckets in flight.
    Buckets,
    /// fp32 master copies of this rank's part of the parameters (kept by the optimizer).
    MasterWeights,
    /// Optimizer state of this rank's part (e.g. Adam's two moments).
    OptimizerState,
    /// fp32 gradient sums of an accumulation window.
    GradientAccumulators,
    /// This rank's shards of sharded parameters kept in host memory (`offload_param_frac`):
    /// uploaded for each all-gather.
    HostParameterShards,
    /// This rank's shards of reduced gradients moved to host memory as they arrive, for an
    /// optimizer that steps on the host (`Placement::offload_optim_frac`).
    HostGradientShards,
    /// fp32 master copies kept on a host backend by an optimizer that steps there.
    HostMasterWeights,
    /// Optimizer state kept on a host backend.
    HostOptimizerState,
    /// fp32 gradient sums kept on a host backend.
    HostGradientAccumulators,
}

const KINDS: usize = 13;

#[derive(Debug, Default)]
struct Counter {
    current: AtomicI64,
    peak: AtomicI64,
}

/// Live counters of one rank's model data.
#[derive(Debug, Default)]
pub struct MemoryTracker {
    counters: [Counter; KINDS],
}

impl MemoryTracker {
    fn counter(&self, kind: MemoryKind) -> &Counter {
        &self.counters[kind as usize]
    }

    /// Records `bytes` more of `kind`.
    pub fn add(&self, kind: MemoryKind, bytes: usize) {
        let c = self.counter(kind);
        let now = c.current.fetch_add(bytes as i64, Ordering::Relaxed) + bytes as i64;
        c.peak.fetch_max(now, Ordering::Relaxed);
    }

    /// Records `bytes` less of `kind`.
    pub fn sub(&self, kind: MemoryKind, bytes: usize) {
        self.counter(kind)
            .current
            .fetch_sub(bytes as i64, Ordering::Relaxed);
    }

    /// Records a transient peak: `bytes` held on top of the current amount, then released.
    pub fn touch(&self, kind: MemoryKind, bytes: usize) {
        let c = self.counter(kind);
        let now = c.current.load(Ordering::Relaxed) + bytes as i64;
        c.peak.fetch_max(now, Ordering::Relaxed);
    }

    /// Current and peak bytes of `kind`.
    pub fn usage(&self, kind: MemoryKind) -> Usage {
        let c = self.counter(kind);
        Usage {
            current: c.current.load(Ordering::Relaxed).max(0) as u64,
            peak: c.peak.load(Ordering::Relaxed).max(0) as u64,
        }
    }

    /// A snapshot of every kind.
    pub fn report(&self, rank: usize) -> MemoryReport {
        MemoryReport {
            rank,
            parameter_shards: self.usage(MemoryKind::ParameterShards),
            persistent_parameters: self.usage(MemoryKind::PersistentParameters),
            gradient_shards: self.usage(MemoryKind::GradientShards),
            gathered: self.usage(MemoryKind::Gathered),
            buckets: self.usage(MemoryKind::Buckets),
            master_weights: self.usage(MemoryKind::MasterWeights),
            optimizer_state: self.usage(MemoryKind::OptimizerState),
            gradient_accumulators: self.usage(MemoryKind::GradientAccumulators),
            host_parameter_shards: self.usage(MemoryKind::HostParameterShards),
            host_gradient_shards: self.usage(MemoryKind::HostGradientShards),
            host_master_weights: self.usage(MemoryKind::HostMasterWeights),
            host_optimizer_state: self.usage(MemoryKind::HostOptimizerState),
            host_gradient_accumulators: self.usage(MemoryKind::HostGradientAccumulators),
            chunks: ChunkCounts::default(),
            auto_placement: None,
            kept_shards: None,
            counts: Counts::default(),
        }
    }
}

/// Bytes in use now and at most so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Bytes held now.
    pub current: u64,
    /// Most bytes held at once so far.
    pub peak: u64,
}

/// One rank's model-data memory, by kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    /// The rank.
    pub rank: usize,
    /// Shards of sharded parameters.
    pub parameter_shards: Usage,
    /// Replicated small parameters.
    pub persistent_parameters: Usage,
    /// Shards of reduced gradients.
    pub gradient_shards: Usage,
    /// Gathered full parameters.
    pub gathered: Usage,
    /// Gradients waiting for their bucket and packed buckets.
    pub buckets: Usage,
    /// fp32 master copies on the device.
    pub master_weights: Usage,
    /// Optimizer state on the device.
    pub optimizer_state: Usage,
    /// fp32 gradient accumulators on the device.
    pub gradient_accumulators: Usage,
    /// Shards of sharded parameters kept in host memory (parameter offload); not counted in
    /// `parameter_shards`.
    pub host_parameter_shards: Usage,
    /// Shards of reduced gradients moved to host memory for an offloaded optimizer; not
    /// counted in `gradient_shards`.
    pub host_gradient_shards: Usage,
    /// fp32 master copies on a host backend (`Placement::offload_optim_frac`: the optimizer's
    /// host chunks); not counted in `master_weights`.
    pub host_master_weights: Usage,
    /// Optimizer state on a host backend; not counted in `optimizer_state`.
    pub host_optimizer_state: Usage,
    /// fp32 gradient accumulators on a host backend; not counted in `gradient_accumulators`.
    pub host_gradient_accumulators: Usage,
    /// The chunk layout in numbers.
    pub chunks: ChunkCounts,
    /// What the auto placement measured and decided (`Placement::auto`), once its
    /// warm-up has ended.
    pub auto_placement: Option<AutoPlacementReport>,
    /// What the auto placement's host shards kept on the device between uses did, once it
    /// decided (their bytes count in `parameter_shards` while kept).
    pub kept_shards: Option<KeptShardStats>,
    /// What the rank has issued since it started: collectives by kind, device
    /// synchronisations, host reads (for every module sharded on its context).
    pub counts: Counts,
}

/// What the auto placement measured and decided on a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AutoPlacementReport {
    /// The device capacity it was given, in bytes.
    pub capacity_bytes: u64,
    /// The most bytes the device had in use during the warm-up (every shard on the host).
    pub warmup_peak_bytes: u64,
    /// The largest sharded chunk's shard: an optimizer step holds one device chunk's old and
    /// new values at once (it replaces each chunk's values as it reaches them), which the
    /// warm-up, with every shard on the host, never held. Kept out of the room.
    pub step_bytes: u64,
    /// `0.9 × capacity − warmup_peak − step_bytes`: the bytes the shards were allowed on the
    /// device.
    pub room_bytes: u64,
    /// Sharded chunks whose shards moved to the device.
    pub device_chunks: usize,
    /// Sharded chunks whose shards stayed in host memory.
    pub host_chunks: usize,
    /// Bytes of the shards that moved to the device (at most `room_bytes`).
    pub device_shard_bytes: u64,
    /// Periods of the recorded pass (one per parameter gather, one between passes), over
    /// which the host chunks' shards are kept on the device between uses.
    pub periods: usize,
    /// The most room a period leaves for host shards kept on the device between uses.
    pub most_period_room_bytes: u64,
}

impl AutoPlacementReport {
    /// The room the shards left unused: what a split optimizer's `gpu_margin_mem_ratio`
    /// shares out to optimizer chunks.
    pub fn left_over_bytes(&self) -> u64 {
        self.room_bytes.saturating_sub(self.device_shard_bytes)
    }
}

/// What the auto placement's host shards kept on the device between uses did since it decided
/// (`store::residency`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KeptShardStats {
    /// Gathers whose host chunk's shard was already on the device (an upload saved).
    pub kept_uses: u64,
    /// Shards kept on the device after their upload.
    pub kept: u64,
    /// Kept shards dropped to fit a period's room, or because new values replaced them.
    pub evicted: u64,
    /// Gathers outside the recorded order (nothing is kept until the order starts again).
    pub off_schedule: u64,
}

/// The chunk layout of a sharded module, in numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ChunkCounts {
    /// Chunks split across the ranks (all-gathered at stage 3, reduce-scattered).
    pub sharded: usize,
    /// Chunks whole on every rank (all-reduced).
    pub replicated: usize,
    /// Bytes of padding over all ranks' shards together: each sharded parameter's round-up to
    /// a whole block per rank.
    pub padding_bytes: u64,
}

impl MemoryReport {
    /// Model state now: parameters, gradient shards, masters and optimizer state.
    pub fn model_state_bytes(&self) -> u64 {
        self.parameter_shards.current
            + self.host_parameter_shards.current
            + self.persistent_parameters.current
            + self.gradient_shards.current
            + self.host_gradient_shards.current
            + self.master_weights.current
            + self.optimizer_state.current
    }
}
