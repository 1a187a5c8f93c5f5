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
    /// every rank, or gathers and reductions would pair different tensors. (FNV-1a over the
    /// number of chunks and every parameter's chunk and index, so it is the same on every
    /// platform and run.)
    pub fn digest(&self) -> u64 {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut mix = |value: usize| {
            for byte in (value as u64).to_le_bytes() {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        mix(self.chunks.len());
        for &(chunk, index) in &self.places {
            mix(chunk);
            mix(index);
        }
        hash
    }
}
