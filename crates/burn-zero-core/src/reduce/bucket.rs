//! Gradient buckets: many small gradient reductions packed into one collective.
//!
//! The layout is static — fixed when the module is sharded, from the parameters in reduction
//! order — so every rank issues the same collectives. A reduce-scatter bucket is laid out rank
//! by rank (`[world_size, chunk]`): each member contributes its padded gradient as
//! `world_size` blocks, one per rank row, so that the reduce-scatter leaves every rank exactly
//! its block of every member. An all-reduce bucket (stage 0, and replicated parameters at
//! stage 3) is the members' gradients end to end.
//!
//! This module is the layout; `reduction` reduces one bucket by it.

use burn::tensor::{DType, Shape};
use burn_zero_comm::CollectiveKind;
use burn_zero_kernels::BufferPool;

use crate::chunk::{Chunk, ChunkKind, ChunkLayout};
use crate::store::{BlockLayout, ParamInfo};

/// How a bucket's gradients are reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Every rank receives the whole mean gradient (replicated result).
    AllReduce,
    /// Every rank receives its block of the mean gradient (sharded result).
    ReduceScatter,
}

/// One parameter's place in a bucket.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub key: usize,
    pub shape: Shape,
    pub dtype: DType,
    /// Elements per rank row: the padded block (reduce-scatter) or the whole gradient.
    pub len: usize,
    /// Start of the member within a row.
    pub offset: usize,
}

/// Gradients reduced together by one collective.
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    pub mode: Mode,
    pub reduce_dtype: DType,
    pub members: Vec<Member>,
    /// Elements per rank row.
    pub len: usize,
    /// Elements per row a bucket of its class may hold when the members are regrouped for the
    /// order backward produces gradients in ([`regroup`]); `None`: its members are fixed (a
    /// sharded chunk, whose reduced row is the rank's shard of the chunk).
    pub regroup: Option<usize>,
    /// The packed bucket's memory, reused step after step where the pack path can (a clone of
    /// the bucket starts with an empty pool).
    pub pool: BufferPool,
}

impl Bucket {
    /// What stands in a queue's place for a bucket taken out to be reduced elsewhere.
    pub fn taken() -> Self {
        Self {
            mode: Mode::AllReduce,
            reduce_dtype: DType::F32,
            members: Vec::new(),
            len: 0,
            regroup: None,
            pool: BufferPool::default(),
        }
    }

    /// Its members' parameter keys, in bucket order.
    pub fn keys(&self) -> Vec<usize> {
        self.members.iter().map(|m| m.key).collect()
    }

    /// Its members' full gradients, in bytes: what the device holds for it until it is
    /// reduced.
    pub fn gradient_bytes(&self) -> usize {
        self.members
            .iter()
            .map(|m| m.shape.num_elements() * m.dtype.size())
            .sum()
    }

    /// The collectives reducing this bucket issues: its own, and with hybrid sharding
    /// (`across_groups`) the all-reduce across the shard groups.
    pub fn collectives(&self, across_groups: bool) -> Vec<CollectiveKind> {
        let own = match self.mode {
            Mode::ReduceScatter => CollectiveKind::ReduceScatter,
            Mode::AllReduce => CollectiveKind::AllReduce,
        };
        let mut kinds = vec![own];
        if across_groups {
            kinds.push(CollectiveKind::AllReduce);
        }
        kinds
    }

    /// Bytes of the packed bucket (all rows).
    pub fn bytes(&self, world_size: usize) -> usize {
        let rows = match self.mode {
            Mode::ReduceScatter => world_size,
            Mode::AllReduce => 1,
        };
        rows * self.len * self.reduce_dtype.size()
    }
}

/// One gradient to place in a bucket, with the elements per row a bucket of its class (mode
/// and reduce dtype) may hold.
struct Item {
    member: Member,
    mode: Mode,
    reduce_dtype: DType,
    capacity: usize,
}

/// `items` (in reduction order) packed into buckets: each class fills its own open bucket, so
/// that sharded and replicated gradients interleaved in the order do not cut each other's
/// buckets short (PyTorch DDP keeps one open bucket per dtype for the same reason). An item
/// that does not fit closes its class's bucket; one larger than the capacity gets a bucket of
/// its own. Closed buckets come in the order they closed, the ones still open after them.
fn pack(items: impl IntoIterator<Item = Item>) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut open: Vec<Bucket> = Vec::new();
    for Item {
        mut member,
        mode,
        reduce_dtype,
        capacity,
    } in items
    {
        let class = |b: &Bucket| {
            b.mode == mode && b.reduce_dtype == reduce_dtype && b.regroup == Some(capacity)
        };
        if let Some(at) = open.iter().position(class) {
            let bucket = &mut open[at];
            if bucket.len + member.len <= capacity {
                member.offset = bucket.len;
                bucket.len += member.len;
                bucket.members.push(member);
                continue;
            }
            buckets.push(open.remove(at));
        }
        member.offset = 0;
        let bucket = Bucket {
            mode,
            reduce_dtype,
            len: member.len,
            members: vec![member],
            regroup: Some(capacity),
            pool: BufferPool::default(),
        };
        if bucket.len > capacity {
            // Direct path: too large for any bucket.
            buckets.push(bucket);
        } else {
            open.push(bucket);
        }
    }
    buckets.extend(open);
    buckets
}

/// Parameters (in reduction order) split into buckets of at most `bucket_bytes` each (≤ 0:
/// one bucket per parameter). A gradient larger than a bucket gets a bucket of its own.
pub(crate) fn layout(
    params: &[ParamInfo],
    mode_of: impl Fn(&ParamInfo) -> Mode,
    world_size: usize,
    bucket_bytes: f64,
    reduce_dtype: Option<DType>,
) -> Vec<Bucket> {
    pack(params.iter().map(|info| {
        let mode = mode_of(info);
        let reduce_dtype = reduce_dtype.unwrap_or(info.dtype);
        let numel = info.shape.num_elements();
        let (len, rows) = match mode {
            Mode::ReduceScatter => (BlockLayout::new(numel, world_size).block_len(), world_size),
            Mode::AllReduce => (numel, 1),
        };
        let capacity = if bucket_bytes > 0.0 {
            (bucket_bytes / (reduce_dtype.size() * rows) as f64) as usize
        } else {
            0
        };
        Item {
            member: Member {
                key: info.key,
                shape: info.shape.clone(),
                dtype: info.dtype,
                len,
                offset: 0,
            },
            mode,
            reduce_dtype,
            capacity,
        }
    }))
}

/// `buckets` rebuilt for the order a backward pass produced their gradients in, `position`
/// giving each parameter key's place in that order (`usize::MAX`: it never came). The members
/// of buckets that may be regrouped are packed again, in that order and with their class's
/// capacity, so that each bucket holds gradients that arrive together; buckets whose members
/// are fixed (a sharded chunk's) stay as they are. Then every bucket goes in the order its last
/// member arrived: the order the pass completes them.
///
/// Why regroup and not only reorder: a bucket takes its members in layout order, and a
/// parameter that enters the graph through a shallow op (a LayerNorm's scale and shift, a
/// bias broadcast by a reshape) gets its gradient only when backward ends. When every
/// parameter is replicated (stage 0, or a model below `persist_below_numel`), nearly every
/// bucket of the layout holds one, so reordering alone leaves every bucket complete only at the
/// end, and backward holds every gradient. PyTorch DDP rebuilds its buckets from the first
/// iteration's arrival order for the same reason.
///
/// Every element is reduced by the same collective kind with the same arithmetic, only at
/// another place in another buffer: the rank-order sums of the local groups are bitwise the
/// same (NCCL's sums follow its own order along the buffer, as they always do).
pub(crate) fn regroup(buckets: &[Bucket], position: impl Fn(usize) -> usize) -> Vec<Bucket> {
    let mut loose: Vec<(usize, usize, Item)> = buckets
        .iter()
        .filter_map(|bucket| Some((bucket, bucket.regroup?)))
        .flat_map(|(bucket, capacity)| {
            bucket.members.iter().map(move |member| Item {
                member: member.clone(),
                mode: bucket.mode,
                reduce_dtype: bucket.reduce_dtype,
                capacity,
            })
        })
        .enumerate()
        .map(|(at, item)| (position(item.member.key), at, item))
        .collect();
    loose.sort_by_key(|&(position, at, _)| (position, at));
    let mut rebuilt = pack(loose.into_iter().map(|(_, _, item)| item));
    let fixed = buckets.iter().filter(|bucket| bucket.regroup.is_none());
    rebuilt.extend(fixed.cloned());
    let completed = |bucket: &Bucket| {
        bucket
            .members
            .iter()
            .map(|m| position(m.key))
            .max()
            .unwrap_or(usize::MAX)
    };
    rebuilt.sort_by_key(completed);
    rebuilt
}

/// One bucket per trainable chunk, by descending first member (backward finishes parameters
/// in roughly reverse visit order; the reducer puts them in the order a pass really completes
/// them after the first). A bucket's members are its chunk's, in the
/// chunk's order, so a reduce-scatter leaves each rank exactly its shard of the chunk's
/// gradient, laid out as the chunk's shard. Replicated chunks' buckets may be regrouped after
/// the first pass ([`regroup`]).
pub(crate) fn from_chunks(
    layout: &ChunkLayout,
    shapes: impl Fn(usize) -> Shape,
    reduce_dtype: Option<DType>,
) -> Vec<Bucket> {
    let mut chunks: Vec<&Chunk> = layout.chunks().iter().filter(|c| c.trainable).collect();
    chunks.sort_by_key(|c| std::cmp::Reverse(c.first_key()));
    chunks
        .into_iter()
        .map(|chunk| Bucket {
            mode: match chunk.kind {
                ChunkKind::Sharded => Mode::ReduceScatter,
                ChunkKind::Replicated => Mode::AllReduce,
            },
            reduce_dtype: reduce_dtype.unwrap_or(chunk.dtype),
            members: chunk
                .members
                .iter()
                .map(|member| Member {
                    key: member.key,
                    shape: shapes(member.key),
                    dtype: chunk.dtype,
                    len: member.block_len,
                    offset: member.offset,
                })
                .collect(),
            len: chunk.shard_len,
            // A replicated chunk's gradients are delivered member by member, whole, so they may
            // be regrouped, within the chunk capacity; a sharded chunk's row is its shard.
            regroup: match chunk.kind {
                ChunkKind::Sharded => None,
                ChunkKind::Replicated => layout.capacity(),
            },
            pool: BufferPool::default(),
        })
        .collect()
}

/// `buckets` with the all-reduced ones (replicated parameters: small by definition) moved
/// behind the reduce-scattered ones, each kind in its own order: the order the first backward
/// pass reduces in, before the pass has shown in which order it completes them (see
/// `GradientReducer`, which rebuilds them after it). A parameter that enters the graph through a
/// shallow op, as a LayerNorm's scale and shift do, gets its gradient only when backward ends;
/// such parameters are small and replicated, so their buckets wait at the back, where holding
/// them costs little, instead of holding back every sharded gradient behind them.
pub(crate) fn replicated_last(buckets: Vec<Bucket>) -> Vec<Bucket> {
    let (sharded, replicated): (Vec<Bucket>, Vec<Bucket>) = buckets
        .into_iter()
        .partition(|bucket| bucket.mode == Mode::ReduceScatter);
    sharded.into_iter().chain(replicated).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameters `0..numels.len()`, f32, each `sharded` or not.
    fn params(numels: &[(usize, bool)]) -> Vec<ParamInfo> {
        numels
            .iter()
            .enumerate()
            .map(|(key, &(numel, sharded))| ParamInfo {
                key,
                path: format!("p{key}"),
                shape: Shape::new([numel]),
                dtype: DType::F32,
                persistent: !sharded,
                trainable: true,
            })
            .collect()
    }

    fn keys(buckets: &[Bucket]) -> Vec<Vec<usize>> {
        buckets.iter().map(Bucket::keys).collect()
    }

    /// Each member starts where the one before it ends, and the bucket's row is their sum.
    fn assert_packed(buckets: &[Bucket]) {
        for bucket in buckets {
            let mut offset = 0;
            for member in &bucket.members {
                assert_eq!(member.offset, offset, "{:?}", bucket.keys());
                offset += member.len;
            }
            assert_eq!(bucket.len, offset);
        }
    }

    fn mode(info: &ParamInfo) -> Mode {
        if info.persistent {
            Mode::AllReduce
        } else {
            Mode::ReduceScatter
        }
    }

    #[test]
    fn sharded_and_replicated_gradients_fill_buckets_of_their_own() {
        // Weights (sharded, 100 elements) and biases (replicated, 10) alternate in reduction
        // order; 1 KiB buckets over 2 ranks hold two weights' rows or 25 biases.
        let infos = params(&[(100, true), (10, false)].repeat(4));
        let order: Vec<ParamInfo> = infos.into_iter().rev().collect();
        let buckets = layout(&order, mode, 2, 1024.0, None);
        assert_eq!(keys(&buckets), [vec![6, 4], vec![7, 5, 3, 1], vec![2, 0]]);
        assert_packed(&buckets);
        assert!(buckets.iter().all(|b| b.regroup.is_some()));
        // A gradient larger than the bucket gets its own, and closes its class's open one.
        let big = params(&[(10, false), (1000, false), (10, false)]);
        let buckets = layout(&big, mode, 2, 1024.0, None);
        assert_eq!(keys(&buckets), [vec![0], vec![1], vec![2]]);
    }

    #[test]
    fn regrouped_buckets_follow_the_arrival_order() {
        // Six replicated parameters of 64 elements, buckets of two: in reduction order the
        // layout pairs each weight (odd keys) with a LayerNorm parameter (even keys), whose
        // gradients arrive only when backward ends.
        let infos = params(&[(64, false); 6]);
        let order: Vec<ParamInfo> = infos.into_iter().rev().collect();
        let buckets = layout(&order, mode, 2, 512.0, None);
        assert_eq!(keys(&buckets), [vec![5, 4], vec![3, 2], vec![1, 0]]);
        let arrival = [5, 3, 1, 4, 2, 0];
        let position = |key: usize| arrival.iter().position(|&k| k == key).unwrap();
        let rebuilt = regroup(&buckets, position);
        assert_eq!(keys(&rebuilt), [vec![5, 3], vec![1, 4], vec![2, 0]]);
        assert_packed(&rebuilt);
        // Built again from the order it follows, the layout stays.
        assert_eq!(keys(&regroup(&rebuilt, position)), keys(&rebuilt));
    }

    #[test]
    fn fixed_buckets_keep_their_members_and_take_their_completion_place() {
        let infos = params(&[(64, false); 4]);
        let order: Vec<ParamInfo> = infos.into_iter().rev().collect();
        let mut buckets = layout(&order, mode, 2, 512.0, None);
        // [3, 2] stands for a sharded chunk's bucket: its members cannot move.
        buckets[0].regroup = None;
        // Key 2 never arrives on rank 0: it and its bucket go last.
        let arrival = [3, 1, 0];
        let position = |key: usize| arrival.iter().position(|&k| k == key).unwrap_or(usize::MAX);
        let rebuilt = regroup(&buckets, position);
        assert_eq!(keys(&rebuilt), [vec![1, 0], vec![3, 2]]);
        assert_eq!(rebuilt[1].regroup, None);
        assert_packed(&rebuilt);
    }
}
