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

    // The references, computed once on the host: every rank is held to the same ones.
    let expected_gather: Vec<f32> = gather_in.iter().flat_map(|v| widen(v)).collect();
    let expected_scatter: Vec<Vec<f32>> = OPS.map(|op| widen(&reduce(&scatter_in, op))).into();
    let expected_reduce: Vec<Vec<f32>> = OPS.map(|op| widen(&reduce(&reduce_in, op))).into();
    for (rank, (gathered, scattered, reduced, sent)) in per_rank.into_iter().enumerate() {
        let ctx = format!(
            "world {world_size}, block {block}, {:?}, rank {rank}",
            T::DTYPE
        );
        assert_eq!(gathered, expected_gather, "all_gather, {ctx}");
        for (i, op) in OPS.into_iter().enumerate() {
            assert_eq!(
                scattered[i],
                expected_scatter[i][rank * block..(rank + 1) * block],
                "reduce_scatter({op}), {ctx}"
            );
            assert_eq!(reduced[i], expected_reduce[i], "all_reduce({op}), {ctx}");
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

/// On CPU backends results are written into buffers reused from call to call: a result still
/// held keeps its values through later collectives, and a dropped one's memory is written
/// again by the next collective of the same size.
fn reuse<B: Backend>() {
    use burn_zero_kernels::host::HostTensor;

    /// Address of a host tensor's first element.
    fn address<B: Backend>(tensor: &burn::tensor::Tensor<B, 1>) -> usize {
        let host = HostTensor::from_primitive::<B>(tensor.clone().into_primitive().tensor())
            .unwrap_or_else(|_| panic!("a host backend"));
        host.as_slice::<f32>().expect("contiguous f32").as_ptr() as usize
    }

    let world = 2;
    let block = 1001;
    let rounds = 3;
    let inputs: Vec<Vec<Vec<f32>>> = (0..rounds)
        .map(|round| {
            (0..world)
                .map(|r| input(50 + round as u64, r, block * world))
                .collect()
        })
        .collect();
    let per_rank = launch::<B, _, _, CommError>(world, &[Default::default()], |ctx| {
        let (rank, comm, device) = (ctx.rank(), ctx.comm(), ctx.device());
        let mut held = Vec::new();
        for round in &inputs {
            let x = tensor::<B, f32>(&round[rank], device);
            held.push((
                comm.reduce_scatter(x.clone(), ReduceOp::Sum)?,
                comm.all_reduce(x.clone(), ReduceOp::Max)?,
                comm.all_gather(x)?,
            ));
        }
        let held: Vec<_> = held
            .into_iter()
            .map(|(s, r, g)| (values(s), values(r), values(g)))
            .collect();
        // Dropped results: the next call of each size writes into one of their buffers.
        let x = tensor::<B, f32>(&inputs[0][rank], device);
        let first = comm.reduce_scatter(x.clone(), ReduceOp::Sum)?;
        let before = address(&first);
        drop(first);
        let again = comm.reduce_scatter(x, ReduceOp::Sum)?;
        Ok((held, before == address(&again)))
    })
    .unwrap();
    for (rank, (held, reused)) in per_rank.into_iter().enumerate() {
        assert!(
            reused,
            "rank {rank}: a dropped result's buffer was not reused"
        );
        for (round, (scattered, reduced, gathered)) in held.into_iter().enumerate() {
            let sum = widen(&reduce(&inputs[round], ReduceOp::Sum));
            assert_eq!(
                scattered,
                sum[rank * block..(rank + 1) * block],
                "round {round}"
            );
            assert_eq!(
                reduced,
                widen(&reduce(&inputs[round], ReduceOp::Max)),
                "round {round}"
            );
            let all: Vec<f32> = inputs[round].iter().flat_map(|v| widen(v)).collect();
            assert_eq!(gathered, all, "round {round}");
        }
    }
}

#[test]
fn flex_results_survive_buffer_reuse() {
    reuse::<Flex>();
}

#[test]
fn ndarray_results_survive_buffer_reuse() {
    reuse::<NdArray>();
}

/// Ranks that run ahead reuse their memory at once: on wgpu (a queue and a memory pool per
/// thread) a rank must not let go of another rank's buffer while its own work reading it is
/// still queued, or the owner's next upload lands in the buffer first. Many small collectives
/// back to back, each checked, make any such window show.
#[test]
fn wgpu_back_to_back_collectives() {
    if !burn_zero_testing::skip::wgpu_adapter("wgpu_back_to_back_collectives") {
        return;
    }
    type B = burn::backend::Wgpu;
    let device = burn::backend::wgpu::WgpuDevice::default();
    let world = 2;
    let block = 7;
    let rounds = 150;
    let per_rank = launch::<B, _, _, CommError>(world, std::slice::from_ref(&device), |ctx| {
        let (rank, comm, device) = (ctx.rank(), ctx.comm(), ctx.device());
        let mut seen = Vec::new();
        for round in 0..rounds {
            let salt = 7_000 + round as u64;
            let gathered = comm.all_gather(tensor::<B, f32>(&input(salt, rank, block), device))?;
            let scattered = comm.reduce_scatter(
                tensor::<B, f32>(&input(salt + 1, rank, block * world), device),
                ReduceOp::Max,
            )?;
            let reduced = comm.all_reduce(
                tensor::<B, f32>(&input(salt + 2, rank, block * world + 1), device),
                ReduceOp::Mean,
            )?;
            seen.push((values(gathered), values(scattered), values(reduced)));
        }
        Ok(seen)
    })
    .unwrap();
    for (rank, seen) in per_rank.into_iter().enumerate() {
        for (round, (gathered, scattered, reduced)) in seen.into_iter().enumerate() {
            let salt = 7_000 + round as u64;
            let inputs =
                |salt, len| -> Vec<Vec<f32>> { (0..world).map(|r| input(salt, r, len)).collect() };
            let all: Vec<f32> = inputs(salt, block).iter().flat_map(|v| widen(v)).collect();
            assert_eq!(gathered, all, "all_gather, rank {rank}, round {round}");
            let max = widen(&reduce(&inputs(salt + 1, block * world), ReduceOp::Max));
            assert_eq!(
                scattered,
                max[rank * block..(rank + 1) * block],
                "reduce_scatter(max), rank {rank}, round {round}"
            );
            let mean = widen(&reduce(
                &inputs(salt + 2, block * world + 1),
                ReduceOp::Mean,
            ));
            assert_eq!(
                reduced, mean,
                "all_reduce(mean), rank {rank}, round {round}"
            );
        }
    }
}
