//! `ChunkSize`: how large chunks are, given outright or searched for.

use serde::{Deserialize, Serialize};

use crate::chunk::layout::{ChunkKind, ChunkLayout, ChunkParam};

/// How the parameters of a sharded module are grouped into chunks (`ZeroConfig::chunk_size`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ChunkSize {
    /// One parameter per chunk: each parameter is gathered on its own and gradients go in
    /// buckets of `bucket_size_mb` (the layout before chunks, kept for comparison).
    PerParameter,
    /// Chunks of at most this many elements, all ranks' shards together.
    Elements(usize),
    /// Chunks of at most this many MiB of the parameters' dtype, all ranks' shards together.
    MiB(f64),
    /// The size [`ChunkSearch`] finds for the module.
    Search(ChunkSearch),
}

impl Default for ChunkSize {
    fn default() -> Self {
        ChunkSize::Search(ChunkSearch::default())
    }
}

/// The chunk-size search (ColossalAI Gemini's `search_chunk_configuration`, adapted).
///
/// Candidates run from the largest sharded parameter, rounded up to `interval` elements, in
/// steps of `interval`, up to a cap: the size that leaves the module at least `min_chunks`
/// sharded chunks, and no larger than the live-gather budget allows with room for the
/// prefetch depth (`max_live_gathered_bytes / (prefetch + 2)`); parameters far larger than
/// the rest (above the mean plus three standard deviations) are left out of the search and
/// get chunks of their own. Each candidate packs the module; the one whose chunks are the
/// most even wins — the least padding a buffer sized to the largest chunk would hold,
/// `largest chunk × chunks − parameters` — and among equals the larger (fewer collectives).
/// Chunks hold exactly their members, so that padding is a measure of evenness, not memory:
/// the only padding stored or sent is each parameter's round-up to a whole block per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkSearch {
    /// Step between candidate sizes, in elements.
    pub interval: usize,
    /// The fewest sharded chunks a module is split into (unless single parameters are larger):
    /// fewer, larger chunks cost fewer collectives but gather more at once.
    pub min_chunks: usize,
}

impl Default for ChunkSearch {
    fn default() -> Self {
        Self {
            interval: 1024,
            min_chunks: 8,
        }
    }
}

/// What the search needs to know besides the parameters.
#[derive(Debug, Clone, Copy)]
pub struct SearchLimits {
    /// Ranks each sharded parameter is split over.
    pub ranks: usize,
    /// Bytes of gathered parameters that may be alive at once.
    pub gather_budget_bytes: usize,
    /// Gathers that may run ahead of use.
    pub prefetch: usize,
}

impl ChunkSize {
    /// The searched size with the search's defaults.
    pub fn default_search() -> Self {
        ChunkSize::Search(ChunkSearch::default())
    }

    /// Checks a size that cannot work over `ranks` ranks.
    pub fn validate(&self, ranks: usize) -> Result<(), String> {
        match *self {
            ChunkSize::PerParameter => Ok(()),
            ChunkSize::Elements(n) if n == 0 || n < ranks => Err(format!(
                "chunk_size of {n} elements is smaller than the {ranks} ranks it is split over"
            )),
            ChunkSize::Elements(_) => Ok(()),
            ChunkSize::MiB(mib) if !(mib.is_finite() && mib > 0.0) => {
                Err(format!("chunk_size of {mib} MiB must be a positive number"))
            }
            ChunkSize::MiB(_) => Ok(()),
            ChunkSize::Search(search) if search.interval == 0 || search.min_chunks == 0 => {
                Err(format!(
                    "chunk search interval ({}) and min_chunks ({}) must be at least 1",
                    search.interval, search.min_chunks
                ))
            }
            ChunkSize::Search(_) => Ok(()),
        }
    }

    /// The chunk capacity in elements for `params`, or `None` for one parameter per chunk.
    pub fn capacity(&self, params: &[ChunkParam], limits: &SearchLimits) -> Option<usize> {
        match *self {
            ChunkSize::PerParameter => None,
            ChunkSize::Elements(n) => Some(n.max(limits.ranks)),
            ChunkSize::MiB(mib) => {
                let bytes = params.iter().map(|p| p.dtype.size()).max().unwrap_or(4);
                let elements = (mib * (1u64 << 20) as f64) as usize / bytes;
                Some(elements.max(limits.ranks))
            }
            ChunkSize::Search(search) => Some(search.run(params, limits)),
        }
    }

    /// The layout of `params` under this size.
    pub fn layout(&self, params: &[ChunkParam], limits: &SearchLimits) -> ChunkLayout {
        ChunkLayout::build(params, limits.ranks, self.capacity(params, limits))
    }
}

impl ChunkSearch {
    /// The chunk capacity (elements) for `params`.
    pub fn run(&self, params: &[ChunkParam], limits: &SearchLimits) -> usize {
        let ranks = limits.ranks.max(1);
        let round = |n: usize| n.div_ceil(ranks) * ranks;
        let sizes: Vec<usize> = params
            .iter()
            .filter(|p| p.sharded)
            .map(|p| round(p.numel))
            .collect();
        let Some(&largest) = inliers(&sizes).iter().max() else {
            // Nothing sharded: replicated chunks only, one all-reduce per chunk of the
            // budget's size at most.
            return self.budget(params, limits).max(ranks);
        };
        let total: usize = sizes.iter().sum();
        let start = largest.div_ceil(self.interval) * self.interval;
        let cap = (total / self.min_chunks)
            .min(self.budget(params, limits))
            .max(start);
        let mut best: Option<(usize, usize)> = None;
        let mut candidate = start;
        while candidate <= cap {
            let layout = ChunkLayout::build(params, ranks, Some(candidate));
            let sharded: Vec<usize> = layout
                .chunks()
                .iter()
                .filter(|c| c.kind == ChunkKind::Sharded)
                .map(|c| c.gathered_len(ranks))
                .collect();
            let widest = sharded.iter().copied().max().unwrap_or(0);
            let uneven = widest * sharded.len() - sharded.iter().sum::<usize>();
            if best.is_none_or(|(score, _)| uneven <= score) {
                best = Some((uneven, candidate));
            }
            candidate += self.interval;
        }
        best.map_or(start, |(_, size)| size)
    }

    /// The largest chunk the live-gather budget holds with room for the prefetch depth, in
    /// elements of the widest dtype.
    fn budget(&self, params: &[ChunkParam], limits: &SearchLimits) -> usize {
        let bytes = params.iter().map(|p| p.dtype.size()).max().unwrap_or(4);
        (limits.gather_budget_bytes / bytes / (limits.prefetch + 2)).max(1)
    }
}

/// The sizes not above the mean plus three standard deviations (all of them when there are
/// too few to tell).
fn inliers(sizes: &[usize]) -> Vec<usize> {
    if sizes.len() < 3 {
        return sizes.to_vec();
    }
    let n = sizes.len() as f64;
    let mean = sizes.iter().map(|&s| s as f64).sum::<f64>() / n;
    let variance = sizes
        .iter()
        .map(|&s| (s as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    let limit = mean + 3.0 * variance.sqrt();
    sizes
        .iter()
        .copied()
        .filter(|&s| s as f64 <= limit)
        .collect()
}
