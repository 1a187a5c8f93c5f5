//! Placement of chunks between the device and the host: which sharded chunks keep their
//! parameter shards in host memory under `Placement::offload_param_frac` (the static policy
//! of ColossalAI Gemini's `placement_policy`), and which fit on the device in the room the
//! auto policy measured (`Placement::auto`).
//!
//! Both choices take chunks in layout order, whole, for as long as their shards' bytes stay
//! within the limit: the static one at `shard` time from the layout alone, so every rank makes
//! the same one without exchanging anything. Replicated chunks (parameters below the
//! persistence threshold) are read by every step in full and stay on the device.

use std::collections::HashSet;

use crate::chunk::{Chunk, ChunkKind, ChunkLayout};

/// The ids of the sharded chunks of `layout` whose parameter shards live on the host when a
/// fraction `frac` (0 to 1) of the sharded chunks' bytes is offloaded.
pub fn host_chunks(layout: &ChunkLayout, frac: f64) -> Vec<usize> {
    let total: usize = sharded(layout).map(shard_bytes).sum();
    // Compared in integers of bytes, so that a fraction of 1 takes every chunk exactly.
    first_within(
        layout,
        (frac.clamp(0.0, 1.0) * total as f64).round() as usize,
    )
}

/// The ids of the trainable chunks of `layout` (sharded or replicated) whose masters and
/// optimizer state step on the host when a fraction `frac` (0 to 1) of their bytes is
/// offloaded (Gemini's `offload_optim_frac`): whole chunks in layout order, as the parameter
/// fraction takes them, so every rank makes the same choice.
pub fn optimizer_host_chunks(layout: &ChunkLayout, frac: f64) -> Vec<usize> {
    let trainable = || layout.chunks().iter().filter(|c| c.trainable);
    let total: usize = trainable().map(shard_bytes).sum();
    let allowed = (frac.clamp(0.0, 1.0) * total as f64).round() as usize;
    take_within(trainable(), allowed)
}

/// The ids of the sharded chunks of `layout` whose parameter shards fit on the device in
/// `room` bytes (the auto placement's choice once its warm-up has measured the room).
pub fn device_chunks(layout: &ChunkLayout, room: usize) -> Vec<usize> {
    first_within(layout, room)
}

/// Bytes of the largest shard of a sharded chunk of `layout` (0 without one): what an optimizer
/// step holds twice at most while it replaces a device chunk's values.
pub fn largest_shard_bytes(layout: &ChunkLayout) -> usize {
    sharded(layout).map(shard_bytes).max().unwrap_or(0)
}

/// The keys of every member of the chunks `ids` of `layout`.
pub fn member_keys(layout: &ChunkLayout, ids: &[usize]) -> HashSet<usize> {
    ids.iter()
        .flat_map(|&id| layout.chunks()[id].members.iter().map(|m| m.key))
        .collect()
}

/// The sharded chunks in layout order, whole, while their shards' bytes stay within `allowed`.
fn first_within(layout: &ChunkLayout, allowed: usize) -> Vec<usize> {
    take_within(sharded(layout), allowed)
}

/// `chunks` in order, whole, while their shards' bytes stay within `allowed`.
fn take_within<'a>(chunks: impl Iterator<Item = &'a Chunk>, allowed: usize) -> Vec<usize> {
    let mut taken = 0;
    let mut ids = Vec::new();
    for chunk in chunks {
        if taken + shard_bytes(chunk) > allowed {
            break;
        }
        taken += shard_bytes(chunk);
        ids.push(chunk.id);
    }
    ids
}

fn sharded(layout: &ChunkLayout) -> impl Iterator<Item = &Chunk> {
    layout
        .chunks()
        .iter()
        .filter(|c| c.kind == ChunkKind::Sharded)
}

/// Bytes of one rank's shard of `chunk`.
pub fn shard_bytes(chunk: &Chunk) -> usize {
    chunk.shard_len * chunk.dtype.size()
}

#[cfg(test)]
mod tests {
    use burn::tensor::DType;

    use super::*;
    use crate::chunk::ChunkParam;

    fn layout(numels: &[(usize, bool)], ranks: usize, capacity: Option<usize>) -> ChunkLayout {
        let params: Vec<ChunkParam> = numels
            .iter()
            .enumerate()
            .map(|(key, &(numel, sharded))| ChunkParam {
                key,
                numel,
                dtype: DType::F32,
                trainable: true,
                sharded,
            })
            .collect();
        ChunkLayout::build(&params, ranks, capacity)
    }

    #[test]
    fn whole_chunks_in_layout_order_up_to_the_fraction() {
        // Four sharded parameters of 100, 100, 200 and 100 elements, one per chunk, and a
        // replicated one between them: 500 sharded elements over 2 ranks.
        let layout = layout(
            &[
                (100, true),
                (100, true),
                (10, false),
                (200, true),
                (100, true),
            ],
            2,
            None,
        );
        assert_eq!(host_chunks(&layout, 0.0), Vec::<usize>::new());
        assert_eq!(host_chunks(&layout, 0.2), vec![0]);
        // Shards of 200, 200, 400 and 200 bytes (1000 in all): half takes the first two, and
        // the third would pass 500.
        assert_eq!(host_chunks(&layout, 0.5), vec![0, 1]);
        assert_eq!(host_chunks(&layout, 0.8), vec![0, 1, 3]);
        assert_eq!(host_chunks(&layout, 1.0), vec![0, 1, 3, 4]);
    }

    #[test]
    fn the_room_takes_whole_chunks_in_layout_order() {
        let layout = layout(&[(100, true), (100, true), (200, true)], 2, None);
        // Shards of 200, 200 and 400 bytes.
        assert_eq!(device_chunks(&layout, 0), Vec::<usize>::new());
        assert_eq!(device_chunks(&layout, 399), vec![0]);
        assert_eq!(device_chunks(&layout, 400), vec![0, 1]);
        assert_eq!(device_chunks(&layout, 799), vec![0, 1]);
        assert_eq!(device_chunks(&layout, 800), vec![0, 1, 2]);
    }

    #[test]
    fn the_optimizer_fraction_counts_replicated_chunks_too() {
        // Shards of 200, 200 and 40 bytes (the replicated chunk's 10 elements whole, on each
        // rank) in layout order: 440 bytes.
        let layout = layout(&[(100, true), (100, true), (10, false)], 2, None);
        assert_eq!(optimizer_host_chunks(&layout, 0.0), Vec::<usize>::new());
        assert_eq!(optimizer_host_chunks(&layout, 0.5), vec![0]);
        assert_eq!(optimizer_host_chunks(&layout, 0.95), vec![0, 1]);
        assert_eq!(optimizer_host_chunks(&layout, 1.0), vec![0, 1, 2]);
    }

    #[test]
    fn replicated_chunks_never_move() {
        let layout = layout(&[(10, false), (20, false)], 2, None);
        assert!(host_chunks(&layout, 1.0).is_empty());
    }
}
