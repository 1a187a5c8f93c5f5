//! Hybrid sharding (`ZeroConfig::shard_group_size`), without an optimizer: N ranks in N/S
//! shard groups of S contiguous ranks; each group shards the model over its S ranks and the
//! groups hold the same blocks.
//!
//! The order the mean gradient is added up in, which the reference below repeats on the host:
//! inside each shard group the ranks' gradients are added in rank order (the group's
//! reduce-scatter), then the groups' sums are added in group order (the all-reduce across the
//! groups), and the total is divided once by N. For N = 4, S = 2 that is
//! ((g0 + g1) + (g2 + g3)) / 4, which is not the flat order (((g0 + g1) + g2) + g3) / 4 of plain
//! sharding; the test checks that the two references differ, so matching one of them bit for
//! bit says which order was used. Each micro-batch's gradients are computed unsharded.
//!
//! Chunks (`ZeroConfig::chunk_size`) are laid out over the shard group's ranks and reduced in
//! the same two collectives per chunk: the reduced gradients stay bitwise, and the bytes moved
//! do not change.
//!
//! Training through `ZeroOptimizer` with hybrid sharding is checked in burn-zero-optim's
//! `tests/hybrid.rs`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::tensor::Tensor;
use burn_zero_comm::{CommError, Communicator, RankContext, ReduceOp, launch};
use burn_zero_core::chunk::{Chunk, ChunkKind, ChunkLayout};
use burn_zero_core::{ChunkSize, MemoryReport, ParamInfo, ZeroConfig, ZeroError, shard};
use burn_zero_testing::{Block, Train, base_model};
use common::{
    Values, assert_passes_equal, backward, passes, reference_pass, remark, values_bits_equal,
};

/// Passes of each run: the first reduces in the initial buckets, the later ones in the
/// buckets rebuilt for the order backward produced the gradients in.
const PASSES: usize = 3;

/// One parameter per chunk (gradient buckets of `bucket_size_mb`), and chunks of 256 elements,
/// which pack several parameters of the test block together over a shard group of 2 or 3
/// (checked by `chunks_of_256_elements_pack_several_parameters_per_shard_group`).
const CHUNK_SIZES: [ChunkSize; 2] = [ChunkSize::PerParameter, ChunkSize::Elements(256)];

fn config(stage: u8, shard: usize) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(stage)
        .with_shard_group_size(shard)
        .with_persist_below_numel(12)
        .with_bucket_size_mb(0.001)
}

/// The single-rank references of the `PASSES` passes over `world` ranks, the gradients added
/// up in groups of `group`.
fn references(base: &Block<Train>, world: usize, group: usize) -> Vec<(Vec<f32>, Values)> {
    (0..PASSES)
        .map(|index| reference_pass(base, index, world, group, |_, _| false))
        .collect()
}

/// Each rank's passes (micro-batch `pass · world + rank`): its loss and reduced gradients.
fn sharded(base: &Block<Train>, world: usize, config: &ZeroConfig) -> Vec<Vec<(f32, Values)>> {
    launch::<Flex, _, _, ZeroError>(world, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, config)?;
        let rank = (ctx.rank(), world);
        Ok(passes(model, &zero, PASSES, rank, |_, _| false).1)
    })
    .unwrap_or_else(|e| panic!("{world} ranks, {config:?}: {e}"))
}

#[test]
fn chunks_of_256_elements_pack_several_parameters_per_shard_group() {
    for (world, shard_group) in [(4, 2), (6, 3)] {
        let config = config(3, shard_group).with_chunk_size(ChunkSize::Elements(256));
        let layouts = launch::<Flex, _, _, ZeroError>(world, &[Default::default()], |ctx| {
            let (_model, zero) = shard(base_model(ctx.device()), &ctx, &config)?;
            Ok(zero.store().chunks().clone())
        })
        .unwrap();
        for (rank, layout) in layouts.iter().enumerate() {
            assert_eq!(layout, &layouts[0], "rank {rank}: every rank packs alike");
            let packed = layout
                .chunks()
                .iter()
                .filter(|c| c.members.len() > 1)
                .count();
            assert!(packed >= 2, "N = {world}, S = {shard_group}: {layout:?}");
            // Blocks over the shard group: a 130-element embedding is 65 or 44 elements.
            let (chunk, _) = layout.place(0).unwrap();
            assert_eq!(chunk.members[0].block_len, 130usize.div_ceil(shard_group));
        }
    }
}

/// Every rank's loss and reduced gradients, at every stage, with and without overlap, one
/// parameter per chunk or several, are bitwise the reference added up in hybrid order, which
/// differs from the flat order's.
#[test]
fn hybrid_gradients_are_the_mean_in_hybrid_order_bitwise() {
    let base = base_model(&Default::default());
    // (N, S): 2 groups of 2, 2 groups of 3, 3 groups of 2.
    for (world, shard) in [(4, 2), (6, 3), (6, 2)] {
        let want = references(&base, world, shard);
        let flat = references(&base, world, world);
        assert!(
            want.iter()
                .zip(&flat)
                .any(|((_, hybrid), (_, flat))| !values_bits_equal(hybrid, flat)),
            "N = {world}, S = {shard}: the hybrid and flat orders give the same bits, so this \
             test could not tell them apart"
        );
        for chunk_size in CHUNK_SIZES {
            for stage in 0..=3 {
                for overlap in [true, false] {
                    let config = config(stage, shard)
                        .with_overlap_comm(overlap)
                        .with_chunk_size(chunk_size);
                    let what = format!(
                        "N = {world}, S = {shard}, stage {stage}, overlap {overlap}, \
                         {chunk_size:?}: against the hybrid-order reference"
                    );
                    assert_passes_equal(&sharded(&base, world, &config), &want, &what);
                }
            }
        }
    }
}

#[test]
fn a_shard_group_size_that_does_not_divide_the_ranks_is_refused() {
    let errors = launch::<Flex, _, _, ZeroError>(4, &[Default::default()], |ctx| {
        Ok(shard(base_model(ctx.device()), &ctx, &config(3, 3)).err())
    })
    .unwrap();
    for error in errors {
        let message = error.expect("refused").to_string();
        assert!(
            message.contains("shard_group_size 3") && message.contains("4 ranks"),
            "{message}"
        );
    }
}

/// Bytes a rank moves, counted as the scaling benchmark counts them: an all-gather its
/// output, a reduce-scatter its input, an all-reduce twice its input.
#[derive(Default)]
struct Bytes {
    world: AtomicU64,
    shard: AtomicU64,
    replicas: AtomicU64,
    /// Reduce-scatters and all-reduces on the world, the shard group and the replica group.
    reductions: [AtomicU64; 3],
}

impl Bytes {
    /// Bytes moved so far on the world, inside the shard group and across the groups.
    fn moved(&self) -> [u64; 3] {
        [&self.world, &self.shard, &self.replicas].map(|c| c.load(Ordering::SeqCst))
    }

    /// Reductions issued so far, on every group.
    fn reductions(&self) -> u64 {
        self.reductions
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .sum()
    }
}

/// Counts into the counter of the group it is: the world, or (from its splits, in the order
/// `shard` makes them: the shard group first, then the replica group) one of the two.
struct Counting {
    inner: Arc<dyn Communicator<Flex>>,
    bytes: Arc<Bytes>,
    /// 0: world, 1: shard group, 2: replica group.
    group: usize,
    splits: Mutex<usize>,
}

impl Counting {
    fn reduction(&self) {
        self.bytes.reductions[self.group.min(2)].fetch_add(1, Ordering::SeqCst);
    }

    fn add(&self, bytes: usize) {
        let counter = match self.group {
            0 => &self.bytes.world,
            1 => &self.bytes.shard,
            _ => &self.bytes.replicas,
        };
        counter.fetch_add(bytes as u64, Ordering::SeqCst);
    }
}

fn bytes_of(t: &Tensor<Flex, 1>) -> usize {
    t.dims()[0] * t.dtype().size()
}

impl Communicator<Flex> for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(&self, block: Tensor<Flex, 1>) -> Result<Tensor<Flex, 1>, CommError> {
        self.add(bytes_of(&block) * self.world_size());
        self.inner.all_gather(block)
    }
    fn reduce_scatter(
        &self,
        input: Tensor<Flex, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<Flex, 1>, CommError> {
        self.add(bytes_of(&input));
        self.reduction();
        self.inner.reduce_scatter(input, op)
    }
    fn all_reduce(
        &self,
        input: Tensor<Flex, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<Flex, 1>, CommError> {
        self.add(2 * bytes_of(&input));
        self.reduction();
        self.inner.all_reduce(input, op)
    }
    fn broadcast(
        &self,
        buffer: Tensor<Flex, 1>,
        root: usize,
    ) -> Result<Tensor<Flex, 1>, CommError> {
        self.add(bytes_of(&buffer));
        self.inner.broadcast(buffer, root)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn duplicate(&self) -> Result<Arc<dyn Communicator<Flex>>, CommError> {
        Err(CommError::InvalidGroup("not used here".into()))
    }
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<Flex>>, CommError> {
        let mut splits = self.splits.lock().unwrap();
        *splits += 1;
        Ok(Arc::new(Counting {
            inner: self.inner.split(color)?,
            bytes: self.bytes.clone(),
            group: *splits,
            splits: Mutex::new(0),
        }))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// What one rank of the byte count measured over its second pass, and what it holds.
struct Measured {
    /// Bytes of the second pass on the world, inside the group and across the groups.
    moved: [u64; 3],
    report: MemoryReport,
    replica: (usize, usize),
    infos: Vec<ParamInfo>,
    /// Reductions the communicator saw over both passes, and twice the reducer's count of
    /// the last pass's collectives.
    reductions: (u64, u64),
    buckets: Vec<Vec<usize>>,
    chunks: ChunkLayout,
}

const WORLD: usize = 4;
const GROUP: usize = 2;

/// Two passes (forward and backward) on each of `WORLD` ranks in groups of `GROUP` at stage 3,
/// each rank's communicator counting what it moves.
fn measure(chunk_size: ChunkSize) -> Vec<Measured> {
    let base = base_model(&Default::default());
    let config = config(3, GROUP).with_chunk_size(chunk_size);
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let bytes = Arc::new(Bytes::default());
        let counting: Arc<dyn Communicator<Flex>> = Arc::new(Counting {
            inner: ctx.comm().clone(),
            bytes: bytes.clone(),
            group: 0,
            splits: Mutex::new(0),
        });
        let ctx = RankContext::new(*ctx.device(), counting);
        let (model, zero) = shard(base.clone(), &ctx, &config)?;
        let (_, grads) = backward(&model, ctx.rank(), false);
        drop(grads);
        let model = remark(model);
        let before = bytes.moved();
        let (_, grads) = backward(&model, WORLD + ctx.rank(), false);
        drop(grads);
        let after = bytes.moved();
        Ok(Measured {
            moved: [0, 1, 2].map(|group| after[group] - before[group]),
            report: zero.memory_report(),
            replica: zero.replica(),
            infos: zero.params(),
            reductions: (
                bytes.reductions(),
                2 * zero.last_reduction().collectives as u64,
            ),
            buckets: zero.bucket_layout(),
            chunks: zero.store().chunks().clone(),
        })
    })
    .unwrap()
}

#[test]
fn bytes_inside_and_across_groups_and_parameter_bytes_follow_the_shard_group_size() {
    for chunk_size in CHUNK_SIZES {
        for (rank, measured) in measure(chunk_size).iter().enumerate() {
            let what = format!("rank {rank}, {chunk_size:?}");
            check_reductions(measured, &what);
            if chunk_size != ChunkSize::PerParameter {
                check_chunk_buckets(measured, &what);
            }
            check_bytes(measured, rank, &what);
        }
    }
}

/// Two passes, each reducing every bucket inside the shard group and then across the groups:
/// the statistics count both collectives of a bucket.
fn check_reductions(measured: &Measured, what: &str) {
    let (seen, counted) = measured.reductions;
    assert_eq!(
        seen, counted,
        "{what}: reductions the engine saw over two passes against twice the last pass's count"
    );
    assert_eq!(counted, 2 * 2 * measured.buckets.len() as u64, "{what}");
}

/// With chunks a sharded chunk is a bucket (every parameter trains here), and the replicated
/// chunks' members are regrouped (within the chunk capacity) for the order backward produced
/// them in: two collectives per bucket and pass, fewer than one parameter per chunk needs.
fn check_chunk_buckets(measured: &Measured, what: &str) {
    let (buckets, chunks) = (&measured.buckets, &measured.chunks);
    let keys = |c: &Chunk| c.members.iter().map(|m| m.key).collect::<Vec<_>>();
    let of_kind = |kind| {
        chunks
            .chunks()
            .iter()
            .filter(move |c: &&Chunk| c.kind == kind)
    };
    let sharded: Vec<Vec<usize>> = of_kind(ChunkKind::Sharded).map(keys).collect();
    let replicated: Vec<usize> = of_kind(ChunkKind::Replicated).flat_map(keys).collect();
    for chunk in &sharded {
        assert!(buckets.contains(chunk), "{what}: {chunk:?} in {buckets:?}");
    }
    for bucket in buckets.iter().filter(|b| !sharded.contains(b)) {
        assert!(
            bucket.iter().all(|key| replicated.contains(key)),
            "{what}: {bucket:?}"
        );
    }
    let mut bucketed: Vec<usize> = buckets.iter().flatten().copied().collect();
    bucketed.sort_unstable();
    let params = measured.infos.len();
    assert_eq!(bucketed, (0..params).collect::<Vec<_>>(), "{what}");
    assert!(buckets.len() < params, "{what}: {buckets:?}");
}

/// Predicted from the parameter list (f32, 4 bytes an element): a sharded parameter is
/// gathered once in forward (kept for backward by the gather cache) and its gradient
/// reduce-scattered inside the group, padded to S blocks; its block of the sum is then
/// all-reduced across the groups. A replicated parameter's gradient is all-reduced inside the
/// group and then across. Chunks change none of it: a chunk's shard is its members' padded
/// blocks end to end, with no padding past them, so a chunk's gather, reduce-scatter and
/// all-reduces move exactly its members' bytes, in fewer calls.
fn check_bytes(measured: &Measured, rank: usize, what: &str) {
    let (mut inside, mut across, mut params) = (0, 0, 0);
    for info in &measured.infos {
        let n = info.shape.num_elements();
        if info.persistent {
            inside += 2 * n * 4;
            across += 2 * n * 4;
            params += n * 4;
        } else {
            let block = n.div_ceil(GROUP);
            inside += 2 * GROUP * block * 4;
            across += 2 * block * 4;
            params += block * 4;
        }
    }
    assert_eq!(
        measured.moved,
        [0, inside as u64, across as u64],
        "{what}: bytes of one pass on the world, inside the group and across groups"
    );
    assert_eq!(measured.replica, (rank / GROUP, WORLD / GROUP), "{what}");
    let report = &measured.report;
    assert_eq!(
        report.parameter_shards.current as usize + report.persistent_parameters.current as usize,
        params,
        "{what}: parameter bytes"
    );
}
