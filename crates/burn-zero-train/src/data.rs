//! Each rank's share of an epoch: disjoint, of equal size, and redrawn every epoch from a seed
//! every rank knows.
//!
//! A burn-train data loader is opaque: it can only be iterated, counted and cut into contiguous
//! item ranges (`DataLoader::slice`). So an epoch's `n` items are cut into `world_size` blocks
//! of `n / world_size` items; the `n mod world_size` items left over are dropped for that epoch
//! (every rank must run the same number of steps, or the collectives of the ranks with more
//! would wait forever). Each epoch, a generator seeded with `(seed, epoch)` — the same on every
//! rank, in every process — moves the dropped items elsewhere (so that no item is left out of
//! every epoch) and deals the blocks to the ranks in a new order. Inside a block the loader
//! keeps its own order: a loader built with `shuffle` reshuffles its block every epoch.
//!
//! Validation takes the blocks in rank order from the first item: its order does not matter,
//! and every epoch then measures the same items. With fewer validation items than ranks,
//! validation is skipped (with a warning); fewer training items than ranks is an error.

use std::sync::Arc;

use burn::data::dataloader::DataLoader;
use burn::tensor::backend::Backend;

use crate::error::TrainError;

/// How the items of an epoch are dealt to the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deal {
    /// Training: blocks and the dropped remainder move every epoch.
    Shuffled { seed: u64 },
    /// Validation: the same blocks every epoch, the remainder at the end.
    Fixed,
}

/// Where one rank's block of one epoch lies in a loader of `items` items.
pub(crate) fn block(
    items: usize,
    world_size: usize,
    rank: usize,
    epoch: usize,
    deal: Deal,
) -> std::ops::Range<usize> {
    let size = items / world_size;
    let (offset, position) = match deal {
        Deal::Fixed => (0, rank),
        Deal::Shuffled { seed } => {
            let mut draw = Draw::new(seed, epoch as u64);
            let left_over = items - size * world_size;
            let offset = (draw.next() % (left_over as u64 + 1)) as usize;
            (offset, draw.permutation(world_size)[rank])
        }
    };
    let start = offset + position * size;
    start..start + size
}

/// Data loaders by epoch, then by rank.
pub(crate) type Shares<B, O> = Vec<Vec<Arc<dyn DataLoader<B, O>>>>;

/// Every rank's share of every epoch `first_epoch..=last_epoch`, as `shares[epoch -
/// first_epoch][rank]`, each moved to that rank's device.
///
/// Slicing draws from the loader's own generator (a shuffling loader forks one per slice), so
/// all shares are cut here, once, in a fixed order — never concurrently from rank threads,
/// whose order would vary from run to run.
pub(crate) fn shares<B: Backend, O>(
    loader: &Arc<dyn DataLoader<B, O>>,
    devices: &[B::Device],
    world_size: usize,
    epochs: std::ops::RangeInclusive<usize>,
    deal: Deal,
    split: &str,
) -> Result<Shares<B, O>, TrainError> {
    let items = loader.num_items();
    if items < world_size {
        if deal == Deal::Fixed {
            // Validation is optional: with fewer items than ranks, none validates.
            tracing::warn!(
                split,
                items,
                world_size,
                "fewer items than ranks: skipped on every rank"
            );
            return Ok(epochs
                .map(|_| {
                    (0..world_size)
                        .map(|rank| loader.slice(0, 0).to_device(&devices[rank % devices.len()]))
                        .collect()
                })
                .collect());
        }
        return Err(TrainError::Invalid(format!(
            "the {split} data loader has {items} items for {world_size} ranks: every rank needs \
             at least one"
        )));
    }
    let dropped = items % world_size;
    if dropped > 0 {
        tracing::info!(
            split,
            items,
            world_size,
            dropped,
            "items left over by the equal split are skipped each epoch"
        );
    }
    Ok(epochs
        .map(|epoch| {
            (0..world_size)
                .map(|rank| {
                    let range = block(items, world_size, rank, epoch, deal);
                    let device = &devices[rank % devices.len()];
                    loader.slice(range.start, range.end).to_device(device)
                })
                .collect()
        })
        .collect())
}

/// A small deterministic generator (splitmix64): the same numbers on every rank and platform.
struct Draw(u64);

impl Draw {
    fn new(seed: u64, stream: u64) -> Self {
        Self(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniformly drawn permutation of `0..n` (Fisher–Yates).
    fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every epoch's blocks are disjoint, equal, inside the data, and cover all but the
    /// remainder; the deal changes from epoch to epoch.
    #[test]
    fn blocks_are_disjoint_equal_and_redrawn() {
        let (items, world) = (103, 4);
        let mut deals = std::collections::HashSet::new();
        for epoch in 1..=20 {
            let blocks: Vec<_> = (0..world)
                .map(|rank| block(items, world, rank, epoch, Deal::Shuffled { seed: 7 }))
                .collect();
            let mut covered = vec![0u8; items];
            for b in &blocks {
                assert_eq!(b.len(), items / world);
                assert!(b.end <= items);
                for i in b.clone() {
                    covered[i] += 1;
                }
            }
            assert!(covered.iter().all(|&c| c <= 1), "blocks overlap");
            assert_eq!(covered.iter().filter(|&&c| c == 1).count(), 100);
            deals.insert(blocks.iter().map(|b| b.start).collect::<Vec<_>>());
        }
        assert!(deals.len() > 5, "the deal hardly changes: {deals:?}");
    }

    #[test]
    fn fixed_blocks_start_at_zero_in_rank_order() {
        let blocks: Vec<_> = (0..3).map(|r| block(10, 3, r, 5, Deal::Fixed)).collect();
        assert_eq!(blocks, vec![0..3, 3..6, 6..9]);
    }

    #[test]
    fn the_same_seed_deals_the_same_way() {
        for epoch in 1..5 {
            for rank in 0..3 {
                let deal = Deal::Shuffled { seed: 11 };
                assert_eq!(
                    block(50, 3, rank, epoch, deal),
                    block(50, 3, rank, epoch, deal)
                );
            }
        }
    }
}
