//! Autodiff parity: `Autodiff<Zero<Flex>>` (Flex: bitwise deterministic on CPU) with the model
//! sharded across 1, 2 and 4 ranks gives, bit for bit, the loss of each rank's micro-batch and
//! the mean of the micro-batch gradients that world size 1 computes without sharding (averaged
//! in the same rank order).

use burn::backend::Flex;
use burn::module::Module;
use burn_zero_comm::launch;
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_testing::{Block, Materialise, Train, bits_equal, loss_and_grads, reference};

fn check_parity(world_size: usize, config: &ZeroConfig) {
    let device = Default::default();
    // Materialise the lazily initialised parameters once, so every clone holds these values.
    let base = Block::<Train>::new(&device);
    base.visit(&mut Materialise);
    let (ref_losses, ref_grads) = reference(&base.clone(), world_size);

    let per_rank = launch::<Flex, _, _, ZeroError>(world_size, &[device], |ctx| {
        let model = base.clone();
        let (model, _zero) = shard(model, &ctx, config)?;
        Ok(loss_and_grads(&model, ctx.rank(), ctx.device()))
    })
    .unwrap_or_else(|e| panic!("world {world_size}: {e}"));

    for (rank, (loss, grads)) in per_rank.into_iter().enumerate() {
        assert_eq!(
            loss.to_bits(),
            ref_losses[rank].to_bits(),
            "loss, world {world_size}, rank {rank}"
        );
        assert_eq!(grads.len(), ref_grads.len());
        for (i, (got, want)) in grads.iter().zip(&ref_grads).enumerate() {
            let same = bits_equal(got, want);
            assert!(
                same,
                "gradient of parameter #{i}, world {world_size}, rank {rank}:\n{got:?}\n{want:?}"
            );
        }
    }
}

#[test]
fn sharded_gradients_equal_the_unsharded_mean_bitwise() {
    let all_sharded = ZeroConfig::new().with_persist_below_numel(0);
    for world_size in [1, 2, 4] {
        check_parity(world_size, &all_sharded);
    }
}

#[test]
fn persistent_small_parameters_take_the_all_reduce_path() {
    // Biases and norms (≤ 14 elements) stay replicated; matrices are sharded.
    let config = ZeroConfig::new().with_persist_below_numel(20);
    check_parity(2, &config);
}

#[test]
fn no_cache_gathers_at_every_use_with_the_same_result() {
    let config = ZeroConfig::new()
        .with_persist_below_numel(0)
        .with_max_live_gathered_bytes(0);
    check_parity(2, &config);
}
