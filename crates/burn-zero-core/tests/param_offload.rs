//! Parameter offload (`Placement::offload_param_frac`), without an optimizer: the shards of the
//! first chunks live in host memory and are uploaded for each all-gather. The memory accounting
//! is checked against the layout (the shard bytes each chunk holds, computed here from the
//! parameters' shapes), before and after passes; every upload is counted, one per gather of an
//! offloaded chunk, and a pass reads nothing back; where the bytes sit changes no loss and no
//! reduced gradient (bitwise the single-rank reference's); and bad fractions and capacities,
//! stages below 3 and an auto placement on a backend without a device-memory count are
//! refused at `shard`.
//!
//! Training through `ZeroOptimizer` with offloaded parameters, and the transfers of its steps,
//! are checked in burn-zero-optim's `tests/param_offload.rs`.

mod common;

use burn::backend::Flex;
use burn_zero_comm::{Counts, launch};
use burn_zero_core::chunk::ChunkKind;
use burn_zero_core::{
    Capacity, ChunkSize, MemoryReport, Placement, ZeroConfig, ZeroError, ZeroState, shard,
};
use burn_zero_testing::{Block, Train, base_model};
use common::{Values, assert_passes_equal, backward, grad_values, passes, reference_pass, remark};

const WORLD: usize = 2;
/// Passes of the transfer counts: the third is steady.
const PASSES: usize = 3;

fn offloaded(frac: f64, chunk_size: ChunkSize) -> ZeroConfig {
    ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(12)
        .with_chunk_size(chunk_size)
        .with_placement(Placement::fractions(frac, 0.0))
}

/// The sharded chunks' shard bytes on this rank, (on the device, on the host), from the
/// layout: every sharded chunk's shard is its members' blocks (`ceil(numel / ranks)` elements
/// of 4 bytes each), on the host where every member is (placement moves whole chunks).
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
            .map(|m| 4 * params[m.key].shape.num_elements().div_ceil(WORLD) as u64)
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
    (on_device, on_host)
}

/// What one rank saw: its layout's (device, host) shard bytes, its memory reports after
/// sharding and after two passes, and each pass's loss and reduced gradients.
struct Accounted {
    layout: (u64, u64),
    after_shard: MemoryReport,
    after_passes: MemoryReport,
    passes: Vec<(f32, Values)>,
}

/// The single-rank references of `passes` passes.
fn references(base: &Block<Train>, passes: usize) -> Vec<(Vec<f32>, Values)> {
    (0..passes)
        .map(|index| reference_pass(base, index, WORLD, WORLD, |_, _| false))
        .collect()
}

/// Each rank's layout bytes, memory reports and two passes under `config`.
fn account(base: &Block<Train>, config: &ZeroConfig) -> Vec<Accounted> {
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (model, zero) = shard(base.clone(), &ctx, config)?;
        let layout = layout_bytes(&zero);
        let after_shard = zero.memory_report();
        // The model stays alive while the report is read: its shards are what it counts.
        let (model, passes) = passes(model, &zero, 2, (ctx.rank(), WORLD), |_, _| false);
        let after_passes = zero.memory_report();
        drop(model);
        Ok(Accounted {
            layout,
            after_shard,
            after_passes,
            passes,
        })
    })
    .unwrap()
}

/// Shard bytes on the device and on the host after sharding and after two passes, against the
/// layout, on the host for the chunks the fraction takes, on the device otherwise; and the
/// passes' values are the reference's.
#[test]
fn the_accounting_moves_exactly_the_offloaded_chunks_shards_to_the_host() {
    let base = base_model(&Default::default());
    let want = references(&base, 2);
    for frac in [0.0, 0.5, 1.0] {
        let per_rank = account(&base, &offloaded(frac, ChunkSize::Elements(256)));
        let passes: Vec<_> = per_rank.iter().map(|r| r.passes.clone()).collect();
        assert_passes_equal(&passes, &want, &format!("offload_param_frac {frac}"));
        for (rank, got) in per_rank.iter().enumerate() {
            check_fraction(got.layout, frac, &format!("frac {frac}, rank {rank}"));
            for (when, report) in [
                ("after shard", &got.after_shard),
                ("after 2 passes", &got.after_passes),
            ] {
                assert_eq!(
                    (
                        report.parameter_shards.current,
                        report.host_parameter_shards.current
                    ),
                    got.layout,
                    "frac {frac}, rank {rank}, {when}: (device, host) shard bytes"
                );
            }
        }
    }
}

/// The fraction is of bytes, whole chunks taken while they fit: none, all, or some of them.
fn check_fraction((on_device, on_host): (u64, u64), frac: f64, what: &str) {
    let total = on_device + on_host;
    assert!(
        on_host as f64 <= frac * total as f64 + 0.5,
        "{what}: {on_host} of {total} bytes on the host"
    );
    match frac {
        0.0 => assert_eq!(on_host, 0, "{what}"),
        1.0 => assert_eq!(on_device, 0, "{what}"),
        _ => assert!(on_host > 0 && on_device > 0, "{what}: {on_host}"),
    }
}

/// Each rank's counts over its third pass (forward and backward), and each pass's loss and
/// reduced gradients.
fn steady_pass(base: &Block<Train>, config: &ZeroConfig) -> Vec<(Counts, Vec<(f32, Values)>)> {
    launch::<Flex, _, _, ZeroError>(WORLD, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut counts = Counts::default();
        let mut passes = Vec::new();
        for index in 0..PASSES {
            let before = zero.counts();
            let (loss, grads) = backward(&model, index * WORLD + ctx.rank(), false);
            // Counted before the gradients are read (gathered).
            counts = zero.counts() - before;
            passes.push((loss, grad_values(&model, &grads)));
            zero.clear_gather_cache();
            model = remark(model);
        }
        Ok((counts, passes))
    })
    .unwrap()
}

/// [`steady_pass`]'s counts, its values asserted bitwise at the references first.
fn steady_counts(
    base: &Block<Train>,
    config: &ZeroConfig,
    want: &[(Vec<f32>, Values)],
    what: &str,
) -> Vec<Counts> {
    let (counts, passes): (Vec<Counts>, Vec<_>) = steady_pass(base, config).into_iter().unzip();
    assert_passes_equal(&passes, want, what);
    counts
}

/// Every transfer between device and host is counted, and an offloaded chunk costs one upload
/// per gather: in a steady pass with every sharded chunk offloaded the uploads equal the
/// all-gathers the issuing thread counted (however many parameters a chunk holds, with
/// prefetch or without); with part of them offloaded they are fewer, with none there are
/// none; and a pass without an optimizer reads nothing back to the host.
#[test]
fn uploads_are_counted_one_per_gather_of_an_offloaded_chunk() {
    let base = base_model(&Default::default());
    let want = references(&base, PASSES);
    for chunk_size in [ChunkSize::PerParameter, ChunkSize::Elements(256)] {
        for prefetch in [0, 2] {
            let config = |frac| offloaded(frac, chunk_size).with_prefetch(prefetch);
            let what = format!("{chunk_size:?}, prefetch {prefetch}");
            for c in steady_counts(&base, &config(1.0), &want, &what) {
                assert!(c.all_gathers > 0, "{what}");
                assert_eq!((c.host_writes, c.host_reads), (c.all_gathers, 0), "{what}");
            }
            for c in steady_counts(&base, &config(0.5), &want, &what) {
                assert!(
                    c.host_writes > 0 && c.host_writes < c.all_gathers,
                    "{what}: {c:?}"
                );
                assert_eq!(c.host_reads, 0, "{what}: {c:?}");
            }
            for c in steady_counts(&base, &config(0.0), &want, &what) {
                assert_eq!((c.host_writes, c.host_reads), (0, 0), "{what}");
            }
        }
    }
}

/// Each case's configuration, and the words its error must contain.
fn refused_cases() -> Vec<(ZeroConfig, &'static str)> {
    let placed = |placement: Placement| ZeroConfig::new().with_placement(placement);
    let auto = |mib| Placement::auto(Capacity::MiB(mib));
    let fraction = "offload_param_frac must be a fraction";
    vec![
        (placed(Placement::fractions(-0.1, 0.0)), fraction),
        (placed(Placement::fractions(1.5, 0.0)), fraction),
        (placed(Placement::fractions(f64::NAN, 0.0)), fraction),
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
    ]
}

#[test]
fn bad_fractions_capacities_stages_and_backends_are_refused_by_name() {
    let device = Default::default();
    let base = base_model(&device);
    for (config, named) in refused_cases() {
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
