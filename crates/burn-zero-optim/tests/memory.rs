//! Per-rank model-state memory against the ZeRO formula: stage 3 with f16 parameters and Adam
//! holds (2 + 2 + 12)·Ψ/N bytes — f16 parameter shard, f16 gradient shard, fp32 master copy and
//! Adam's two fp32 moments — each rank's share padded to whole blocks.

use burn::backend::Flex;
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::DType;
use burn_zero_comm::launch;
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::{CastParams, Train, base_model, micro_batch};

#[test]
fn stage3_mixed_precision_adam_holds_sixteen_bytes_per_parameter_over_n() {
    let base = base_model(&Default::default()).map(&mut CastParams(DType::F16));
    let numels: Vec<usize> = burn_zero_testing::param_values(&base)
        .iter()
        .map(Vec::len)
        .collect();
    let psi: usize = numels.iter().sum();
    let config = ZeroConfig::new().with_persist_below_numel(0);
    for world_size in [1, 2, 4] {
        let per_rank = launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
            let (mut model, zero) = shard(base.clone(), &ctx, &config)?;
            let mut optimizer =
                ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
            let (tokens, targets) = micro_batch::<Train>(ctx.rank(), ctx.device());
            let grads = GradientsParams::from_grads(model.loss(tokens, targets).backward(), &model);
            model = optimizer.step(1e-3, model, grads);
            let report = zero.memory_report();
            drop(model);
            Ok((report, optimizer.master_bytes(), optimizer.state_bytes()))
        })
        .unwrap();
        // Each rank's share of every parameter, padded to a whole block.
        let share: usize = numels.iter().map(|n| n.div_ceil(world_size)).sum();
        for (rank, (report, master, state)) in per_rank.iter().enumerate() {
            let params = report.parameter_shards.current as usize;
            let grads = report.gradient_shards.peak as usize;
            assert_eq!(
                params,
                2 * share,
                "f16 parameter shards, world {world_size}, rank {rank}"
            );
            assert_eq!(grads, 2 * share, "f16 gradient shards");
            assert_eq!(*master, 4 * share, "fp32 master copies");
            assert_eq!(*state, 8 * share, "Adam's two fp32 moments");
            // The module state's tracker shows the optimizer's part too.
            assert_eq!(report.master_weights.current as usize, *master);
            assert_eq!(report.optimizer_state.current as usize, *state);
            assert_eq!(report.gradient_accumulators.peak, 0, "no accumulation");
            assert_eq!(report.buckets.current, 0, "buckets freed after backward");
            let total = params + grads + master + state;
            let formula = 16.0 * psi as f64 / world_size as f64;
            // Padding adds at most one element per parameter and rank.
            assert!(
                total as f64 >= formula && total as f64 <= formula + 16.0 * numels.len() as f64
            );
            println!(
                "world {world_size}, rank {rank}: model state {total} B = (2+2+12)·{psi}/{world_size} = {formula} B + padding; buckets peak {} B",
                report.buckets.peak
            );
        }
    }
}
