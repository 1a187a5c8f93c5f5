//! Batches of members for one pack or unpack launch each.
//!
//! A member's pack or unpack moves a few MiB, which a GPU copies in microseconds, about what
//! the host spends issuing one launch; so members that can share a launch wait here. What a
//! launch must share (the dtype it reads or writes, its vector width) is the batch's key.
//! Members of a bucket write disjoint places, so batches need not follow the order members
//! come in: one batch is open per key.

use burn_cubecl::CubeRuntime;
use cubecl::prelude::{ComputeClient, SequenceArg};

use super::shifted::Grid;

/// The most members one launch takes (each kernel unrolls a range test per member).
const MAX_BATCH: usize = 16;

/// Members waiting for their launches, one open batch per key `K`.
pub(super) struct Batches<K, M> {
    limit: usize,
    open: Vec<(K, Vec<M>)>,
}

impl<K: PartialEq, M> Batches<K, M> {
    /// Batches of [`MAX_BATCH`] members on `client`'s device, fewer where it binds fewer
    /// buffers to a kernel: each member is a binding of its own (a kernel cannot index an
    /// array of buffers), and `fixed` bindings go to the kernel's other buffers.
    pub(super) fn new<R: CubeRuntime>(client: &ComputeClient<R>, fixed: usize) -> Self {
        let bindings = client.properties().hardware.max_bindings as usize;
        Self {
            limit: bindings.saturating_sub(fixed).clamp(1, MAX_BATCH),
            open: Vec::new(),
        }
    }

    /// Adds `member` to the open batch of `key`, and returns that batch once it is full.
    pub(super) fn push(&mut self, key: K, member: M) -> Option<(K, Vec<M>)> {
        let at = match self.open.iter().position(|(open, _)| *open == key) {
            Some(at) => at,
            None => {
                self.open.push((key, Vec::with_capacity(self.limit)));
                self.open.len() - 1
            }
        };
        self.open[at].1.push(member);
        (self.open[at].1.len() >= self.limit).then(|| self.open.swap_remove(at))
    }

    /// Every batch still open, to launch now.
    pub(super) fn take(&mut self) -> Vec<(K, Vec<M>)> {
        std::mem::take(&mut self.open)
    }
}

/// Where each member of one launch lies, in units of `vector` elements: unit `pos` of the
/// launch's grid belongs to member `i` when `starts[i] <= pos < ends[i]`, and `offsets[i]` is
/// the member's place in the buffer the batch shares (the bucket, the row, the gather). The
/// members' ranges tile `0..units`.
pub(super) struct UnitRanges<R: CubeRuntime> {
    pub starts: SequenceArg<R, usize>,
    pub ends: SequenceArg<R, usize>,
    pub offsets: SequenceArg<R, usize>,
    pub units: usize,
}

impl<R: CubeRuntime> UnitRanges<R> {
    /// The ranges of members given as (offset in the shared buffer, elements in the grid), in
    /// launch order. On the aligned grid both are multiples of `vector`, and offsets are
    /// counted in vectors; a shifted member (`shifted.rs`) takes whole vectors, its last one
    /// partly, and its offset stays in elements.
    pub(super) fn new(
        members: impl IntoIterator<Item = (usize, usize)>,
        vector: usize,
        grid: Grid,
    ) -> Self {
        let mut ranges = Self {
            starts: SequenceArg::new(),
            ends: SequenceArg::new(),
            offsets: SequenceArg::new(),
            units: 0,
        };
        for (offset, elements) in members {
            ranges.starts.push(ranges.units);
            ranges.units += elements.div_ceil(vector);
            ranges.ends.push(ranges.units);
            ranges.offsets.push(match grid {
                Grid::Aligned => offset / vector,
                Grid::Shifted => offset,
            });
        }
        ranges
    }
}
