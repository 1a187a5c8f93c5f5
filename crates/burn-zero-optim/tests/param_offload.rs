//! Parameter offload (`Placement::offload_param_frac`) trained end to end through
//! `ZeroOptimizer`: the shards of the first chunks live in host memory and are uploaded for
//! each all-gather. Where the bytes sit changes, not one value: training is bitwise equal to
//! single-rank training with Burn's Adam, with a part or all of the chunks offloaded, one
//! parameter per chunk or several, with and without prefetch. After optimizer steps the memory
//! accounting is still the layout's (the shard bytes each chunk holds, computed here from the
//! parameters' shapes), and a step's transfers are counted, the optimizer's included.
//!
//! What offload does on its own — the accounting after sharding and over passes, the uploads
//! of a pass's gathers, its values, and the refusal of bad fractions, capacities, stages and
//! backends at `shard` — is checked without an optimizer in burn-zero-core's
//! `tests/param_offload.rs`.

mod common;

use burn::backend::Flex;
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero_comm::Counts;
use burn_zero_comm::launch;
use burn_zero_core::chunk::ChunkKind;
use burn_zero_core::{ChunkSize, Placement, ZeroConfig, ZeroError, ZeroState, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{Block, base_model_on, micro_batch, param_values};
use common::Train;

fn offloaded(frac: f64, chunk_size: ChunkSize) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(12)
        .with_chunk_size(chunk_size)
        .with_placement(Placement::fractions(frac, 0.0))
}

#[test]
fn offloaded_training_matches_single_rank_training_bitwise() {
    let device = Default::default();
    let base = base_model_on::<Flex>(&device);
    for world_size in [1, 2] {
        let (want, tolerance) = common::measure_reference::<Flex>(
            &base,
            world_size,
            6,
            &device,
            2,
            common::Claim::Bitwise,
        );
        assert_eq!(tolerance, common::Tolerance::Bitwise);
        for chunk_size in [ChunkSize::PerParameter, ChunkSize::Elements(256)] {
            for frac in [0.5, 1.0] {
                for prefetch in [0, 2] {
                    let config = offloaded(frac, chunk_size).with_prefetch(prefetch);
                    let got = common::sharded::<Flex>(&base, world_size, 6, &config, &device);
                    let what = format!(
                        "{chunk_size:?}, offload_param_frac {frac}, prefetch {prefetch}, world \
                         {world_size}"
                    );
                    common::assert_close(&got, &want, tolerance, &what);
                }
            }
        }
    }
}

/// The sharded chunks' shard bytes on this rank, (on the device, on the host), from the
/// layout: every sharded chunk's shard is its members' blocks (`ceil(numel / ranks)` elements
/// of 4 bytes each), on the host where its members are.
fn layout_bytes(zero: &ZeroState<Flex>) -> (u64, u64) {
    let store = zero.store();
    let params = store.params();
    let (mut on_device, mut on_host) = (0u64, 0u64);
    for chunk in store.chunks().chunks() {
        if chunk.kind != ChunkKind::Sharded {
            continue;
        }
        let bytes: u64 = chunk
            .members
            .iter()
            .map(|m| 4 * params[m.key].shape.num_elements().div_ceil(2) as u64)
            .sum();
        if chunk.members.iter().all(|m| store.is_on_host(m.key)) {
            on_host += bytes;
        } else {
            on_device += bytes;
        }
    }
    (on_device, on_host)
}

/// Shard bytes on the device and on the host after two optimizer steps, against the layout:
/// the optimizer's new shards stay where their chunks were placed. (The accounting right after
/// sharding and over passes without an optimizer, and the fraction's choice of chunks, are
/// checked in burn-zero-core's `tests/param_offload.rs`.)
#[test]
fn the_accounting_after_optimizer_steps_keeps_the_offloaded_chunks_shards_on_the_host() {
    let device = Default::default();
    let base = base_model_on::<Flex>(&device);
    for frac in [0.0, 0.5, 1.0] {
        let config = offloaded(frac, ChunkSize::Elements(256));
        let per_rank = launch::<Flex, _, _, ZeroError>(2, &[device], |ctx| {
            let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
            let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))?;
            for step in 0..2 {
                let (tokens, targets) = micro_batch(step * 2 + ctx.rank(), ctx.device());
                let grads =
                    GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
                model = optimizer.step(1e-2, model, grads);
            }
            let report = zero.memory_report();
            drop(model);
            Ok((layout_bytes(&zero), report))
        })
        .unwrap();
        for (rank, (layout, report)) in per_rank.iter().enumerate() {
            assert_eq!(
                (
                    report.parameter_shards.current,
                    report.host_parameter_shards.current
                ),
                *layout,
                "frac {frac}, rank {rank}, after 2 steps: (device, host) shard bytes"
            );
        }
    }
}

/// Every transfer between device and host is counted, and an offloaded chunk costs one per
/// gather and one per step: in a steady step with every sharded chunk offloaded, the uploads
/// equal the all-gathers the issuing thread counted (however many parameters a chunk holds,
/// with prefetch or without) and the optimizer reads each stepped chunk back once; with none
/// offloaded there are no transfers. An offloaded optimizer uploads each chunk it steps on the
/// device's behalf once, and keeps an offloaded chunk's update on the host. Every run ends
/// bitwise where single-rank training with Burn's Adam does. (The uploads of a pass's gathers
/// alone, with all, part or none of the chunks offloaded, are checked in burn-zero-core's
/// `tests/param_offload.rs`.)
#[test]
fn transfers_are_counted_one_per_gather_and_step_of_an_offloaded_chunk() {
    let device = Default::default();
    let base = base_model_on::<Flex>(&device);
    let want = common::reference::<Flex>(&base, 2, 3, &device);
    let check = |runs: Vec<Steady>, what: &str| {
        let params: Vec<_> = runs.iter().map(|r| r.params.clone()).collect();
        common::assert_close(&params, &want, common::Tolerance::Bitwise, what);
        runs
    };
    for chunk_size in [ChunkSize::PerParameter, ChunkSize::Elements(256)] {
        for prefetch in [0, 2] {
            let what = format!("{chunk_size:?}, prefetch {prefetch}");
            let config = |frac| offloaded(frac, chunk_size).with_prefetch(prefetch);
            for r in check(steady_step(&base, config(1.0)), &what) {
                let c = r.counts;
                assert!(c.all_gathers > 0, "{what}");
                assert_eq!(
                    (c.host_writes, c.host_reads),
                    (c.all_gathers, r.sharded),
                    "{what}"
                );
            }
            for r in check(steady_step(&base, config(0.0)), &what) {
                assert_eq!(
                    (r.counts.host_writes, r.counts.host_reads),
                    (0, 0),
                    "{what}"
                );
            }
            let optimizer_on_host = |config: ZeroConfig| {
                let param = config.placement.offload_param_frac;
                config.with_placement(Placement::fractions(param, 1.0))
            };
            for r in check(steady_step(&base, optimizer_on_host(config(0.0))), &what) {
                assert_eq!(r.counts.host_writes, r.sharded + r.replicated, "{what}");
            }
            for r in check(steady_step(&base, optimizer_on_host(config(1.0))), &what) {
                let c = r.counts;
                assert_eq!(c.host_writes, c.all_gathers + r.replicated, "{what}");
            }
        }
    }
}

/// One rank's third of three steps: its counts, its trainable sharded and replicated chunks,
/// and its parameters after it.
struct Steady {
    counts: Counts,
    sharded: u64,
    replicated: u64,
    params: Vec<Vec<f32>>,
}

/// Each of 2 Flex ranks' third step, everything placed by `config`.
fn steady_step(base: &Block<Train<Flex>>, config: ZeroConfig) -> Vec<Steady> {
    launch::<Flex, _, _, ZeroError>(2, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
        let trainable = |kind| {
            let chunks = zero.store().chunks().chunks().iter();
            chunks.filter(|c| c.trainable && c.kind == kind).count() as u64
        };
        let (sharded, replicated) = (
            trainable(ChunkKind::Sharded),
            trainable(ChunkKind::Replicated),
        );
        let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))?;
        let mut before = zero.counts();
        for step in 0..3 {
            before = zero.counts();
            let (tokens, targets) = micro_batch(step * 2 + ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(common::LR, model, grads);
        }
        let counts = zero.counts() - before;
        Ok(Steady {
            counts,
            sharded,
            replicated,
            params: param_values(&model),
        })
    })
    .unwrap()
}
