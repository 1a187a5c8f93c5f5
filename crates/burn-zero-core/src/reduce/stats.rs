//! `ReductionStats`: what one backward pass spent on gradient reduction.

/// What the last backward pass spent on gradient reduction, on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReductionStats {
    /// Collectives issued: one per bucket, two with hybrid sharding (the reduction inside the
    /// shard group, then the all-reduce across the groups).
    pub collectives: usize,
    /// Bytes this rank put into them (all ranks' rows of every bucket).
    pub bytes: usize,
    /// Wall time of packing, reducing and unpacking every bucket (on the communication
    /// thread when reduction overlaps backward).
    pub seconds: f64,
    /// Time the training thread waited for reductions once backward was over: all of
    /// `seconds` without overlap, only the part backward did not hide with it.
    pub exposed_seconds: f64,
    /// Buckets whose reduction was done while backward was still running.
    pub overlapped: usize,
}
