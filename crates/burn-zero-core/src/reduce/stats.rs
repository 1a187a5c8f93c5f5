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
    /// thread when reduction overlaps backward; a rank alone's in the hooks that completed the
    /// buckets and at the end of backward).
    pub seconds: f64,
    /// Time the training thread waited for reductions once backward was over: all of
    /// `seconds` without overlap, only the part backward did not hide with it.
    pub exposed_seconds: f64,
    /// Buckets whose reduction was done while backward was still running.
    pub overlapped: usize,
    /// The most full-gradient bytes that waited at once, during backward, for the rest of
    /// their bucket to arrive: what the bucket layout, not the reductions' speed, makes a pass
    /// hold. A bucket whose members arrive far apart (a weight next to a LayerNorm parameter,
    /// whose gradient comes when backward ends) keeps the early ones waiting; with the buckets
    /// rebuilt for the order backward produces gradients in, about one bucket's worth. Counted
    /// from the order of autodiff's hooks, so the same in every run (0 without overlap,
    /// where every gradient waits for the end of backward).
    pub peak_incomplete_bytes: usize,
}
