//! `RankOrderReduction` over `LocalGroup`: the all-to-all against a host-side reference, and
//! every reduction in rank order bitwise equal to `LocalGroup`'s own (which sums in rank order
//! too), at world sizes 1–4, odd sizes, on NdArray and Flex (f32, f16, bf16) and on wgpu. An
//! engine without an all-to-all is refused by name.

mod common;

use std::sync::Arc;

use burn::backend::{Flex, NdArray};
use burn::tensor::backend::Backend;
use burn_zero_comm::{CommError, Communicator, RankOrderReduction, ReduceOp, launch};
use burn_zero_testing::engines::WithoutAllToAll;
use common::{RefFloat, input, tensor, values, widen};
use half::{bf16, f16};

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

/// What every rank got: the all-to-all, then each op's reduce-scatter and all-reduce in rank
/// order and from the engine itself.
struct Results {
    exchanged: Vec<f32>,
    in_order: Vec<(Vec<f32>, Vec<f32>)>,
    engine: Vec<(Vec<f32>, Vec<f32>)>,
}

fn check<B: Backend, T: RefFloat + Send + Sync>(
    device: &B::Device,
    world_size: usize,
    block: usize,
) {
    let salt = (world_size * 7_919 + block) as u64;
    let full = block * world_size;
    // All-reduce gets a length no world size divides: the rank-order path pads it.
    let odd = full + 1;
    let scatter_in: Vec<Vec<T>> = (0..world_size).map(|r| input(salt, r, full)).collect();
    let reduce_in: Vec<Vec<T>> = (0..world_size).map(|r| input(salt + 1, r, odd)).collect();
    let per_rank = launch::<B, _, _, CommError>(world_size, std::slice::from_ref(device), |ctx| {
        let (rank, engine, device) = (ctx.rank(), ctx.comm().clone(), ctx.device());
        let in_order = RankOrderReduction::new(engine.clone());
        let exchanged = values(in_order.all_to_all(tensor(&scatter_in[rank], device))?);
        let mut ordered = Vec::new();
        let mut own = Vec::new();
        for op in OPS {
            let (scatter, reduce) = (&scatter_in[rank], &reduce_in[rank]);
            ordered.push((
                values(in_order.reduce_scatter(tensor(scatter, device), op)?),
                values(in_order.all_reduce(tensor(reduce, device), op)?),
            ));
            own.push((
                values(engine.reduce_scatter(tensor(scatter, device), op)?),
                values(engine.all_reduce(tensor(reduce, device), op)?),
            ));
        }
        Ok(Results {
            exchanged,
            in_order: ordered,
            engine: own,
        })
    })
    .unwrap_or_else(|e| panic!("launch failed: {e}"));
    for (rank, got) in per_rank.into_iter().enumerate() {
        let what = format!(
            "world {world_size}, block {block}, {:?}, rank {rank}",
            T::DTYPE
        );
        // Block `rank` of every rank's input, in rank order.
        let expected: Vec<f32> = scatter_in
            .iter()
            .flat_map(|input| widen(&input[rank * block..(rank + 1) * block]))
            .collect();
        assert_eq!(got.exchanged, expected, "all_to_all, {what}");
        for (i, op) in OPS.into_iter().enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            let ((scatter, reduce), (own_scatter, own_reduce)) = (&got.in_order[i], &got.engine[i]);
            assert_eq!(
                bits(scatter),
                bits(own_scatter),
                "reduce_scatter({op}), {what}"
            );
            assert_eq!(bits(reduce), bits(own_reduce), "all_reduce({op}), {what}");
        }
    }
}

fn sweep<B: Backend, T: RefFloat + Send + Sync>(device: &B::Device) {
    for world_size in 1..=4 {
        for block in [1, 7, 4_099] {
            check::<B, T>(device, world_size, block);
        }
    }
}

#[test]
fn ndarray_f32() {
    sweep::<NdArray, f32>(&Default::default());
}

#[test]
fn flex_f32() {
    sweep::<Flex, f32>(&Default::default());
}

#[test]
fn flex_f16() {
    sweep::<Flex, f16>(&Default::default());
}

#[test]
fn flex_bf16() {
    sweep::<Flex, bf16>(&Default::default());
}

/// wgpu sums with Burn's ops on the device, as `LocalGroup` does there. Four ranks: the
/// inputs' partial sums of three are exact in f32, so only four tell an order from another.
#[test]
fn wgpu_f32() {
    if !burn_zero_testing::skip::wgpu_adapter("wgpu_f32") {
        return;
    }
    let device = burn::backend::wgpu::WgpuDevice::default();
    for world_size in [3, 4] {
        for block in [7, 4_099] {
            check::<burn::backend::Wgpu, f32>(&device, world_size, block);
        }
    }
}

/// Over an engine without an all-to-all, a reduction in rank order is the engine's named
/// error, on every rank, and no rank waits for another.
#[test]
fn an_engine_without_all_to_all_is_refused_by_name() {
    let errors = launch::<Flex, _, _, CommError>(2, &[Default::default()], |ctx| {
        let in_order = RankOrderReduction::new(Arc::new(WithoutAllToAll(ctx.comm().clone())));
        let x = tensor::<Flex, f32>(&input(5, ctx.rank(), 8), ctx.device());
        Ok(in_order
            .reduce_scatter(x, ReduceOp::Sum)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    for error in errors {
        assert!(error.contains("no all_to_all"), "{error}");
    }
}
