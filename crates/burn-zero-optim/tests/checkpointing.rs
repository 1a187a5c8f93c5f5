//! Burn's activation checkpointing under ZeRO-3: `Autodiff<Zero<Flex>, BalancedCheckpointing>`
//! recomputes memory-bound ops (additions, activations, ...) during backward instead of
//! keeping their outputs, and a recomputed op that reads a sharded parameter gathers it again.
//!
//! - Training with it ends bit for bit where training without it ends (2 ranks, stage 3, the
//!   test block with attention, layer norms and a GELU MLP), and each step issues at most one
//!   more all-gather per sharded parameter than without it, counted at the communicator.
//! - The activation memory it saves is measured by a counting global allocator: the peak heap
//!   of forward and backward of transformer-style MLP blocks, with and without checkpointing.
//! - With the parameters packed into chunks it is bitwise too: a recomputed op gathers its
//!   parameter's whole chunk again when nothing is kept gathered, and nothing more when the
//!   gather cache holds the chunks (one gather per chunk and step, with or without it).
//!
//! The two tests share the allocator, so they run one at a time.

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::flex::FlexDevice;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{Tensor, TensorData};
use burn_zero_comm::{RankContext, launch};
use burn_zero_core::chunk::{ChunkKind, ChunkLayout};
use burn_zero_core::{ChunkSize, Zero, ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::alloc::CountingAllocator;
use burn_zero_testing::recording::{CallLog, RecordingComm};
use burn_zero_testing::{Block, base_model, micro_batch, param_values, params_bits_equal};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

/// One test at a time: both measure through the process-wide allocator.
static SERIAL: Mutex<()> = Mutex::new(());

type Checkpointed = Autodiff<Zero<Flex>, BalancedCheckpointing>;
type Plain = Autodiff<Zero<Flex>>;

const WORLD: usize = 2;
const STEPS: usize = 3;
const LR: f64 = 1e-2;

/// Sets every parameter, in visit order, to `values` (its own shape kept), trainable.
struct SetValues<'a> {
    values: &'a [Vec<f32>],
    index: usize,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for SetValues<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let data = TensorData::new(self.values[self.index].clone(), tensor.dims());
        self.index += 1;
        let tensor = Tensor::<AB, D>::from_data(data, &tensor.device()).require_grad();
        Param::from_mapped_value(id, tensor, mapper)
    }
}

fn with_values<AB: AutodiffBackend, M: Module<AB>>(model: M, values: &[Vec<f32>]) -> M {
    model.map(&mut SetValues { values, index: 0 })
}

/// What one rank saw: its final parameters, the all-gathers of each step and the chunk layout.
struct Run {
    params: Vec<Vec<f32>>,
    gathers: Vec<usize>,
    chunks: ChunkLayout,
}

/// Trains the test block (starting from `values`) on `AB` for `STEPS` steps on `WORLD` ranks.
fn train_block<AB>(values: &[Vec<f32>], config: &ZeroConfig) -> Vec<Run>
where
    AB: AutodiffBackend<InnerBackend = Zero<Flex>> + BackendTypes<Device = FlexDevice>,
{
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let log = CallLog::default();
        let recorder = Arc::new(RecordingComm::new(ctx.comm().clone(), log.clone()));
        let ctx = RankContext::new(*ctx.device(), recorder);
        let base = with_values(Block::<AB>::new(ctx.device()), values);
        let (mut model, zero) = shard(base, &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut gathers = Vec::new();
        for step in 0..STEPS {
            let before = log.lock().unwrap().len();
            let (tokens, targets) = micro_batch::<AB>(step * WORLD + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(LR, model, grads);
            let calls = log.lock().unwrap()[before..].to_vec();
            gathers.push(
                calls
                    .iter()
                    .filter(|(call, _)| call.starts_with("all_gather"))
                    .count(),
            );
        }
        Ok(Run {
            params: param_values(&model),
            gathers,
            chunks: zero.store().chunks().clone(),
        })
    })
    .unwrap()
}

#[test]
fn checkpointed_zero3_training_is_bitwise_and_regathers_at_most_once_per_parameter() {
    let _serial = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    let values = param_values(&base_model(&Default::default()));
    // Every parameter sharded and nothing kept gathered: every use gathers.
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(0)
        .with_max_live_gathered_bytes(0)
        .with_bucket_size_mb(0.001);
    let plain = train_block::<Plain>(&values, &config);
    let checkpointed = train_block::<Checkpointed>(&values, &config);
    let sharded = values.len();
    for (rank, (p, c)) in plain.iter().zip(&checkpointed).enumerate() {
        assert!(
            params_bits_equal(&p.params, &c.params),
            "rank {rank}: checkpointing changed the result"
        );
        for (step, (&without, &with)) in p.gathers.iter().zip(&c.gathers).enumerate() {
            assert!(
                with >= without && with <= without + sharded,
                "rank {rank}, step {step}: {with} all-gathers with checkpointing, {without} \
                 without, {sharded} sharded parameters"
            );
        }
        println!(
            "rank {rank}: all-gathers per step {:?} without checkpointing, {:?} with ({sharded} \
             sharded parameters)",
            p.gathers, c.gathers
        );
    }
}

#[test]
fn checkpointed_chunked_zero3_training_is_bitwise_and_regathers_at_most_once_per_use() {
    let _serial = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    let values = param_values(&base_model(&Default::default()));
    // Every parameter sharded, packed into chunks of 256 elements (several per chunk).
    let chunked = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(0)
        .with_bucket_size_mb(0.001)
        .with_chunk_size(ChunkSize::Elements(256));
    // The per-parameter reference: every use gathers.
    let reference = train_block::<Plain>(
        &values,
        &chunked
            .clone()
            .with_chunk_size(ChunkSize::PerParameter)
            .with_max_live_gathered_bytes(0),
    );
    let sharded = values.len();
    // Nothing kept gathered: each use of a parameter gathers its whole chunk (one all-gather,
    // the other members cut out and dropped), so a recomputed op gathers once more per
    // parameter it reads, as without chunks. With the default cache a chunk stays gathered
    // from its first use in forward through backward and its recomputations: one gather per
    // sharded chunk and step, checkpointing or not (and in the first step, the ranks'
    // agreement on the order of their gradient buckets).
    for cache in [0, ZeroConfig::new().max_live_gathered_bytes] {
        let config = chunked.clone().with_max_live_gathered_bytes(cache);
        let plain = train_block::<Plain>(&values, &config);
        let checkpointed = train_block::<Checkpointed>(&values, &config);
        for (rank, (p, c)) in plain.iter().zip(&checkpointed).enumerate() {
            let chunks = p.chunks.count(ChunkKind::Sharded);
            assert!(
                p.chunks.chunks().iter().any(|c| c.members.len() > 1),
                "rank {rank}: {:?}",
                p.chunks
            );
            assert!(
                params_bits_equal(&p.params, &reference[rank].params),
                "cache {cache}, rank {rank}: chunks changed the result"
            );
            assert!(
                params_bits_equal(&p.params, &c.params),
                "cache {cache}, rank {rank}: checkpointing changed the result"
            );
            for (step, (&without, &with)) in p.gathers.iter().zip(&c.gathers).enumerate() {
                if cache == 0 {
                    // As many gathers as uses, like one parameter per chunk.
                    assert_eq!(without, reference[rank].gathers[step], "rank {rank}");
                    assert!(
                        with >= without && with <= without + sharded,
                        "rank {rank}, step {step}: {with} all-gathers with checkpointing, \
                         {without} without, {sharded} sharded parameters"
                    );
                } else {
                    // The first step also holds the one all-gather by which the ranks agree on
                    // the order their gradient buckets complete in.
                    let agreement = usize::from(step == 0);
                    assert_eq!(
                        (without, with),
                        (chunks + agreement, chunks + agreement),
                        "rank {rank}, step {step}: all-gathers without and with checkpointing, \
                         against {chunks} sharded chunks"
                    );
                }
            }
            println!(
                "cache {cache} B, rank {rank}: all-gathers per step {:?} without checkpointing, \
                 {:?} with ({chunks} sharded chunks of {sharded} parameters)",
                p.gathers, c.gathers
            );
        }
    }
}

const WIDTH: usize = 64;
const HIDDEN: usize = 4 * WIDTH;
const DEPTH: usize = 4;
const ROWS: usize = 256;

/// `DEPTH` transformer-style MLP blocks, `x + gelu(x·W1 + b1)·W2 + b2`. Without checkpointing
/// autodiff keeps, per block, the pre-activation (GELU's backward needs it) and the activation
/// (the second product's backward needs it), both `ROWS × HIDDEN`; with it the additions and
/// the GELU are recomputed in backward from the first product, which is kept instead, so one
/// `ROWS × HIDDEN` tensor per block is not kept.
#[derive(Module, Debug)]
struct Deep<B: Backend> {
    up: Vec<Linear<B>>,
    down: Vec<Linear<B>>,
}

impl<B: Backend> Deep<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            up: (0..DEPTH)
                .map(|_| LinearConfig::new(WIDTH, HIDDEN).init(device))
                .collect(),
            down: (0..DEPTH)
                .map(|_| LinearConfig::new(HIDDEN, WIDTH).init(device))
                .collect(),
        }
    }

    fn loss(&self, mut x: Tensor<B, 2>) -> Tensor<B, 1> {
        for (up, down) in self.up.iter().zip(&self.down) {
            x = down.forward(gelu(up.forward(x.clone()))) + x;
        }
        (x.clone() * x).mean()
    }
}

/// Peak heap bytes above the start of forward, through the end of backward, and the weight
/// gradients, of one stage-3 rank (one rank, so that the peak is one thread's and repeats
/// exactly: two ranks' peaks coincide or not from run to run).
fn deep_peak<AB>(values: &[Vec<f32>]) -> (usize, Vec<Vec<f32>>)
where
    AB: AutodiffBackend<InnerBackend = Zero<Flex>> + BackendTypes<Device = FlexDevice>,
{
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(0)
        .with_overlap_comm(false);
    let mut run = launch::<Flex, _, _, ZeroError>(1, &[Default::default()], |ctx| {
        let base = with_values(Deep::<AB>::new(ctx.device()), values);
        let (model, _zero) = shard(base, &ctx, &config)?;
        let input: Vec<f32> = (0..ROWS * WIDTH)
            .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
            .collect();
        let x = Tensor::<AB, 2>::from_data(TensorData::new(input, [ROWS, WIDTH]), ctx.device());
        ALLOCATOR.reset_peak();
        let start = ALLOCATOR.live();
        let grads = model.loss(x).backward();
        let peak = ALLOCATOR.peak() - start;
        let grads = GradientsParams::from_grads(grads, &model);
        let values = model
            .up
            .iter()
            .chain(&model.down)
            .map(|layer| {
                let grad = grads.get::<Zero<Flex>, 2>(layer.weight.id);
                let grad = grad.expect("every weight has a gradient");
                grad.into_data().convert::<f32>().to_vec().unwrap()
            })
            .collect();
        Ok((peak, values))
    })
    .unwrap();
    run.remove(0)
}

#[test]
fn checkpointing_lowers_the_measured_activation_peak_under_zero3() {
    let _serial = SERIAL.lock().unwrap_or_else(|poison| poison.into_inner());
    let values = param_values(&Deep::<Plain>::new(&Default::default()));
    let (plain, plain_grads) = deep_peak::<Plain>(&values);
    let (checkpointed, checkpointed_grads) = deep_peak::<Checkpointed>(&values);
    assert!(
        params_bits_equal(&plain_grads, &checkpointed_grads),
        "checkpointing changed the gradients"
    );
    // A hidden activation is ROWS × HIDDEN f32 (256 KiB).
    let activation = ROWS * HIDDEN * 4;
    println!(
        "peak heap over forward + backward, stage 3, {DEPTH} blocks of {ROWS} × {HIDDEN}: \
         {plain} B without checkpointing, {checkpointed} B with ({:.2} hidden activations of \
         {activation} B saved per block)",
        (plain as f64 - checkpointed as f64) / (DEPTH * activation) as f64
    );
    assert!(
        checkpointed + DEPTH * activation / 2 <= plain,
        "checkpointing saved {} B, less than half a hidden activation per block",
        plain as i64 - checkpointed as i64
    );
}
