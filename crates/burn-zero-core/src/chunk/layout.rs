//! `ChunkLayout`: which parameters share a chunk, in which order, and where each one's blocks
//! sit in the chunk's shard.

use burn::tensor::DType;

use crate::chunk::block::BlockLayout;

/// What the layout needs to know of a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkParam {
    /// The parameter's key: its position in module visit order (keys run 0, 1, … with no gap).
    pub key: usize,
    /// Elements.
    pub numel: usize,
    pub dtype: DType,
    /// Whether it trains (frozen parameters get chunks of their own kind).
    pub trainable: bool,
    /// Whether it is split over the ranks (its gradient reduce-scattered): every parameter at
    /// stages 1 and 2 and those above the persistence threshold at stage 3; at stage 0 none.
    pub sharded: bool,
}

/// Whether a chunk is split across the ranks or kept whole on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkKind {
    /// Sharded: every rank holds its shard; the chunk is all-gathered for use and its
    /// gradients reduce-scattered.
    Sharded,
    /// Replicated (parameters below the persistence threshold, and every parameter below
    /// stage 3): whole on every rank; its gradients are all-reduced.
    Replicated,
}

/// One parameter's place in its chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkMember {
    /// The parameter's key (module visit order).
    pub key: usize,
    /// Elements of the parameter.
    pub numel: usize,
    /// Elements of each rank's block of it (`numel` for a replicated chunk).
    pub block_len: usize,
    /// Where its block starts in the chunk's shard (in the whole chunk, for a replicated one).
    pub offset: usize,
}

impl ChunkMember {
    /// Where its block lies in the chunk's shard.
    pub fn block(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.block_len
    }
}

/// A group of parameters gathered, reduced and stepped as one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The chunk's index in the layout.
    pub id: usize,
    pub kind: ChunkKind,
    /// The members' element type (a chunk never mixes dtypes).
    pub dtype: DType,
    /// Whether its members train (frozen and trainable parameters never share a chunk).
    pub trainable: bool,
    /// Members in visit order, which is their order in the shard.
    pub members: Vec<ChunkMember>,
    /// Elements of each rank's shard: the sum of the members' blocks (the whole chunk when
    /// replicated).
    pub shard_len: usize,
}

impl Chunk {
    /// Whether `ranges`, one per member in member order, of a row of `row_len` elements are
    /// exactly the members' blocks of a shard of this chunk: the row is then the shard.
    pub fn is_tiled_by(
        &self,
        row_len: usize,
        ranges: impl IntoIterator<Item = std::ops::Range<usize>>,
    ) -> bool {
        let mut ranges = ranges.into_iter();
        row_len == self.shard_len
            && self
                .members
                .iter()
                .all(|member| ranges.next() == Some(member.block()))
            && ranges.next().is_none()
    }

    /// Elements of the whole chunk over the `ranks` it is sharded over (what one gather
    /// produces), padding of each member's round-up included.
    pub fn gathered_len(&self, ranks: usize) -> usize {
        match self.kind {
            ChunkKind::Sharded => self.shard_len * ranks,
            ChunkKind::Replicated => self.shard_len,
        }
    }

    /// Elements of the members themselves (no padding).
    pub fn numel(&self) -> usize {
        self.members.iter().map(|m| m.numel).sum()
    }

    /// The smallest member key: the chunk's gradients are complete once that member's is,
    /// since backward finishes parameters in roughly reverse visit order.
    pub fn first_key(&self) -> usize {
        self.members.first().map_or(0, |m| m.key)
    }
}

/// Every chunk of a sharded module on one rank, and which chunk each parameter is in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChunkLayout {
    chunks: Vec<Chunk>,
    /// For each parameter key: its chunk and its index among the chunk's members.
    places: Vec<(usize, usize)>,
    /// Whether every chunk holds one parameter (the layout of `ChunkSize::PerParameter`).
    per_parameter: bool,
    /// The capacity it was packed with: elements a chunk gathers at most, unless one member
    /// alone is larger.
    capacity: Option<usize>,
}

/// What decides a parameter's group: chunks only take parameters of one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    kind: ChunkKind,
    dtype: DType,
    trainable: bool,
}

impl ChunkLayout {
    /// Packs `params` (visit order, keys 0..n) into chunks of at most `capacity` elements per
    /// rank shard times `ranks` — `None`: one parameter per chunk. Each group (sharded or
    /// replicated, dtype, trainable or frozen) fills its own open chunk in visit order; a
    /// parameter that does not fit closes it, and one larger than the capacity gets a chunk of
    /// its own. Chunks hold exactly their members: no padding past the members' own round-up.
    pub fn build(params: &[ChunkParam], ranks: usize, capacity: Option<usize>) -> Self {
        let mut chunks: Vec<Chunk> = Vec::new();
        let mut places = vec![(0, 0); params.len()];
        // The open chunk of each group, by index into `chunks`.
        let mut open: Vec<(Group, usize)> = Vec::new();
        for info in params {
            let group = Group {
                kind: if info.sharded {
                    ChunkKind::Sharded
                } else {
                    ChunkKind::Replicated
                },
                dtype: info.dtype,
                trainable: info.trainable,
            };
            let numel = info.numel;
            let block_len = match group.kind {
                ChunkKind::Sharded => BlockLayout::new(numel, ranks).block_len(),
                ChunkKind::Replicated => numel,
            };
            let gathered = match group.kind {
                ChunkKind::Sharded => block_len * ranks,
                ChunkKind::Replicated => numel,
            };
            let slot = open.iter().position(|(g, _)| *g == group);
            let fits = |chunk: &Chunk| {
                capacity.is_some_and(|capacity| chunk.gathered_len(ranks) + gathered <= capacity)
            };
            let target = match slot {
                Some(slot) if fits(&chunks[open[slot].1]) => open[slot].1,
                _ => {
                    let id = chunks.len();
                    chunks.push(Chunk {
                        id,
                        kind: group.kind,
                        dtype: group.dtype,
                        trainable: group.trainable,
                        members: Vec::new(),
                        shard_len: 0,
                    });
                    // A parameter alone past the capacity closes nothing: the group's open
                    // chunk stays open for the parameters after it.
                    let alone = capacity.is_none_or(|capacity| gathered > capacity);
                    match (slot, alone) {
                        (_, true) => {}
                        (Some(slot), false) => open[slot].1 = id,
                        (None, false) => open.push((group, id)),
                    }
                    id
                }
            };
            let chunk = &mut chunks[target];
            places[info.key] = (target, chunk.members.len());
            chunk.members.push(ChunkMember {
                key: info.key,
                numel,
                block_len,
                offset: chunk.shard_len,
            });
            chunk.shard_len += block_len;
        }
        Self {
            chunks,
            places,
            per_parameter: capacity.is_none(),
            capacity,
        }
    }

    /// Every chunk, by id (creation order: the visit order of their first members).
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// Parameter `key`'s chunk and its index among the chunk's members.
    pub fn place(&self, key: usize) -> Option<(&Chunk, usize)> {
        let &(chunk, index) = self.places.get(key)?;
        Some((&self.chunks[chunk], index))
    }

    /// Whether the layout is one parameter per chunk.
    pub fn is_per_parameter(&self) -> bool {
        self.per_parameter
    }

    /// The elements a chunk gathers at most (a member larger than this has a chunk of its
    /// own); `None` with one parameter per chunk.
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// Number of chunks of `kind`.
    pub fn count(&self, kind: ChunkKind) -> usize {
        self.chunks.iter().filter(|c| c.kind == kind).count()
    }

    /// Elements of padding a rank holds: each sharded member's round-up to a whole number of
    /// blocks, over its shards.
    pub fn padding(&self, ranks: usize) -> usize {
        self.chunks
            .iter()
            .filter(|c| c.kind == ChunkKind::Sharded)
            .flat_map(|c| &c.members)
            .map(|m| m.block_len * ranks - m.numel)
            .sum()
    }

    /// A digest every rank can compare: the same parameters must have the same places on
    /// every rank, in chunks of the same kind, dtype and trainability, with their blocks at the
    /// same offsets, or gathers and reductions would pair different tensors (a reduce-scatter
    /// with an all-reduce, an f32 buffer with an f16 one). FNV-1a over the whole layout — one
    /// parameter per chunk or not, then each chunk with its members — so it is the same on
    /// every platform and run.
    pub fn digest(&self) -> u64 {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut mix = |bytes: &[u8]| {
            for &byte in bytes {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        let word = |value: usize| (value as u64).to_le_bytes();
        mix(&word(usize::from(self.per_parameter)));
        mix(&word(self.chunks.len()));
        for chunk in &self.chunks {
            let kind = match chunk.kind {
                ChunkKind::Sharded => 0,
                ChunkKind::Replicated => 1,
            };
            mix(&word(kind));
            let dtype = format!("{:?}", chunk.dtype);
            mix(&word(dtype.len()));
            mix(dtype.as_bytes());
            mix(&word(usize::from(chunk.trainable)));
            mix(&word(chunk.shard_len));
            mix(&word(chunk.members.len()));
            for member in &chunk.members {
                for value in [member.key, member.numel, member.block_len, member.offset] {
                    mix(&word(value));
                }
            }
        }
        hash
    }
}

#[cfg(test)]
mod tests {
    //! Every expectation below is written out by hand from the packing rule, not computed with
    //! the layout code.

    use super::*;

    fn param(key: usize, numel: usize, sharded: bool) -> ChunkParam {
        ChunkParam {
            key,
            numel,
            dtype: DType::F32,
            trainable: true,
            sharded,
        }
    }

    fn member(key: usize, numel: usize, block_len: usize, offset: usize) -> ChunkMember {
        ChunkMember {
            key,
            numel,
            block_len,
            offset,
        }
    }

    /// The members' keys of every chunk, in chunk order.
    fn keys(layout: &ChunkLayout) -> Vec<Vec<usize>> {
        layout
            .chunks()
            .iter()
            .map(|c| c.members.iter().map(|m| m.key).collect())
            .collect()
    }

    /// A row is the shard when its ranges are the members' blocks in member order, no more and
    /// no fewer, and it has the shard's length.
    #[test]
    fn a_row_tiles_a_chunk_only_with_every_members_block_in_order() {
        // Two ranks: blocks of 3 and 2 elements.
        let layout = ChunkLayout::build(&[param(0, 5, true), param(1, 3, true)], 2, Some(16));
        let chunk = &layout.chunks()[0];
        assert_eq!(chunk.members, [member(0, 5, 3, 0), member(1, 3, 2, 3)]);
        assert!(chunk.is_tiled_by(5, [0..3, 3..5]));
        assert!(!chunk.is_tiled_by(6, [0..3, 3..5]), "a longer row");
        assert!(!chunk.is_tiled_by(5, [3..5, 0..3]), "out of order");
        assert!(
            !chunk.is_tiled_by(5, std::iter::once(0..3)),
            "a member missing"
        );
        assert!(
            !chunk.is_tiled_by(5, [0..3, 3..5, 5..5]),
            "a range too many"
        );
        assert!(!chunk.is_tiled_by(5, [0..2, 2..5]), "other boundaries");
    }

    /// Sharded f32, replicated f32, sharded f16, frozen sharded f32 and frozen replicated f32,
    /// interleaved twice in visit order.
    fn interleaved_groups() -> [ChunkParam; 9] {
        let f16 = |p: ChunkParam| ChunkParam {
            dtype: DType::F16,
            ..p
        };
        let frozen = |p: ChunkParam| ChunkParam {
            trainable: false,
            ..p
        };
        [
            param(0, 10, true),
            param(1, 3, false),
            f16(param(2, 10, true)),
            frozen(param(3, 10, true)),
            param(4, 10, true),
            param(5, 3, false),
            f16(param(6, 10, true)),
            frozen(param(7, 10, true)),
            frozen(param(8, 3, false)),
        ]
    }

    /// The chunks of [`interleaved_groups`] over 2 ranks, a chunk per group in the order each
    /// group first appears, written out by hand.
    fn interleaved_chunks() -> Vec<Chunk> {
        let chunk = |id, kind, dtype, trainable, members, shard_len| Chunk {
            id,
            kind,
            dtype,
            trainable,
            members,
            shard_len,
        };
        use ChunkKind::{Replicated, Sharded};
        let (f32, f16) = (DType::F32, DType::F16);
        vec![
            // Sharded f32 trainable: blocks of 5 over 2 ranks, end to end.
            chunk(
                0,
                Sharded,
                f32,
                true,
                vec![member(0, 10, 5, 0), member(4, 10, 5, 5)],
                10,
            ),
            // Replicated: whole on every rank, block = numel.
            chunk(
                1,
                Replicated,
                f32,
                true,
                vec![member(1, 3, 3, 0), member(5, 3, 3, 3)],
                6,
            ),
            chunk(
                2,
                Sharded,
                f16,
                true,
                vec![member(2, 10, 5, 0), member(6, 10, 5, 5)],
                10,
            ),
            chunk(
                3,
                Sharded,
                f32,
                false,
                vec![member(3, 10, 5, 0), member(7, 10, 5, 5)],
                10,
            ),
            chunk(4, Replicated, f32, false, vec![member(8, 3, 3, 0)], 3),
        ]
    }

    #[test]
    fn groups_interleaved_in_visit_order_each_fill_their_own_chunk() {
        // Every parameter fits the capacity with its group.
        let layout = ChunkLayout::build(&interleaved_groups(), 2, Some(100));
        assert_eq!(layout.chunks(), interleaved_chunks().as_slice());
        assert!(!layout.is_per_parameter());
        assert_eq!(layout.count(ChunkKind::Sharded), 3);
        assert_eq!(layout.count(ChunkKind::Replicated), 2);
        // Places: (chunk, index among its members).
        let places: Vec<(usize, usize)> = (0..9)
            .map(|key| {
                let (chunk, index) = layout.place(key).unwrap();
                (chunk.id, index)
            })
            .collect();
        let want = [
            (0, 0),
            (1, 0),
            (2, 0),
            (3, 0),
            (0, 1),
            (1, 1),
            (2, 1),
            (3, 1),
            (4, 0),
        ];
        assert_eq!(places, want);
        assert_eq!(layout.place(9), None);
    }

    #[test]
    fn a_parameter_larger_than_the_capacity_is_alone_and_leaves_its_groups_chunk_open() {
        // Capacity 20 elements (all ranks' shards together), 2 ranks.
        let params = [
            param(0, 6, true),   // opens chunk 0: 6
            param(1, 50, true),  // 50 > 20: chunk 1, alone; chunk 0 stays open
            param(2, 8, true),   // chunk 0: 6 + 8 = 14
            param(3, 3, false),  // replicated: its own group, chunk 2
            param(4, 7, true),   // padded to 8: 14 + 8 = 22 > 20, closes chunk 0, opens 3
            param(5, 12, true),  // chunk 3: 8 + 12 = 20, exactly the capacity: fits
            param(6, 21, true),  // 21 (22 padded) > 20: chunk 4, alone; chunk 3 stays open
            param(7, 20, true),  // 20 is not larger than the capacity: 20 + 20 > 20, chunk 5
            param(8, 2, true),   // chunk 5 is full: 20 + 2 > 20, chunk 6
            param(9, 60, false), // replicated and too large: chunk 7, alone; chunk 2 stays open
            param(10, 4, false), // replicated: chunk 2, 3 + 4 = 7
        ];
        let layout = ChunkLayout::build(&params, 2, Some(20));
        assert_eq!(
            keys(&layout),
            [
                vec![0, 2],
                vec![1],
                vec![3, 10],
                vec![4, 5],
                vec![6],
                vec![7],
                vec![8],
                vec![9],
            ]
        );
        let shard_lens: Vec<usize> = layout.chunks().iter().map(|c| c.shard_len).collect();
        assert_eq!(shard_lens, [3 + 4, 25, 3 + 4, 4 + 6, 11, 10, 1, 60]);
        let gathered: Vec<usize> = layout.chunks().iter().map(|c| c.gathered_len(2)).collect();
        assert_eq!(gathered, [14, 50, 7, 20, 22, 20, 2, 60]);
        let alone = &layout.chunks()[1];
        assert_eq!(
            (alone.kind, alone.members.as_slice()),
            (ChunkKind::Sharded, [member(1, 50, 25, 0)].as_slice())
        );
    }

    #[test]
    fn offsets_shard_lengths_and_padding_over_two_and_three_ranks_with_odd_sizes() {
        // 7, 5, 1 and 9 elements sharded, and 5 replicated, all in one group each.
        let params = [
            param(0, 7, true),
            param(1, 5, true),
            param(2, 5, false),
            param(3, 1, true),
            param(4, 9, true),
        ];
        // 2 ranks: blocks of 4, 3, 1 and 5 elements.
        let two = ChunkLayout::build(&params, 2, Some(1000));
        assert_eq!(keys(&two), [vec![0, 1, 3, 4], vec![2]]);
        let sharded = &two.chunks()[0];
        assert_eq!(
            sharded.members,
            [
                member(0, 7, 4, 0),
                member(1, 5, 3, 4),
                member(3, 1, 1, 7),
                member(4, 9, 5, 8),
            ]
        );
        assert_eq!(sharded.shard_len, 13);
        assert_eq!(sharded.gathered_len(2), 26);
        assert_eq!(sharded.numel(), 22);
        assert_eq!(sharded.first_key(), 0);
        assert_eq!(two.chunks()[1].members, [member(2, 5, 5, 0)]);
        assert_eq!(two.chunks()[1].gathered_len(2), 5);
        // 8 - 7, 6 - 5, 2 - 1, 10 - 9; the replicated parameter has none.
        assert_eq!(two.padding(2), 4);
        assert_eq!(two.place(3).map(|(c, i)| (c.id, i)), Some((0, 2)));

        // 3 ranks: blocks of 3, 2, 1 and 3 elements.
        let three = ChunkLayout::build(&params, 3, Some(1000));
        let sharded = &three.chunks()[0];
        assert_eq!(
            sharded.members,
            [
                member(0, 7, 3, 0),
                member(1, 5, 2, 3),
                member(3, 1, 1, 5),
                member(4, 9, 3, 6),
            ]
        );
        assert_eq!(sharded.shard_len, 9);
        assert_eq!(sharded.gathered_len(3), 27);
        // 9 - 7, 6 - 5, 3 - 1, 9 - 9.
        assert_eq!(three.padding(3), 5);
        assert_eq!(three.chunks()[1].gathered_len(3), 5);
    }

    #[test]
    fn one_parameter_per_chunk_without_a_capacity() {
        let params = [param(0, 7, true), param(1, 5, false), param(2, 3, true)];
        let layout = ChunkLayout::build(&params, 2, None);
        assert!(layout.is_per_parameter());
        assert_eq!(keys(&layout), [vec![0], vec![1], vec![2]]);
        let members: Vec<&ChunkMember> = layout.chunks().iter().map(|c| &c.members[0]).collect();
        assert_eq!(
            members,
            [
                &member(0, 7, 4, 0),
                &member(1, 5, 5, 0),
                &member(2, 3, 2, 0)
            ]
        );
        assert_eq!(layout.padding(2), 1 + 1);
        assert_eq!(layout.count(ChunkKind::Sharded), 2);
        assert_eq!(layout.count(ChunkKind::Replicated), 1);
    }

    #[test]
    fn the_digest_is_equal_for_equal_layouts_and_differs_for_different_ones() {
        let params = [
            param(0, 7, true),
            param(1, 5, true),
            param(2, 5, false),
            param(3, 9, true),
        ];
        let layout = ChunkLayout::build(&params, 2, Some(16));
        // Built again, on another "rank": the same digest.
        assert_eq!(
            layout.digest(),
            ChunkLayout::build(&params, 2, Some(16)).digest()
        );
        assert_eq!(
            ChunkLayout::default().digest(),
            ChunkLayout::default().digest()
        );
        let differs = |other: ChunkLayout, what: &str| {
            assert_ne!(other, layout, "{what}: the layouts themselves differ");
            assert_ne!(other.digest(), layout.digest(), "{what}");
        };
        // Another packing: 0 and 1 (8 + 6 = 14) share at 16, not at 10.
        differs(ChunkLayout::build(&params, 2, Some(10)), "another capacity");
        differs(
            ChunkLayout::build(&params, 2, None),
            "one parameter per chunk",
        );
        differs(ChunkLayout::default(), "no parameters");
        // The layouts below put every parameter at the same place (chunk, index) as `layout`
        // does, and differ in what the ranks would pair: a reduce-scatter with an all-reduce,
        // an f32 buffer with an f16 one, a gradient with none, blocks of other lengths.
        let places = |layout: &ChunkLayout| -> Vec<(usize, usize)> {
            (0..4)
                .map(|key| layout.place(key).map(|(c, i)| (c.id, i)).unwrap())
                .collect()
        };
        assert_eq!(places(&layout), [(0, 0), (0, 1), (1, 0), (2, 0)]);
        let same_places = |other: ChunkLayout, what: &str| {
            assert_eq!(places(&other), places(&layout), "{what}");
            differs(other, what);
        };
        // 0, 1 and 3 replicated, 2 sharded: 7 + 5 share a chunk, 9 does not fit (21 > 16).
        let mut kinds = params;
        for p in &mut kinds {
            p.sharded = !p.sharded;
        }
        same_places(ChunkLayout::build(&kinds, 2, Some(16)), "kinds swapped");
        let mut half = params;
        for p in &mut half {
            p.dtype = DType::F16;
        }
        same_places(ChunkLayout::build(&half, 2, Some(16)), "another dtype");
        let mut frozen = params;
        for p in &mut frozen {
            p.trainable = false;
        }
        same_places(ChunkLayout::build(&frozen, 2, Some(16)), "frozen");
        // 8 elements instead of 7: the same blocks of 4, another size.
        let mut larger = params;
        larger[0].numel = 8;
        same_places(ChunkLayout::build(&larger, 2, Some(16)), "another size");
        // Three ranks: 9 + 6 = 15 still share a chunk, in blocks of 3 and 2.
        same_places(ChunkLayout::build(&params, 3, Some(16)), "three ranks");
        // Every parameter alone under a tiny capacity: the places of one parameter per chunk,
        // but gradients reduced per chunk rather than in `bucket_size_mb` buckets.
        let alone = ChunkLayout::build(&params, 2, Some(2));
        assert_eq!(keys(&alone), [vec![0], vec![1], vec![2], vec![3]]);
        let per_parameter = ChunkLayout::build(&params, 2, None);
        assert_ne!(alone, per_parameter);
        assert_ne!(alone.digest(), per_parameter.digest(), "per parameter");
    }
}
