//! `BlockLayout`: how a flat tensor is cut into one padded block per rank.
//!
//! ZeRO splits a flat tensor of `numel` elements over `world_size` ranks into equal blocks of
//! `b = ⌈numel / world_size⌉` elements: rank `r` owns elements `[r·b, min((r+1)·b, numel))`
//! (none at all on the high ranks of a small tensor) and its block carries zeros past them. The
//! store cuts parameters this way, the gradient buckets reduce-scatter into these blocks and
//! checkpoints write and read their chunks by them, so the arithmetic is kept here, once.

use std::ops::Range;

/// The padded blocks of a flat tensor of `numel` elements over `world_size` ranks.
///
/// Every method divides by `world_size`: it panics when `world_size` is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    numel: usize,
    world_size: usize,
}

impl BlockLayout {
    /// The blocks of a flat tensor of `numel` elements over `world_size` ranks.
    pub fn new(numel: usize, world_size: usize) -> Self {
        Self { numel, world_size }
    }

    /// Elements of every rank's block, padding included: `⌈numel / world_size⌉`.
    pub fn block_len(self) -> usize {
        self.numel.div_ceil(self.world_size)
    }

    /// The elements `[start, end)` of the flat tensor that `rank` owns (empty, at `numel`, for
    /// a rank past the tensor's end).
    pub fn owned(self, rank: usize) -> Range<usize> {
        let block = self.block_len();
        let start = (rank * block).min(self.numel);
        let end = (start + block).min(self.numel);
        start..end
    }

    /// Zeros `rank`'s block carries past the elements it owns.
    pub fn padding(self, rank: usize) -> usize {
        self.block_len() - self.owned(rank).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_written_out() {
        // 10 elements over 4 ranks: blocks of 3, the last rank owns one element and two zeros.
        let layout = BlockLayout::new(10, 4);
        assert_eq!(layout.block_len(), 3);
        let blocks: Vec<_> = (0..4)
            .map(|r| (layout.owned(r), layout.padding(r)))
            .collect();
        assert_eq!(blocks, [(0..3, 0), (3..6, 0), (6..9, 0), (9..10, 2)]);
        // 2 elements over 4 ranks: the last two ranks own nothing, their blocks are one zero.
        let layout = BlockLayout::new(2, 4);
        let blocks: Vec<_> = (0..4)
            .map(|r| (layout.owned(r), layout.padding(r)))
            .collect();
        assert_eq!(blocks, [(0..1, 0), (1..2, 0), (2..2, 1), (2..2, 1)]);
        // Nothing to split: empty blocks.
        let layout = BlockLayout::new(0, 3);
        assert_eq!(layout.block_len(), 0);
        assert_eq!((layout.owned(2), layout.padding(2)), (0..0, 0));
    }

    #[test]
    fn blocks_cover_every_element_once() {
        for numel in [0, 1, 7, 10, 130] {
            for world in 1..6 {
                let layout = BlockLayout::new(numel, world);
                let mut next = 0;
                for rank in 0..world {
                    let owned = layout.owned(rank);
                    assert_eq!(owned.start, next);
                    assert_eq!(owned.len() + layout.padding(rank), layout.block_len());
                    assert!(layout.block_len() * world >= numel);
                    assert!(layout.block_len() * world < numel + world);
                    next = owned.end;
                }
                assert_eq!(next, numel);
            }
        }
    }
}
