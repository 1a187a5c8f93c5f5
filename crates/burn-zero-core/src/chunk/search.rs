//! `ChunkSize`: how large chunks are, given outright or searched for.

use serde::{Deserialize, Serialize};

use crate::chunk::layout::{ChunkKind, ChunkLayout, ChunkParam};

/// How the parameters of a sharded module are grouped into chunks (`ZeroConfig::chunk_size`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub enum ChunkSize {
    /// The default: the searched size ([`ChunkSize::default_search`]) on device backends
    /// (`CubeBackend` over wgpu and CUDA, Burn's fusion backends over them, and every backend
    /// whose tensors are not in host memory), where each collective, kernel launch and
    /// synchronisation has a fixed cost and chunks cut their number by half or more; one
    /// parameter per chunk on the host backends Flex and NdArray, where a step with the
    /// searched size is not yet as fast in every measured run (see `docs/benchmarks.md`).
    /// [`ChunkSize::resolve`] makes the choice at `shard`.
    #[default]
    Auto,
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

/// The chunk-size search (ColossalAI Gemini's `search_chunk_configuration`, adapted).
///
/// Candidates run from the largest sharded parameter, rounded up to `interval` elements, in
/// steps of `interval`, up to a cap: the size that leaves the module at least `min_chunks`
/// sharded chunks, and no larger than the live-gather budget allows with room for the
/// prefetch depth (`max_live_gathered_bytes / (prefetch + 2)`); parameters far larger than
/// the rest (above the mean plus three standard deviations) are left out of the search and
/// get chunks of their own. A budget smaller than the largest parameter is itself the
/// capacity (the parameters larger than it alone, the rest in chunks that fit it). Each
/// candidate packs the module; the one whose chunks are the
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

    /// What this size is on a backend whose tensors are in host memory (`host_backend`) or
    /// not: [`ChunkSize::Auto`] becomes one parameter per chunk or the searched size; every
    /// other size is itself.
    pub fn resolve(self, host_backend: bool) -> Self {
        match self {
            ChunkSize::Auto if host_backend => ChunkSize::PerParameter,
            ChunkSize::Auto => ChunkSize::default_search(),
            size => size,
        }
    }

    /// Checks a size that cannot work over `ranks` ranks.
    pub fn validate(&self, ranks: usize) -> Result<(), String> {
        match *self {
            ChunkSize::Auto | ChunkSize::PerParameter => Ok(()),
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
    /// [`ChunkSize::Auto`] counts as a device backend's choice here (`shard` resolves it for
    /// its backend first).
    pub fn capacity(&self, params: &[ChunkParam], limits: &SearchLimits) -> Option<usize> {
        match *self {
            ChunkSize::Auto => ChunkSize::default_search().capacity(params, limits),
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
        let budget = self.budget(params, limits);
        let Some(&largest) = inliers(&sizes).iter().max() else {
            // Nothing sharded: replicated chunks only, one all-reduce per chunk of the
            // budget's size at most.
            return budget.max(ranks);
        };
        let total: usize = sizes.iter().sum();
        let start = largest.div_ceil(self.interval) * self.interval;
        if budget < start {
            // The budget (with room for the prefetch depth) is the capacity: parameters larger
            // than it get chunks of their own, the others share chunks that fit it.
            return budget;
        }
        // At least `min_chunks` chunks, unless single parameters are larger; never past the
        // budget.
        let cap = (total / self.min_chunks).max(start).min(budget);
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

#[cfg(test)]
mod tests {
    //! The expectations are written out by hand (the validation messages, the capacities) or
    //! are properties of the searched layout on the GPT presets' parameter lists, built here by
    //! hand in the model's visit order.

    use burn::tensor::DType;

    use super::*;
    use crate::chunk::layout::Chunk;

    #[test]
    fn auto_is_one_parameter_per_chunk_on_host_backends_and_the_search_elsewhere() {
        assert_eq!(ChunkSize::default(), ChunkSize::Auto);
        assert_eq!(ChunkSize::Auto.resolve(true), ChunkSize::PerParameter);
        assert_eq!(ChunkSize::Auto.resolve(false), ChunkSize::default_search());
        for size in [
            ChunkSize::PerParameter,
            ChunkSize::Elements(4096),
            ChunkSize::MiB(2.0),
            ChunkSize::default_search(),
        ] {
            assert_eq!(size.resolve(true), size);
            assert_eq!(size.resolve(false), size);
        }
    }

    #[test]
    fn sizes_that_cannot_work_are_refused_by_name() {
        let refused = |size: ChunkSize, ranks: usize| {
            size.validate(ranks)
                .expect_err(&format!("{size:?} over {ranks} ranks must be refused"))
        };
        let message = refused(ChunkSize::Elements(0), 1);
        assert!(message.contains("chunk_size of 0 elements"), "{message}");
        let message = refused(ChunkSize::Elements(0), 4);
        assert!(message.contains("chunk_size of 0 elements"), "{message}");
        let message = refused(ChunkSize::Elements(3), 4);
        assert_eq!(
            message,
            "chunk_size of 3 elements is smaller than the 4 ranks it is split over"
        );
        ChunkSize::Elements(4).validate(4).unwrap();
        ChunkSize::Elements(1).validate(1).unwrap();
        for mib in [0.0, -0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let message = refused(ChunkSize::MiB(mib), 2);
            assert_eq!(
                message,
                format!("chunk_size of {mib} MiB must be a positive number")
            );
        }
        ChunkSize::MiB(1e-9).validate(2).unwrap();
        ChunkSize::MiB(4.0).validate(2).unwrap();
        let search = |interval, min_chunks| {
            ChunkSize::Search(ChunkSearch {
                interval,
                min_chunks,
            })
        };
        assert_eq!(
            refused(search(0, 8), 2),
            "chunk search interval (0) and min_chunks (8) must be at least 1"
        );
        assert_eq!(
            refused(search(1024, 0), 2),
            "chunk search interval (1024) and min_chunks (0) must be at least 1"
        );
        search(1, 1).validate(2).unwrap();
        ChunkSize::default_search().validate(8).unwrap();
        ChunkSize::PerParameter.validate(8).unwrap();
    }

    fn param(key: usize, numel: usize, dtype: DType) -> ChunkParam {
        ChunkParam {
            key,
            numel,
            dtype,
            trainable: true,
            sharded: true,
        }
    }

    fn limits(ranks: usize) -> SearchLimits {
        SearchLimits {
            ranks,
            gather_budget_bytes: 512 << 20,
            prefetch: 0,
        }
    }

    #[test]
    fn given_sizes_are_capacities_in_elements_of_the_widest_dtype() {
        let f32s = [param(0, 10, DType::F32)];
        let f16s = [param(0, 10, DType::F16)];
        let mixed = [param(0, 10, DType::F16), param(1, 10, DType::F32)];
        assert_eq!(ChunkSize::PerParameter.capacity(&f32s, &limits(2)), None);
        assert_eq!(
            ChunkSize::Elements(256).capacity(&f32s, &limits(2)),
            Some(256)
        );
        // 1 MiB: 262144 f32 elements, 524288 f16 ones; mixed dtypes count in the widest.
        assert_eq!(
            ChunkSize::MiB(1.0).capacity(&f32s, &limits(2)),
            Some(262_144)
        );
        assert_eq!(
            ChunkSize::MiB(1.0).capacity(&f16s, &limits(2)),
            Some(524_288)
        );
        assert_eq!(
            ChunkSize::MiB(1.0).capacity(&mixed, &limits(2)),
            Some(262_144)
        );
        // Never below one element per rank.
        assert_eq!(ChunkSize::MiB(1e-9).capacity(&f32s, &limits(3)), Some(3));
    }

    /// The `train_gpt` model's parameters in visit order, as `shard` sees them with the
    /// example's `--persist-below 1024`: tokens (76 symbols of the corpus) and positions (64,
    /// the sequence length) embeddings, then each of Burn's `TransformerEncoderLayer`s —
    /// attention's query, key, value and output `Linear`s (weight `d × d`, bias `d`), the
    /// feed-forward's inner (`d × 4d`, bias `4d`) and outer (`4d × d`, bias `d`) `Linear`s,
    /// `norm_1` and `norm_2` (`LayerNorm`: gamma and beta of `d`) — then the final norm.
    /// Returns the parameters and, per layer, the range of their keys.
    fn gpt(d: usize, layers: usize) -> (Vec<ChunkParam>, Vec<std::ops::Range<usize>>) {
        const PERSIST_BELOW: usize = 1024;
        let mut numels = vec![76 * d, 64 * d];
        let mut blocks = Vec::new();
        for _ in 0..layers {
            let first = numels.len();
            // query, key, value, output: weight, bias.
            for _ in 0..4 {
                numels.extend([d * d, d]);
            }
            // The feed-forward's inner and outer linears: weight, bias.
            numels.extend([d * 4 * d, 4 * d, 4 * d * d, d]);
            // norm_1, norm_2: gamma, beta.
            numels.extend([d; 4]);
            blocks.push(first..numels.len());
        }
        // The final norm.
        numels.extend([d, d]);
        let params = numels
            .into_iter()
            .enumerate()
            .map(|(key, numel)| ChunkParam {
                key,
                numel,
                dtype: DType::F32,
                trainable: true,
                sharded: numel >= PERSIST_BELOW,
            })
            .collect();
        (params, blocks)
    }

    #[test]
    fn the_gpt_parameter_lists_are_the_models() {
        // small: d = 192, 4 layers; 1 806 720 parameters (README: 1.81M), every bias and norm
        // of d = 192 or 4d = 768 elements replicated under the 1024 threshold.
        let (small, blocks) = gpt(192, 4);
        assert_eq!(small.len(), 2 + 4 * 16 + 2);
        assert_eq!(small.iter().map(|p| p.numel).sum::<usize>(), 1_806_720);
        assert_eq!(small.iter().filter(|p| p.sharded).count(), 2 + 4 * 6);
        assert_eq!(blocks[0], 2..18);
        assert_eq!(blocks[3], 50..66);
        // base: d = 384, 6 layers; 10 701 312 parameters (about 10.7M, as `Preset::Base` says),
        // and the inner bias (4d = 1536) is sharded.
        let (base, _) = gpt(384, 6);
        assert_eq!(base.iter().map(|p| p.numel).sum::<usize>(), 10_701_312);
        assert_eq!(base.iter().filter(|p| p.sharded).count(), 2 + 6 * 7);
    }

    /// The gather budgets the search is checked under: `ZeroConfig`'s default
    /// `max_live_gathered_bytes` (512 MiB) without and with prefetch, and two budgets smaller
    /// than the models' largest parameter would need with the prefetch room.
    const BUDGETS: [(usize, usize); 4] =
        [(512 << 20, 0), (512 << 20, 2), (4 << 20, 1), (2 << 20, 2)];

    /// What the issue asks of the searched layout on a GPT: sharded chunks that fit the gather
    /// budget with room for the prefetch depth (a chunk that does not is one parameter larger
    /// than that room), never one chunk for the whole model, padding at most 1% of the
    /// parameters. Returns the layout.
    fn searched(
        params: &[ChunkParam],
        ranks: usize,
        (budget, prefetch): (usize, usize),
    ) -> ChunkLayout {
        let limits = SearchLimits {
            ranks,
            gather_budget_bytes: budget,
            prefetch,
        };
        let layout = ChunkSize::default_search().layout(params, &limits);
        let what = format!("{ranks} ranks, budget {budget} B, prefetch {prefetch}");
        let room = budget / (prefetch + 2);
        let sharded: Vec<&Chunk> = layout
            .chunks()
            .iter()
            .filter(|c| c.kind == ChunkKind::Sharded)
            .collect();
        for chunk in &sharded {
            let bytes = chunk.gathered_len(ranks) * 4;
            assert!(
                bytes <= room || chunk.members.len() == 1,
                "{what}: chunk {} of {} members gathers {bytes} B, more than the {room} B the \
                 budget leaves each of prefetch + 2 gathers",
                chunk.id,
                chunk.members.len()
            );
        }
        let sharded_params = params.iter().filter(|p| p.sharded).count();
        assert!(sharded.len() > 1, "{what}: one sharded chunk");
        assert!(
            sharded.iter().all(|c| c.members.len() < sharded_params),
            "{what}: one chunk holds every sharded parameter"
        );
        let numel: usize = params.iter().map(|p| p.numel).sum();
        assert!(
            layout.padding(ranks) * 100 <= numel,
            "{what}: padding {} of {numel} parameters",
            layout.padding(ranks)
        );
        // Every parameter has its place, once.
        let mut placed: Vec<usize> = layout
            .chunks()
            .iter()
            .flat_map(|c| c.members.iter().map(|m| m.key))
            .collect();
        placed.sort_unstable();
        assert_eq!(placed, (0..params.len()).collect::<Vec<_>>(), "{what}");
        layout
    }

    #[test]
    fn the_search_gives_gpt_small_a_sharded_chunk_per_block_within_the_gather_budget() {
        let (small, blocks) = gpt(192, 4);
        for ranks in [2, 4] {
            for budget in BUDGETS {
                let layout = searched(&small, ranks, budget);
                let sharded: Vec<&Chunk> = layout
                    .chunks()
                    .iter()
                    .filter(|c| c.kind == ChunkKind::Sharded)
                    .collect();
                assert!(
                    sharded.len() >= blocks.len(),
                    "{ranks} ranks, {budget:?}: {} sharded chunks for {} blocks",
                    sharded.len(),
                    blocks.len()
                );
                // Each block's first use starts a sharded chunk inside it: gathers follow the
                // blocks rather than spanning the model.
                for (layer, keys) in blocks.iter().enumerate() {
                    assert!(
                        sharded.iter().any(|c| keys.contains(&c.first_key())),
                        "{ranks} ranks, {budget:?}: no sharded chunk starts in block {layer}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_search_keeps_gpt_base_within_the_gather_budget_with_little_padding() {
        let (base, _) = gpt(384, 6);
        for ranks in [2, 4] {
            for budget in BUDGETS {
                searched(&base, ranks, budget);
            }
        }
    }

    #[test]
    fn odd_parameter_sizes_keep_the_padding_to_each_parameters_round_up() {
        // The GPT lists divide evenly by 2, 3 and 4 ranks; sizes off by one leave each sharded
        // parameter ranks - 1 elements of padding, still far below 1%.
        let (mut small, _) = gpt(192, 4);
        for p in small.iter_mut().filter(|p| p.sharded) {
            p.numel += 1;
        }
        for ranks in [2, 3, 4] {
            let layout = searched(&small, ranks, BUDGETS[0]);
            let sharded = small.iter().filter(|p| p.sharded).count();
            // Every sharded size of GPT small is a multiple of 12 (d = 192 = 16 · 12), so one
            // more element leaves each parameter ranks - 1 zeros at 2, 3 and 4 ranks.
            assert_eq!(
                layout.padding(ranks),
                sharded * (ranks - 1),
                "{ranks} ranks"
            );
        }
    }
}
