//! Hybrid sharding (`ZeroConfig::shard_group_size`): N ranks in N/S shard groups of S
//! contiguous ranks; each group shards the model over its S ranks and the groups hold the same
//! blocks.
//!
//! The order the mean gradient is added up in, which the reference below repeats: inside each
//! shard group the ranks' gradients are added in rank order (the group's reduce-scatter), then
//! the groups' sums are added in group order (the all-reduce across the groups), and the total
//! is divided once by N. For N = 4, S = 2 that is ((g0 + g1) + (g2 + g3)) / 4, which is not the
//! flat order (((g0 + g1) + g2) + g3) / 4 of plain sharding; the test checks that the two
//! references differ, so matching one of them bit for bit says which order was used.
//!
//! Chunks (`ZeroConfig::chunk_size`) are laid out over the shard group's ranks and reduced in
//! the same two collectives per chunk: training stays bitwise, and the bytes do not change.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn_zero_comm::{CommError, Communicator, RankContext, ReduceOp, launch};
use burn_zero_core::chunk::{Chunk, ChunkKind};
use burn_zero_core::{ChunkSize, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{
    Block, Inner, Train, base_model, micro_batch, param_values, params_bits_equal,
};

const STEPS: usize = 4;
const LR: f64 = 1e-2;

/// The gradients of one step's N micro-batches (micro-batch `step · N + rank` on rank `rank`),
/// added in the hybrid order — rank order within each group of `shard` ranks, then the groups
/// in order — and divided once by N.
fn hybrid_mean(model: &Block<Train>, step: usize, world: usize, shard: usize) -> GradientsParams {
    let device = Default::default();
    let grads: Vec<GradientsParams> = (0..world)
        .map(|rank| {
            let (tokens, targets) = micro_batch::<Train>(step * world + rank, &device);
            GradientsParams::from_grads(model.loss(tokens, targets).backward(), model)
        })
        .collect();
    struct Mean<'a> {
        grads: &'a [GradientsParams],
        shard: usize,
        out: GradientsParams,
    }
    impl ModuleVisitor<Train> for Mean<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
            let get = |g: &GradientsParams| g.get::<Inner, D>(param.id).expect("a gradient");
            let sum = |parts: &[GradientsParams]| {
                let mut parts = parts.iter().map(get);
                let first = parts.next().expect("a rank");
                parts.fold(first, |acc, g| acc + g)
            };
            let mut groups = self.grads.chunks(self.shard).map(sum);
            let first = groups.next().expect("a group");
            let total = groups.fold(first, |acc, g| acc + g);
            let mean = if self.grads.len() > 1 {
                total.div_scalar(self.grads.len() as f64)
            } else {
                total
            };
            self.out.register::<Inner, D>(param.id, mean);
        }
    }
    let mut mean = Mean {
        grads: &grads,
        shard,
        out: GradientsParams::new(),
    };
    model.visit(&mut mean);
    mean.out
}

/// Single rank, Burn's Adam, the hybrid-order mean gradient of every step.
fn reference(base: &Block<Train>, world: usize, shard: usize) -> Vec<Vec<f32>> {
    let mut model = base.clone();
    let mut optim = AdamConfig::new().init();
    for step in 0..STEPS {
        let mean = hybrid_mean(&model, step, world, shard);
        model = optim.step(LR, model, mean);
    }
    param_values(&model)
}

fn sharded(base: &Block<Train>, world: usize, config: &ZeroConfig) -> Vec<Vec<Vec<f32>>> {
    launch::<Flex, _, _, ZeroError>(world, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        for step in 0..STEPS {
            let (tokens, targets) = micro_batch::<Train>(step * world + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
        }
        Ok(param_values(&model))
    })
    .unwrap_or_else(|e| panic!("{world} ranks, {config:?}: {e}"))
}

/// One parameter per chunk (gradient buckets of `bucket_size_mb`), and chunks of 256 elements,
/// which pack several parameters of the test block together over a shard group of 2 or 3
/// (checked by `chunks_of_256_elements_pack_several_parameters_per_shard_group`).
const CHUNK_SIZES: [ChunkSize; 2] = [ChunkSize::PerParameter, ChunkSize::Elements(256)];

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

fn config(stage: u8, shard: usize) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(stage)
        .with_shard_group_size(shard)
        .with_persist_below_numel(12)
        .with_bucket_size_mb(0.001)
}

#[test]
fn hybrid_training_matches_single_rank_training_in_hybrid_order_bitwise() {
    let base = base_model(&Default::default());
    // (N, S): 2 groups of 2, 2 groups of 3, 3 groups of 2.
    for (world, shard) in [(4, 2), (6, 3), (6, 2)] {
        let want = reference(&base, world, shard);
        let flat = reference(&base, world, world);
        assert!(
            !params_bits_equal(&want, &flat),
            "N = {world}, S = {shard}: the hybrid and flat orders give the same bits, so this \
             test could not tell them apart"
        );
        for chunk_size in CHUNK_SIZES {
            for stage in 0..=3 {
                for overlap in [true, false] {
                    let config = config(stage, shard)
                        .with_overlap_comm(overlap)
                        .with_chunk_size(chunk_size);
                    let got = sharded(&base, world, &config);
                    for (rank, params) in got.iter().enumerate() {
                        assert!(
                            params_bits_equal(params, &want),
                            "N = {world}, S = {shard}, stage {stage}, overlap {overlap}, \
                             {chunk_size:?}: rank {rank} differs from the hybrid-order reference"
                        );
                    }
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

#[test]
fn bytes_inside_and_across_groups_and_model_state_follow_the_shard_group_size() {
    for chunk_size in CHUNK_SIZES {
        bytes_and_model_state(chunk_size);
    }
}

fn bytes_and_model_state(chunk_size: ChunkSize) {
    let base = base_model(&Default::default());
    let (world, group_size) = (4, 2);
    let config = config(3, group_size).with_chunk_size(chunk_size);
    let per_rank = launch::<Flex, _, _, ZeroError>(world, &[Default::default()], |ctx| {
        let bytes = Arc::new(Bytes::default());
        let counting: Arc<dyn Communicator<Flex>> = Arc::new(Counting {
            inner: ctx.comm().clone(),
            bytes: bytes.clone(),
            group: 0,
            splits: Mutex::new(0),
        });
        let ctx = RankContext::new(*ctx.device(), counting);
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut step = |model: Block<Train>, index: usize| {
            let (tokens, targets) = micro_batch::<Train>(index * world + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            optimizer.step(LR, model, grads)
        };
        model = step(model, 0);
        let before =
            [&bytes.world, &bytes.shard, &bytes.replicas].map(|c| c.load(Ordering::SeqCst));
        model = step(model, 1);
        let after = [&bytes.world, &bytes.shard, &bytes.replicas].map(|c| c.load(Ordering::SeqCst));
        let moved: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        let report = zero.memory_report();
        let infos = zero.params();
        // The reductions the engine saw in the last step, against the reducer's own count.
        let reductions: u64 = bytes
            .reductions
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .sum();
        let counted = 2 * zero.last_reduction().collectives as u64;
        let buckets = zero.bucket_layout();
        let chunks = zero.store().chunks().clone();
        drop(model);
        Ok((
            moved,
            report,
            optimizer.state_bytes(),
            zero.replica(),
            infos,
            (reductions, counted),
            (buckets, chunks),
        ))
    })
    .unwrap();
    for (rank, (moved, report, state, replica, infos, (reductions, counted), (buckets, chunks))) in
        per_rank.iter().enumerate()
    {
        // Two steps, each reducing every bucket inside the shard group and then across the
        // groups: the statistics count both collectives of a bucket.
        assert_eq!(
            reductions, counted,
            "rank {rank}: reductions the engine saw over two steps against twice the last \
             step's count"
        );
        assert_eq!(*counted, 2 * 2 * buckets.len() as u64, "rank {rank}");
        if chunk_size != ChunkSize::PerParameter {
            // With chunks a sharded chunk is a bucket (every parameter trains here), and the
            // replicated chunks' members are regrouped (within the chunk capacity) for the
            // order backward produced them in: two collectives per bucket and step, fewer than
            // one parameter per chunk needs.
            let keys = |c: &Chunk| c.members.iter().map(|m| m.key).collect::<Vec<_>>();
            let sharded: Vec<Vec<usize>> = chunks
                .chunks()
                .iter()
                .filter(|c| c.kind == ChunkKind::Sharded)
                .map(keys)
                .collect();
            let replicated: Vec<usize> = chunks
                .chunks()
                .iter()
                .filter(|c| c.kind == ChunkKind::Replicated)
                .flat_map(keys)
                .collect();
            for chunk in &sharded {
                assert!(
                    buckets.contains(chunk),
                    "rank {rank}: {chunk:?} in {buckets:?}"
                );
            }
            for bucket in buckets.iter().filter(|b| !sharded.contains(b)) {
                assert!(
                    bucket.iter().all(|key| replicated.contains(key)),
                    "rank {rank}: {bucket:?}"
                );
            }
            let mut bucketed: Vec<usize> = buckets.iter().flatten().copied().collect();
            bucketed.sort_unstable();
            assert_eq!(
                bucketed,
                (0..infos.len()).collect::<Vec<_>>(),
                "rank {rank}"
            );
            assert!(buckets.len() < infos.len(), "rank {rank}: {buckets:?}");
        }
        // Predicted from the parameter list (f32, 4 bytes an element): a sharded parameter is
        // gathered once in forward (kept for backward by the gather cache) and its gradient
        // reduce-scattered inside the group, padded to S blocks; its block of the sum is then
        // all-reduced across the groups. A replicated parameter's gradient is all-reduced
        // inside the group and then across. Chunks change none of it: a chunk's shard is its
        // members' padded blocks end to end, with no padding past them, so a chunk's gather,
        // reduce-scatter and all-reduces move exactly its members' bytes, in fewer calls.
        let (mut inside, mut across, mut params, mut elements) = (0, 0, 0, 0);
        for info in infos {
            let n = info.shape.num_elements();
            if info.persistent {
                inside += 2 * n * 4;
                across += 2 * n * 4;
                params += n * 4;
                elements += n;
            } else {
                let block = n.div_ceil(group_size);
                inside += 2 * group_size * block * 4;
                across += 2 * block * 4;
                params += block * 4;
                elements += block;
            }
        }
        assert_eq!(
            moved,
            &[0, inside as u64, across as u64],
            "rank {rank}, {chunk_size:?}: bytes of one step on the world, inside the group and \
             across groups"
        );
        assert_eq!(
            *replica,
            (rank / group_size, world / group_size),
            "rank {rank}"
        );
        assert_eq!(
            report.parameter_shards.current as usize
                + report.persistent_parameters.current as usize,
            params,
            "rank {rank}: parameter bytes"
        );
        // Adam: two f32 moments of every element this rank steps.
        assert_eq!(*state, 8 * elements, "rank {rank}: optimizer state bytes");
    }
}
