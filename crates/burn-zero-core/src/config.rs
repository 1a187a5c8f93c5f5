//! `ZeroConfig`: how a module is sharded.

use burn::config::Config;
use burn::tensor::DType;

use crate::chunk::ChunkSize;
use crate::placement::Placement;

/// How [`crate::shard()`] partitions a module and how the decorator gathers it.
///
/// A Burn [`Config`]: it serialises to JSON (`save`/`load`) and builds with `ZeroConfig::new()`
/// plus `with_*` setters.
#[derive(Config, Debug, PartialEq)]
pub struct ZeroConfig {
    /// ZeRO stage:
    /// - 3: parameters, gradients and optimizer state partitioned; parameters gathered at use;
    /// - 2: parameters replicated; gradients reduce-scattered bucket by bucket during backward
    ///   (the full ones freed); optimizer state partitioned;
    /// - 1: parameters replicated; gradients reduce-scattered after backward; optimizer state
    ///   partitioned;
    /// - 0: plain data parallelism: gradients all-reduced, nothing partitioned (the baseline).
    #[config(default = 3)]
    pub stage: u8,
    /// Size of a gradient bucket in MiB (all ranks' rows together). Gradients are packed into
    /// buckets and each bucket is reduced by one collective; a gradient larger than a bucket
    /// is reduced on its own. 0 or less: one collective per parameter. Reduce-scattered and
    /// all-reduced gradients fill buckets of their own; with `overlap_comm` the buckets are
    /// rebuilt after the first backward pass from the order it produced gradients in (as
    /// PyTorch DDP does), so that each bucket's gradients arrive together.
    #[config(default = 25.0)]
    pub bucket_size_mb: f64,
    /// Element type gradients are reduced in; `None` keeps each parameter's own. `Some(F32)`
    /// with f16/bf16 parameters reduces in full precision (ColossalAI's `fp32_reduce_scatter`).
    #[config(default = "None")]
    pub reduce_dtype: Option<DType>,
    /// Gradients are divided by this factor before the collective and by
    /// `world_size / factor` after it, so the result is the mean either way; a factor between
    /// 1 and the world size trades overflow in low precision against underflow.
    #[config(default = 1.0)]
    pub gradient_predivide_factor: f64,
    /// Parameters with fewer elements than this stay replicated on every rank (their gradients
    /// are all-reduced, not reduce-scattered): gathering tiny tensors costs more in latency than
    /// it saves in memory. DeepSpeed's `stage3_param_persistence_threshold` plays the same role.
    #[config(default = 100_000)]
    pub persist_below_numel: usize,
    /// Upper bound of gathered full parameters kept alive between ops, in bytes. A parameter
    /// used several times in one pass (tied embeddings) is then gathered once. Parameters that
    /// do not fit are gathered for one op and dropped. 0 disables the cache.
    #[config(default = 536_870_912)]
    pub max_live_gathered_bytes: usize,
    /// Copy rank 0's values to every rank while sharding, so that ranks whose models were
    /// initialised differently still start from one model (FSDP's `sync_module_states`).
    #[config(default = true)]
    pub sync_module_states: bool,
    /// Reduce gradient buckets on a communication thread while backward is still running
    /// (DeepSpeed's `overlap_comm`, FSDP's default): each bucket goes as soon as its last
    /// gradient is final, and full gradients are freed bucket by bucket. Applies to stages 0,
    /// 2 and 3; stage 1 reduces after backward by definition. `false` reduces every bucket
    /// on the training thread when backward ends. Results are bitwise the same either way.
    #[config(default = true)]
    pub overlap_comm: bool,
    /// Reduce gradients (and every other reduction of the module's groups) as an all-to-all
    /// followed by a sum in rank order on each rank ([`burn_zero_comm::RankOrderReduction`]),
    /// instead of the engine's own reductions: the sums then have the same bits on every
    /// engine, world size and machine shape, the bits `LocalGroup` gives (NCCL sums in an order
    /// its algorithm picks). The same bytes cross the links as with a ring, but each rank
    /// receives into a buffer of the whole bucket. Needs an engine with an all-to-all
    /// (`LocalGroup`, `MpiGroup`, `NcclGroup`); `shard` refuses it by name on one without. Off
    /// by default.
    #[config(default = false)]
    pub reduce_in_rank_order: bool,
    /// Stage 3 with f16/bf16 parameters: once a parameter's reduced gradient shard arrives,
    /// free its half-precision parameter shard, whose values the optimizer's fp32 master copy
    /// holds anyway; the next optimizer step writes a fresh shard. Between backward and step a
    /// rank then holds 2Ψ/N bytes of parameters-or-gradients instead of 4Ψ/N (ColossalAI's
    /// `reuse_fp16_shard`). Parameters are freed only after the optimizer's first step has
    /// created their masters; nothing may read the parameters between backward and step.
    #[config(default = false)]
    pub reuse_fp16_shard: bool,
    /// Hybrid sharding (FSDP's HSDP, ZeRO++'s hpZ): parameters, gradients and optimizer state
    /// are sharded within groups of this many ranks and replicated across the groups.
    /// Groups are contiguous ranks (`0..S`, `S..2S`, …: one node each, when ranks are laid out
    /// node by node). Gradients are reduce-scattered inside the group, then all-reduced across
    /// the groups, so traffic across groups is 1/S of a gradient per rank. Must divide the
    /// number of ranks; 0 (the default) or the number of ranks shards over all of them.
    #[config(default = 0)]
    pub shard_group_size: usize,
    /// Stage 3: how many parameter gathers may run ahead of use (FSDP's forward and backward
    /// prefetch, DeepSpeed's prefetch bucket). The order in which a pass gathers parameters
    /// is recorded in the first pass (forward and backward, up to the end of backward); in
    /// later passes, each gather issues the next ones of that order on the rank's issuing
    /// thread, so they run while the training thread computes. Gathered and prefetched
    /// parameters together stay within `max_live_gathered_bytes`. A pass that asks for a
    /// parameter out of the recorded order (control flow changed) drops its prefetches,
    /// gathers on demand, and is recorded anew. 0 (the default) gathers on demand only.
    #[config(default = 0)]
    pub prefetch: usize,
    /// How parameters are grouped into chunks, the unit that is gathered (stage 3), reduced and
    /// stepped: a few large collectives instead of one per parameter (ColossalAI Gemini's
    /// chunks, FSDP2's parameter groups). Parameters are packed in module visit order; frozen
    /// and trainable parameters, sharded and replicated ones, and different dtypes never share
    /// a chunk. With chunks, gradients are reduced one chunk at a time and `bucket_size_mb` is
    /// not used (replicated chunks' buckets are rebuilt like buckets of `bucket_size_mb`,
    /// within the chunk capacity). [`ChunkSize::PerParameter`] keeps one parameter per chunk
    /// and gradient buckets of `bucket_size_mb`. The default, [`ChunkSize::Auto`], is the
    /// searched size on device backends and one parameter per chunk on Flex and NdArray.
    #[config(default = "ChunkSize::Auto")]
    pub chunk_size: ChunkSize,
    /// Where parameter shards, fp32 masters and optimizer state live: everything on the
    /// device (the default), fixed fractions of the chunks in host memory, or parameter shards
    /// placed by measurement under a device capacity (see [`Placement`]). The optimizer built
    /// from the sharded module's state places its part from the same value.
    #[config(default = "Placement::device()")]
    pub placement: Placement,
}

impl ZeroConfig {
    /// Whether gradient reduction runs on a communication thread during backward.
    pub fn overlaps_reduction(&self) -> bool {
        self.overlap_comm && self.stage != 1
    }

    /// Whether parameters are gathered ahead of use (stage 3 with `prefetch` > 0 and a gather
    /// cache to hold them).
    pub fn prefetches(&self) -> bool {
        self.stage == 3 && self.prefetch > 0 && self.max_live_gathered_bytes > 0
    }
}

impl ZeroConfig {
    /// The ranks each tensor is sharded over in a job of `world_size` ranks, or why the
    /// configured shard-group size cannot split that job.
    pub fn shard_group_size_for(&self, world_size: usize) -> Result<usize, String> {
        match self.shard_group_size {
            0 => Ok(world_size),
            s if world_size.is_multiple_of(s) => Ok(s),
            s => Err(format!(
                "shard_group_size {s} does not divide the {world_size} ranks into equal groups"
            )),
        }
    }

    /// Checks the values that cannot work.
    pub fn validate(&self) -> Result<(), String> {
        if self.stage > 3 {
            return Err(format!("stage {} does not exist (0 to 3)", self.stage));
        }
        if !(self.gradient_predivide_factor.is_finite() && self.gradient_predivide_factor > 0.0) {
            return Err(format!(
                "gradient_predivide_factor must be a positive number, not {}",
                self.gradient_predivide_factor
            ));
        }
        if let Some(dtype) = self.reduce_dtype
            && !dtype.is_float()
        {
            return Err(format!("reduce_dtype must be a float type, not {dtype:?}"));
        }
        if self.reuse_fp16_shard && self.stage != 3 {
            return Err(format!(
                "reuse_fp16_shard needs stage 3 (parameters sharded), not stage {}",
                self.stage
            ));
        }
        self.chunk_size.validate(1)?;
        self.placement.validate(self.stage)?;
        if !self.bucket_size_mb.is_finite() {
            return Err(format!(
                "bucket_size_mb must be finite, not {}",
                self.bucket_size_mb
            ));
        }
        Ok(())
    }
}
