//! Kernel launches of a chunk at stage 3, one rank on `CubeBackend<WgpuRuntime>` (Mesa's
//! lavapipe where there is no GPU), and of two ranks on Burn's fusion layer over it, counted at
//! the backend boundary by [`burn_zero_kernels::LaunchLog`]: cubecl's execution log, every
//! launch on the device.
//!
//! A chunk's members are gathered, reduced and stepped together, so what a step launches for a
//! chunk must not grow with its members:
//! - the fused Adam step of a chunk is one launch: the chunk's reduced gradient row is stepped
//!   as the reduction delivered it, and its new values become the members' blocks without
//!   being cut apart;
//! - a forward pass over a chunked model launches what the same forward over its whole
//!   parameters launches (stage 0), plus at most one launch per chunk for its gather: the
//!   shard the step wrote is gathered as it is, and at one rank the members are ranges of the
//!   gathered row. Every member here starts and ends at a multiple of 512 bytes, the largest
//!   alignment cubecl asks of a view (CUDA's), so no range needs a copy on any device.
//!
//! - a replicated chunk's gradients, delivered member by member, are joined for its step by
//!   the pack kernel, up to 16 members a launch, not with a copy each.
//!
//! - a rank alone waits for the device once per gradient bucket only while a sampler reads the
//!   device's memory, and not at all otherwise.
//!
//! - two ranks on Burn's fusion layer whose engine orders its inputs on the device launch what
//!   two synchronising ranks launch: the collectives' work, issued in the training thread's
//!   lent fusion stream, does not split what that stream fuses.
//!
//! Every side trains the same bits as one parameter per chunk. A binary of its own, one test
//! at a time: a counting window counts every launch on the device. Without a wgpu adapter
//! every test says it was skipped, unless `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a
//! failure.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use burn::backend::Autodiff;
use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_fusion::Fusion;
use burn_zero_comm::{RankContext, launch};
use burn_zero_core::{ChunkSize, Zero, ZeroConfig, ZeroError, shard};
use burn_zero_kernels::{DeviceMemorySampler, LaunchLog, peaks_watched};
use burn_zero_optim::ZeroOptimizer;
use burn_zero_testing::recording::{CallLog, RecordingComm};
use burn_zero_testing::{param_values, params_bits_equal, skip};

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
type Train = Autodiff<Zero<Plain>>;
/// Burn's fusion layer over wgpu (`burn::backend::Wgpu` with Burn's default features).
type Fused = Fusion<Plain>;

/// Layers of `WIDTH` × `WIDTH` with bias: 2 × `LAYERS` members of 64 KiB and 512 B.
const WIDTH: usize = 128;
const LAYERS: usize = 5;
/// Steps: the first makes the optimizer's state and the first shard the step writes; the
/// later ones are counted.
const STEPS: usize = 3;

/// One counting window at a time.
static DEVICE: Mutex<()> = Mutex::new(());

#[derive(Module, Debug)]
struct Stack<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: AutodiffBackend> Stack<B> {
    /// The model with its values drawn now (Burn initialises lazily).
    fn drawn(device: &B::Device) -> Self {
        let layers = (0..LAYERS)
            .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
            .collect();
        let model = Self { layers };
        let _ = param_values(&model);
        model
    }

    fn loss(&self, input: Tensor<B, 2>) -> Tensor<B, 1> {
        let mut x = input;
        for layer in &self.layers {
            x = burn::tensor::activation::relu(layer.forward(x));
        }
        x.powi_scalar(2).mean()
    }
}

fn input<B: Backend>(step: usize, device: &B::Device) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..4 * WIDTH)
        .map(|i| ((i * 7 + step * 13) % 97) as f32 / 97.0 - 0.5)
        .collect();
    Tensor::from_data(TensorData::new(values, [4, WIDTH]), device)
}

/// Launches of each counted step's forward and optimizer step, with the final parameters.
struct Counted {
    forward: Vec<usize>,
    step: Vec<usize>,
    params: Vec<Vec<f32>>,
    chunks: usize,
}

/// Trains `base` at `stage` with `chunk_size` and the fused Adam, every parameter of
/// `persist_below` elements or more sharded.
fn train(base: &Stack<Train>, stage: u8, chunk_size: ChunkSize, persist_below: usize) -> Counted {
    let device = WgpuDevice::default();
    let config = ZeroConfig::new()
        .with_stage(stage)
        .with_persist_below_numel(persist_below)
        .with_chunk_size(chunk_size);
    let log = LaunchLog::install();
    let count = |work: &mut dyn FnMut()| {
        log.launches::<WgpuRuntime, _>(&device, || {
            work();
            Plain::sync(&device).unwrap();
        })
        .expect("the launches are counted")
        .1
        .len()
    };
    let mut ranks = launch::<Plain, _, _, ZeroError>(1, std::slice::from_ref(&device), |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let chunks = zero.store().chunks().chunks().len();
        let mut optimizer = ZeroOptimizer::new(&zero, AdamConfig::new().clone()).expect("valid");
        let (mut forward, mut step) = (Vec::new(), Vec::new());
        for index in 0..STEPS {
            let input = input::<Train>(index, ctx.device());
            Plain::sync(ctx.device()).unwrap();
            let mut loss = None;
            let launched = count(&mut || loss = Some(model.loss(input.clone())));
            let grads = GradientsParams::from_grads(loss.unwrap().backward(), &model);
            Plain::sync(ctx.device()).unwrap();
            let (mut current, mut grads, mut next) = (Some(model), Some(grads), None);
            let stepped = count(&mut || {
                let (model, grads) = (current.take().unwrap(), grads.take().unwrap());
                next = Some(optimizer.step(1e-3, model, grads));
            });
            model = next.unwrap();
            if index > 0 {
                forward.push(launched);
                step.push(stepped);
            }
        }
        Ok(Counted {
            forward,
            step,
            params: param_values(&model),
            chunks,
        })
    })
    .unwrap();
    ranks.swap_remove(0)
}

/// The device to itself and the model to train on backend `AB`, drawn on it; `None` (the test skipped)
/// without a wgpu adapter.
fn start<AB: AutodiffBackend<Device = WgpuDevice>>(
    test: &str,
) -> Option<(MutexGuard<'static, ()>, Stack<AB>)> {
    LaunchLog::install();
    if !skip::wgpu_adapter(test) {
        return None;
    }
    let one = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    let base = Stack::<AB>::drawn(&WgpuDevice::default());
    Some((one, base))
}

#[test]
fn a_chunk_costs_launches_per_chunk_not_per_member() {
    let Some((_one, base)) = start("a_chunk_costs_launches_per_chunk_not_per_member") else {
        return;
    };
    // Two chunks of a few layers each, and the whole model in one.
    let layer = WIDTH * WIDTH + WIDTH;
    let whole = train(&base, 0, ChunkSize::PerParameter, 0);
    let per_parameter = train(&base, 3, ChunkSize::PerParameter, 0);
    for elements in [3 * layer, LAYERS * layer] {
        let chunked = train(&base, 3, ChunkSize::Elements(elements), 0);
        println!(
            "{elements} elements a chunk, {} chunks: forward launches {:?} (stage 0: {:?}), \
             optimizer step launches {:?}",
            chunked.chunks, chunked.forward, whole.forward, chunked.step
        );
        assert!(
            chunked.chunks < 2 * LAYERS,
            "{elements}: chunks of several members"
        );
        for (got, stage0) in chunked.forward.iter().zip(&whole.forward) {
            assert!(
                *got <= stage0 + chunked.chunks,
                "{elements} elements a chunk: a forward launched {got} kernels, more than \
                 stage 0's {stage0} plus one gather per chunk ({})",
                chunked.chunks
            );
        }
        for &got in &chunked.step {
            assert_eq!(
                got, chunked.chunks,
                "{elements} elements a chunk: the fused step launched {got} kernels for {} \
                 chunks (one each)",
                chunked.chunks
            );
        }
        assert!(
            params_bits_equal(&chunked.params, &per_parameter.params),
            "{elements} elements a chunk trains the bits of one parameter per chunk"
        );
    }
}

#[test]
fn a_replicated_chunk_joins_its_gradients_in_one_launch_per_16_members() {
    let Some((_one, base)) =
        start("a_replicated_chunk_joins_its_gradients_in_one_launch_per_16_members")
    else {
        return;
    };
    let whole = LAYERS * (WIDTH * WIDTH + WIDTH);
    let reference = train(&base, 0, ChunkSize::PerParameter, 0);
    // A replicated chunk's gradients come member by member, in the order backward produced
    // them, and are joined for its step: 2 × `LAYERS` members here, fewer than the 16 one
    // pack launch takes, all a multiple of 4 elements long (one vector width). Stage 0 with
    // the whole model in one replicated chunk: one launch to join, one to step. Stage 3 with
    // the biases below the persistence threshold: the weights' sharded chunk is stepped as
    // the reduction delivered its row (one launch), the biases' replicated chunk joined and
    // stepped (two).
    for (stage, persist_below, chunks, launches) in [(0, 0, 1, 2), (3, WIDTH + 1, 2, 3)] {
        let chunked = train(&base, stage, ChunkSize::Elements(whole), persist_below);
        println!(
            "stage {stage}, {} chunks: optimizer step launches {:?}",
            chunked.chunks, chunked.step
        );
        assert_eq!(chunked.chunks, chunks, "stage {stage}: chunks");
        for &got in &chunked.step {
            assert_eq!(
                got,
                launches,
                "stage {stage}: the fused step launched {got} kernels; a replicated chunk of \
                 {} members takes one to join its gradients and one to step",
                2 * LAYERS
            );
        }
        assert!(
            params_bits_equal(&chunked.params, &reference.params),
            "stage {stage}: chunks train the bits of one parameter per chunk at stage 0"
        );
    }
}

/// A rank alone reduces its buckets in place. It waits for the device once per bucket while a
/// sampler on another thread reads the device's memory (so that the bucket's short peak lasts
/// until read), and not at all otherwise: the counts show each, and both train the same bits.
#[test]
fn a_rank_alone_waits_for_the_device_per_bucket_only_while_its_memory_is_sampled() {
    let Some((_one, base)) =
        start("a_rank_alone_waits_for_the_device_per_bucket_only_while_its_memory_is_sampled")
    else {
        return;
    };
    let device = WgpuDevice::default();
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_chunk_size(ChunkSize::PerParameter);
    let run = |sampled: bool| {
        let sampler = sampled.then(|| {
            DeviceMemorySampler::start::<Plain>(&device, Duration::from_millis(5))
                .expect("wgpu's memory is counted")
        });
        assert_eq!(peaks_watched(), sampled);
        let mut ranks = launch::<Plain, _, _, ZeroError>(1, std::slice::from_ref(&device), |ctx| {
            let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
            let mut optimizer = ZeroOptimizer::new(&zero, AdamConfig::new()).expect("valid");
            for step in 0..STEPS {
                let loss = model.loss(input::<Train>(step, ctx.device()));
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optimizer.step(1e-3, model, grads);
            }
            Ok((zero.counts(), param_values(&model)))
        })
        .unwrap();
        drop(sampler);
        ranks.swap_remove(0)
    };
    let (unsampled, params) = run(false);
    let (sampled, sampled_params) = run(true);
    println!("without a sampler: {unsampled:?}\nwith one: {sampled:?}");
    let buckets = unsampled.reduce_scatters + unsampled.all_reduces;
    assert!(buckets > 0, "{unsampled:?}");
    assert_eq!(unsampled.syncs, 0, "no wait for the device: {unsampled:?}");
    assert_eq!(
        sampled.syncs,
        sampled.reduce_scatters + sampled.all_reduces,
        "one wait per bucket while sampled: {sampled:?}"
    );
    assert!(params_bits_equal(&params, &sampled_params));
}

/// Two ranks on the fused backend, their engine ordering its inputs on the device or not: the
/// same bits, and no more launches. Ordering on the device lends each rank's issuing thread
/// the training thread's fusion stream, so a collective's copies and packs join the
/// operations the training thread registered there; synchronising ranks drain that stream
/// before each collective instead. Either way the stream is cut where a collective reads it.
/// The engine is `LocalGroup` wrapped to say it orders on the device, as `NcclGroup` does by
/// default; the ranks share the one device, so a window counts both.
///
/// With the training thread waiting for each collective (no overlap, no prefetch) where the
/// stream is cut does not depend on the threads' timing: the launches are equal and repeat
/// exactly. With the reduction overlapped and gathers issued ahead, a collective that reads
/// the stream while the training thread is registering a fused block cuts that block in two,
/// on either path, so the counts move between runs by a few launches (one in eight runs at
/// stage 3 here without prefetch, up to four with it); the bound is one launch per
/// collective, which lending's operations would exceed if each of them cut the stream.
#[test]
fn fused_ranks_ordering_on_the_device_launch_what_synchronising_ranks_launch() {
    let test = "fused_ranks_ordering_on_the_device_launch_what_synchronising_ranks_launch";
    let Some((_one, base)) = start::<Autodiff<Zero<Fused>>>(test) else {
        return;
    };
    let device = WgpuDevice::default();
    let log = LaunchLog::install();
    let run = |config: &ZeroConfig, on_device: bool| {
        let train = || {
            let ranks = launch::<Fused, _, _, ZeroError>(2, std::slice::from_ref(&device), |ctx| {
                let engine = RecordingComm::new(ctx.engine().clone(), CallLog::default());
                let engine = if on_device {
                    engine.ordering_on_device()
                } else {
                    engine
                };
                let ctx = RankContext::new(ctx.device().clone(), Arc::new(engine));
                let (mut model, zero) = shard(base.clone(), &ctx, config)?;
                let mut optimizer = ZeroOptimizer::new(&zero, AdamConfig::new()).expect("valid");
                for step in 0..STEPS {
                    let input = input(2 * step + ctx.rank(), ctx.device());
                    let grads = GradientsParams::from_grads(model.loss(input).backward(), &model);
                    model = optimizer.step(1e-3, model, grads);
                }
                Ok((ctx.ordered().counters().snapshot(), param_values(&model)))
            })
            .unwrap();
            Fused::sync(&device).unwrap();
            ranks
        };
        let (ranks, launched) = log
            .launches::<WgpuRuntime, _>(&device, train)
            .expect("the launches are counted");
        let collectives: u64 = ranks.iter().map(|(counts, _)| counts.collectives()).sum();
        let params: Vec<_> = ranks
            .into_iter()
            .map(|(counts, params)| {
                assert!(counts.collectives() > 0, "{counts:?}");
                assert_eq!(counts.syncs == 0, on_device, "synchronisations: {counts:?}");
                params
            })
            .collect();
        (launched.len(), collectives as usize, params)
    };
    for stage in [2, 3] {
        let config = |overlap: bool, prefetch: usize| {
            ZeroConfig::new()
                .with_stage(stage)
                .with_overlap_comm(overlap)
                .with_prefetch(prefetch)
                .with_persist_below_numel(0)
                .with_chunk_size(ChunkSize::default_search())
        };
        // The first run of a kernel on the device may tune it: not counted.
        run(&config(true, 2), true);
        let waiting = config(false, 0);
        let (synchronising, _, reference) = run(&waiting, false);
        let (ordering, _, params) = run(&waiting, true);
        println!(
            "stage {stage}, no overlap: {ordering} launches ordering on the device, \
             {synchronising} synchronising"
        );
        assert_eq!(
            ordering, synchronising,
            "stage {stage}, no overlap: two ranks whose engine orders on the device launched \
             {ordering} kernels, synchronising ranks {synchronising}"
        );
        assert!(
            params_bits_equal(&params.concat(), &reference.concat()),
            "stage {stage}: the same bits"
        );
        let overlapped = config(true, 2);
        let (synchronising, collectives, sync_params) = run(&overlapped, false);
        let (ordering, _, params) = run(&overlapped, true);
        println!(
            "stage {stage}, overlap and prefetch: {ordering} launches ordering on the device, \
             {synchronising} synchronising, {collectives} collectives"
        );
        assert!(
            ordering <= synchronising + collectives,
            "stage {stage}, overlap and prefetch: ordering on the device launched {ordering} \
             kernels, more than synchronising's {synchronising} plus one per collective \
             ({collectives})"
        );
        assert!(
            params_bits_equal(&params.concat(), &sync_params.concat())
                && params_bits_equal(&params.concat(), &reference.concat()),
            "stage {stage}: overlap and prefetch train the same bits"
        );
    }
}
