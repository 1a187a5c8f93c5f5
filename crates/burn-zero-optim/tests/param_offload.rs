//! Parameter offload (`Placement::offload_param_frac`): the shards of the first chunks live in
//! host memory and are uploaded for each all-gather. Where the bytes sit changes, not one
//! value: training is bitwise equal to single-rank training with Burn's Adam, with a part or
//! all of the chunks offloaded, one parameter per chunk or several, with and without prefetch.
//! The memory accounting is checked against the layout (the shard bytes each chunk holds,
//! computed here from the parameters' shapes), and bad fractions and capacities, stages below 3
//! and an auto placement on a backend without a device-memory count are refused at `shard`.

mod common;

use burn::backend::Flex;
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero_comm::Counts;
use burn_zero_comm::launch;
use burn_zero_core::chunk::ChunkKind;
use burn_zero_core::{Capacity, ChunkSize, Placement, ZeroConfig, ZeroError, shard};
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

/// Shard bytes on the device and on the host after sharding and after two steps, against the
/// layout: every sharded chunk's shard is its members' blocks (`ceil(numel / ranks)` elements
/// of 4 bytes each), on the host for the chunks the fraction takes, on the device otherwise.
#[test]
fn the_accounting_moves_exactly_the_offloaded_chunks_shards_to_the_host() {
    let device = Default::default();
    let base = base_model_on::<Flex>(&device);
    for frac in [0.0, 0.5, 1.0] {
        let config = offloaded(frac, ChunkSize::Elements(256));
        let per_rank = launch::<Flex, _, _, ZeroError>(2, &[device], |ctx| {
            let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
            let store = zero.store().clone();
            let params = store.params();
            let mut on_device = 0u64;
            let mut on_host = 0u64;
            for chunk in store.chunks().chunks() {
                if chunk.kind != ChunkKind::Sharded {
                    continue;
                }
                let bytes: u64 = chunk
                    .members
                    .iter()
                    .map(|m| 4 * params[m.key].shape.num_elements().div_ceil(2) as u64)
                    .sum();
                let host = chunk.members.iter().all(|m| store.is_on_host(m.key));
                assert!(
                    host || chunk.members.iter().all(|m| !store.is_on_host(m.key)),
                    "chunk #{} is split between device and host",
                    chunk.id
                );
                if host {
                    on_host += bytes;
                } else {
                    on_device += bytes;
                }
            }
            let after_shard = zero.memory_report();
            let mut optimizer =
                ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
            for step in 0..2 {
                let (tokens, targets) = micro_batch(step * 2 + ctx.rank(), ctx.device());
                let grads =
                    GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
                model = optimizer.step(1e-2, model, grads);
            }
            let after_steps = zero.memory_report();
            drop(model);
            Ok((on_device, on_host, after_shard, after_steps))
        })
        .unwrap();
        for (rank, (on_device, on_host, after_shard, after_steps)) in per_rank.iter().enumerate() {
            let total = on_device + on_host;
            // The fraction is of bytes, whole chunks taken while they fit.
            assert!(
                *on_host as f64 <= frac * total as f64 + 0.5,
                "frac {frac}, rank {rank}: {on_host} of {total} bytes on the host"
            );
            match frac {
                0.0 => assert_eq!(*on_host, 0),
                1.0 => assert_eq!(*on_device, 0),
                _ => assert!(*on_host > 0 && *on_device > 0, "frac {frac}: {on_host}"),
            }
            for (when, report) in [("after shard", after_shard), ("after 2 steps", after_steps)] {
                assert_eq!(
                    (
                        report.parameter_shards.current,
                        report.host_parameter_shards.current
                    ),
                    (*on_device, *on_host),
                    "frac {frac}, rank {rank}, {when}: (device, host) shard bytes"
                );
            }
        }
    }
}

#[test]
fn bad_fractions_capacities_stages_and_backends_are_refused_by_name() {
    let device = Default::default();
    let base = base_model_on::<Flex>(&device);
    let placed = |placement: Placement| ZeroConfig::new().with_placement(placement);
    let auto = |mib| Placement::auto(Capacity::MiB(mib));
    let cases = [
        (
            placed(Placement::fractions(-0.1, 0.0)),
            "offload_param_frac must be a fraction",
        ),
        (
            placed(Placement::fractions(1.5, 0.0)),
            "offload_param_frac must be a fraction",
        ),
        (
            placed(Placement::fractions(f64::NAN, 0.0)),
            "offload_param_frac must be a fraction",
        ),
        (
            placed(Placement::fractions(0.0, 2.0)),
            "offload_optim_frac must be a fraction",
        ),
        (
            placed(Placement::fractions(0.5, 0.0)).with_stage(2),
            "offload_param_frac needs stage 3",
        ),
        (
            placed(auto(-1.0)),
            "capacity must be a positive number of MiB, not -1",
        ),
        (
            placed(auto(64.0).with_offload_param_frac(0.5)),
            "set one of the two",
        ),
        (
            placed(Placement::auto(Capacity::Device)).with_stage(2),
            "the auto placement needs stage 3",
        ),
        (
            placed(Placement::fractions(0.0, 1.0).with_gpu_margin_mem_ratio(0.5)),
            "gpu_margin_mem_ratio shares out the device memory the auto placement leaves over",
        ),
        // Flex's memory is the host's: there is no device count to place by.
        (placed(auto(64.0)), "burn_flex"),
        (placed(Placement::auto(Capacity::Device)), "burn_flex"),
    ];
    for (config, named) in cases {
        let errors = launch::<Flex, _, _, String>(1, &[device], |ctx| {
            match shard(base.clone(), &ctx, &config) {
                Ok(_) => Ok(None),
                Err(error) => Ok(Some(error.to_string())),
            }
        })
        .unwrap();
        let error = errors[0]
            .clone()
            .unwrap_or_else(|| panic!("{named}: accepted"));
        assert!(error.contains(named), "{named}: {error}");
    }
}

/// Every transfer between device and host is counted, and an offloaded chunk costs one per
/// gather and one per step: in a steady step with every sharded chunk offloaded, the uploads
/// equal the all-gathers the issuing thread counted (however many parameters a chunk holds,
/// with prefetch or without) and the optimizer reads each stepped chunk back once; with none
/// offloaded there are no uploads, with part of them fewer. An offloaded optimizer uploads each
/// chunk it steps on the device's behalf once, and keeps an offloaded chunk's update on the
/// host. Every run ends bitwise where single-rank training with Burn's Adam does.
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
            for r in check(steady_step(&base, config(0.5)), &what) {
                let c = r.counts;
                assert!(
                    c.host_writes > 0 && c.host_writes < c.all_gathers,
                    "{what}: {c:?}"
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
