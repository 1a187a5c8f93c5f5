//! Every collective of `LocalGroup` against an independent host-side reference, for world sizes
//! 1–4, odd sizes and sizes over 1 MiB, on NdArray and Flex (f32, f16, bf16) and on wgpu.

mod common;

use burn::backend::{Flex, NdArray};
use burn::tensor::backend::Backend;
use burn_zero_comm::{CommError, ReduceOp, launch};
use common::{RefFloat, input, reduce, tensor, values, widen};
use half::{bf16, f16};

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

/// Runs all collectives at `world_size` with blocks of `block` elements and checks each rank's
/// results bit for bit against the reference.
fn check_collectives<B: Backend, T: RefFloat + Send + Sync>(
    device: &B::Device,
    world_size: usize,
    block: usize,
) {
    let salt = (world_size * 1_000_003 + block) as u64;
    let full = block * world_size;
    // all_reduce gets an odd length that no world size divides, to exercise uneven blocks.
    let odd = full + 1;
    let gather_in: Vec<Vec<T>> = (0..world_size).map(|r| input(salt, r, block)).collect();
    let scatter_in: Vec<Vec<T>> = (0..world_size).map(|r| input(salt + 1, r, full)).collect();
    let reduce_in: Vec<Vec<T>> = (0..world_size).map(|r| input(salt + 2, r, odd)).collect();
    let root = world_size - 1;

    let per_rank = launch::<B, _, _, CommError>(world_size, std::slice::from_ref(device), |ctx| {
        let (rank, comm, device) = (ctx.rank(), ctx.comm(), ctx.device());
        let gathered = values(comm.all_gather(tensor(&gather_in[rank], device))?);
        let mut scattered = Vec::new();
        let mut reduced = Vec::new();
        for op in OPS {
            scattered.push(values(
                comm.reduce_scatter(tensor(&scatter_in[rank], device), op)?,
            ));
            reduced.push(values(
                comm.all_reduce(tensor(&reduce_in[rank], device), op)?,
            ));
        }
        let sent = values(comm.broadcast(tensor(&gather_in[rank], device), root)?);
        comm.barrier()?;
        Ok((gathered, scattered, reduced, sent))
    })
    .unwrap_or_else(|e| panic!("launch failed: {e}"));

    let expected_gather: Vec<f32> = gather_in.iter().flat_map(|v| widen(v)).collect();
    for (rank, (gathered, scattered, reduced, sent)) in per_rank.into_iter().enumerate() {
        let ctx = format!(
            "world {world_size}, block {block}, {:?}, rank {rank}",
            T::DTYPE
        );
        assert_eq!(gathered, expected_gather, "all_gather, {ctx}");
        for (i, op) in OPS.into_iter().enumerate() {
            let whole = widen(&reduce(&scatter_in, op));
            assert_eq!(
                scattered[i],
                whole[rank * block..(rank + 1) * block],
                "reduce_scatter({op}), {ctx}"
            );
            assert_eq!(
                reduced[i],
                widen(&reduce(&reduce_in, op)),
                "all_reduce({op}), {ctx}"
            );
        }
        assert_eq!(sent, widen(&gather_in[root]), "broadcast, {ctx}");
    }
}

/// Blocks of an odd size and blocks over 1 MiB (for `T`'s width), at world sizes 1–4.
fn sweep<B: Backend, T: RefFloat + Send + Sync>(device: &B::Device) {
    let big = (1 << 20) / std::mem::size_of::<T>() + 3;
    for world_size in 1..=4 {
        for block in [1, 7, big] {
            check_collectives::<B, T>(device, world_size, block);
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

/// wgpu on whatever adapter the machine has; CI installs Mesa's software Vulkan (lavapipe).
#[test]
fn wgpu_f32() {
    if !burn_zero_testing::skip::wgpu_adapter("wgpu_f32") {
        return;
    }
    let device = burn::backend::wgpu::WgpuDevice::default();
    for world_size in [1, 2, 3] {
        for block in [7, (1 << 18) + 3] {
            check_collectives::<burn::backend::Wgpu, f32>(&device, world_size, block);
        }
    }
}

/// Runs are bitwise reproducible: the same inputs give the same bits, run after run.
#[test]
fn repeated_runs_are_bitwise_identical() {
    let run = || {
        launch::<NdArray, _, _, CommError>(4, &[Default::default()], |ctx| {
            let x = tensor::<NdArray, f32>(&input(99, ctx.rank(), 100_003), ctx.device());
            let y = ctx.comm().all_reduce(x, ReduceOp::Mean)?;
            Ok(values(y)
                .into_iter()
                .map(f32::to_bits)
                .collect::<Vec<u32>>())
        })
        .unwrap()
    };
    let first = run();
    assert!(first.iter().all(|r| r == &first[0]), "ranks disagree");
    assert_eq!(first, run());
}
