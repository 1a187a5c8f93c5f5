//! The tests of the NCCL engine (built with the `cuda` feature).

use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use burn::tensor::{DType, Tensor, TensorData};
use burn_zero_comm::nccl::{
    CudaBackend, CudaDevice, NcclGroup, NcclOptions, cuda_device_count, launch_nccl,
};
use burn_zero_comm::{
    CapacityError, CommError, Communicator, DataOp, LaunchError, ReduceOp, device_capacity, launch,
};
use burn_zero_testing::skip;

type B = CudaBackend;

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

/// One data collective of each kind, for the tests that issue them without waiting.
const ONE_OF_EACH: [DataOp; 5] = [
    DataOp::AllGather,
    DataOp::ReduceScatter(ReduceOp::Mean),
    DataOp::AllReduce(ReduceOp::Sum),
    DataOp::AllToAll,
    DataOp::Broadcast { root: 0 },
];

/// Held by every GPU test: collectives of two communicators on the same GPUs, launched from
/// different threads, can deadlock each other, so GPU tests run one at a time.
static GPUS: Mutex<()> = Mutex::new(());

/// Every visible CUDA device and the GPU lock when at least `needed` devices are visible, or
/// `None` after printing `SKIPPED: <test>: <reason>`.
fn gpus(test: &str, needed: usize) -> Option<(MutexGuard<'static, ()>, Vec<CudaDevice>)> {
    let count = skip::cuda_devices(test, needed)?;
    let guard = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    Some((guard, (0..count).map(CudaDevice::new).collect()))
}

/// Rank `rank`'s values: multiples of 1/8 in [-4, 4), so that every sum over up to 8 ranks is
/// exact in f32, f16 and bf16 and does not depend on the order NCCL adds in.
fn values(salt: usize, rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = (salt * 7919 + rank * 104_729 + i * 31) % 64;
            (x as f32 - 32.0) / 8.0
        })
        .collect()
}

fn tensor(values: &[f32], dtype: DType, device: &CudaDevice) -> Tensor<B, 1> {
    let data = TensorData::new(values.to_vec(), [values.len()]).convert_dtype(dtype);
    Tensor::from_data(data, (device, dtype))
}

/// The tensor's bytes: comparisons are bit for bit.
fn bits(tensor: Tensor<B, 1>) -> (DType, Vec<u8>) {
    let data = tensor.into_data();
    (data.dtype, data.as_bytes().to_vec())
}

type Results = Vec<(String, (DType, Vec<u8>))>;

/// Every collective on `comm` with this rank's inputs, labelled.
fn exercise(
    comm: &dyn Communicator<B>,
    device: &CudaDevice,
    dtype: DType,
    block: usize,
) -> Result<Results, CommError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut out = Vec::new();
    let gathered = comm.all_gather(tensor(&values(1, rank, block), dtype, device))?;
    out.push(("all_gather".to_string(), bits(gathered)));
    for op in OPS {
        let input = tensor(&values(2, rank, block * world), dtype, device);
        out.push((
            format!("reduce_scatter({op})"),
            bits(comm.reduce_scatter(input, op)?),
        ));
        let input = tensor(&values(3, rank, block * world + 1), dtype, device);
        out.push((
            format!("all_reduce({op})"),
            bits(comm.all_reduce(input, op)?),
        ));
    }
    let input = tensor(&values(6, rank, block * world), dtype, device);
    out.push(("all_to_all".to_string(), bits(comm.all_to_all(input)?)));
    for root in [0, world - 1] {
        let input = tensor(&values(4 + root, rank, block), dtype, device);
        out.push((
            format!("broadcast(root {root})"),
            bits(comm.broadcast(input, root)?),
        ));
    }
    comm.barrier()?;
    Ok(out)
}

/// NCCL and LocalGroup (over the same CUDA backend and devices) agree bit for bit, with the
/// collectives ordered after their inputs on the device (the default) and by synchronisation.
fn check_parity(devices: &[CudaDevice]) {
    for order_on_device in [true, false] {
        let options = NcclOptions {
            order_on_device,
            ..NcclOptions::default()
        };
        check_parity_with(devices, &options);
    }
}

fn check_parity_with(devices: &[CudaDevice], options: &NcclOptions) {
    let world = devices.len();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for block in [1, 7, 4099] {
            let context = format!(
                "world {world}, {dtype:?}, block {block}, ordered on the device: {}",
                options.order_on_device
            );
            let nccl = launch_nccl::<f32, i32, u8, _, _, _>(devices, options, |ctx| {
                exercise(ctx.comm().as_ref(), ctx.device(), dtype, block)
            })
            .unwrap_or_else(|e| panic!("NCCL, {context}: {e}"));
            let local = launch::<B, _, _, _>(world, devices, |ctx| {
                exercise(ctx.comm().as_ref(), ctx.device(), dtype, block)
            })
            .unwrap_or_else(|e| panic!("LocalGroup, {context}: {e}"));
            for (rank, (nccl, local)) in nccl.into_iter().zip(local).enumerate() {
                assert_eq!(nccl.len(), local.len());
                for ((name, got), (_, expected)) in nccl.into_iter().zip(local) {
                    assert_eq!(got.0, dtype, "{name}, {context}, rank {rank}: dtype");
                    assert!(
                        got == expected,
                        "{name}, {context}, rank {rank}: NCCL and LocalGroup differ"
                    );
                }
            }
        }
    }
}

#[test]
fn nccl_matches_local_group_at_world_size_one() {
    let Some((_gpus, devices)) = gpus("nccl_matches_local_group_at_world_size_one", 1) else {
        return;
    };
    check_parity(&devices[..1]);
}

#[test]
fn nccl_matches_local_group_on_every_gpu() {
    let Some((_gpus, devices)) = gpus("nccl_matches_local_group_on_every_gpu", 2) else {
        return;
    };
    check_parity(&devices);
}

/// Collectives issued back to back from one thread without waiting, then read on another
/// thread in the reverse order (and one never read), give what the blocking calls give: each
/// result is held until its own collective completed, whichever thread asks.
#[test]
fn issued_collectives_are_read_in_any_order_on_another_thread() {
    let Some((_gpus, devices)) = gpus(
        "issued_collectives_are_read_in_any_order_on_another_thread",
        1,
    ) else {
        return;
    };
    let device = devices[0].clone();
    let group = NcclGroup::local_group(&devices[..1], &NcclOptions::default())
        .unwrap()
        .remove(0);
    let counters = std::sync::Arc::new(burn_zero_comm::RankCounters::default());
    Communicator::<B>::count_into(&group, &counters);
    let ops = ONE_OF_EACH;
    let input = |salt: usize| tensor(&values(salt, 0, 1 << 20), DType::F32, &device);
    let blocking: Vec<_> = ops
        .iter()
        .enumerate()
        .map(|(salt, op)| bits(op.run(&group, input(salt)).unwrap()))
        .collect();
    let waits_before = counters.snapshot().engine_waits;
    let mut issued: Vec<_> = ops
        .iter()
        .enumerate()
        .map(|(salt, op)| group.issue(*op, input(salt)).unwrap())
        .collect();
    // One more, never read: dropping it waits for it.
    drop(group.issue(DataOp::AllGather, input(9)).unwrap());
    let results = std::thread::spawn(move || {
        let mut results = Vec::new();
        while let Some(last) = issued.pop() {
            results.push(bits(last.wait().unwrap()));
        }
        results.reverse();
        results
    })
    .join()
    .unwrap();
    for ((op, got), expected) in ops.iter().zip(results).zip(blocking) {
        assert!(
            got == expected,
            "{op:?}: issued and blocking results differ"
        );
    }
    let waits = counters.snapshot().engine_waits - waits_before;
    println!(
        "engine waits for {} issued collectives: {waits}",
        ops.len() + 1
    );
    assert!(
        waits <= ops.len() as u64 + 1,
        "at most one wait per collective"
    );
}

/// Under Burn's fusion layer (`burn::backend::Cuda`), a collective issued by another thread in
/// the lent queue of the thread that wrote its input, handed over with a queue mark (the
/// ordering on the device) or after a synchronisation, reads what the input's pending fused
/// operations (held back by the fusion layer when the input is handed over) write, and its
/// result, read on the writing thread, equals the host's computation of them.
#[test]
fn fused_collectives_issued_in_a_lent_queue_read_their_pending_inputs() {
    use burn::tensor::backend::Backend;
    use burn_zero_comm::nccl::FusedCudaBackend;
    use burn_zero_kernels::{QueueMark, ThreadQueue};
    type F = FusedCudaBackend;
    let Some((_gpus, devices)) = gpus(
        "fused_collectives_issued_in_a_lent_queue_read_their_pending_inputs",
        1,
    ) else {
        return;
    };
    let device = devices[0].clone();
    let ops = ONE_OF_EACH;
    let len = 1 << 22;
    for order_on_device in [true, false] {
        let options = NcclOptions {
            order_on_device,
            ..NcclOptions::default()
        };
        let group = std::sync::Arc::new(
            NcclGroup::local_group(&devices[..1], &options)
                .unwrap()
                .remove(0),
        );
        assert_eq!(
            Communicator::<F>::orders_inputs_on_device(group.as_ref()),
            order_on_device
        );
        for (salt, op) in ops.into_iter().enumerate() {
            let start = values(salt, 0, len);
            // Exact in f32: multiples of 3/8 plus 1/2.
            let want: Vec<f32> = start.iter().map(|v| v * 3.0 + 0.5).collect();
            let input = Tensor::<F, 1>::from_data(TensorData::new(start, [len]), &device)
                .mul_scalar(3.0)
                .add_scalar(0.5);
            let mark = if order_on_device {
                QueueMark::here::<F>(&device)
            } else {
                F::sync(&device).unwrap();
                QueueMark::none()
            };
            let queue = ThreadQueue::current::<F>();
            assert!(queue.is_on_device());
            let issuing = group.clone();
            let issued = std::thread::spawn(move || {
                queue.run(|| {
                    mark.order_here();
                    Communicator::<F>::issue(issuing.as_ref(), op, input)
                })
            })
            .join()
            .expect("the issuing thread")
            .unwrap_or_else(|e| panic!("{op:?}: {e}"));
            let got = issued.wait().unwrap().into_data().to_vec::<f32>().unwrap();
            assert!(
                got == want,
                "{op:?}, ordered on the device: {order_on_device}: the result is not the \
                 host's computation of the input"
            );
        }
    }
}

#[test]
fn an_invalid_call_fails_the_group_for_good() {
    let Some((_gpus, devices)) = gpus("an_invalid_call_fails_the_group_for_good", 1) else {
        return;
    };
    let group = NcclGroup::local_group(&devices[..1], &NcclOptions::default())
        .unwrap()
        .remove(0);
    let device = devices[0].clone();
    let ok = group.all_reduce(tensor(&[1.0, 2.0], DType::F32, &device), ReduceOp::Sum);
    assert_eq!(
        bits(ok.unwrap()),
        bits(tensor(&[1.0, 2.0], DType::F32, &device))
    );

    let error = group
        .broadcast(tensor(&[1.0], DType::F32, &device), 1)
        .unwrap_err();
    assert_eq!(
        error,
        CommError::InvalidRoot {
            root: 1,
            world_size: 1
        }
    );
    let later = group
        .all_reduce(tensor(&[1.0], DType::F32, &device), ReduceOp::Sum)
        .unwrap_err();
    assert_eq!(later, error, "a failed group stays failed");
    assert_eq!(group.failure(), Some(error));
}

#[test]
fn a_duplicate_works_and_shares_the_fate_of_its_group() {
    let Some((_gpus, devices)) = gpus("a_duplicate_works_and_shares_the_fate_of_its_group", 1)
    else {
        return;
    };
    let world = devices.len();
    let groups = NcclGroup::local_group(&devices, &NcclOptions::default()).unwrap();
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .iter()
            .zip(&devices)
            .map(|(group, device)| {
                scope.spawn(move || {
                    let copy = Communicator::<B>::duplicate(group)?;
                    // Both work, in the same order on every rank.
                    let one =
                        group.all_reduce(tensor(&[1.0], DType::F32, device), ReduceOp::Sum)?;
                    let two = copy.all_reduce(tensor(&[2.0], DType::F32, device), ReduceOp::Sum)?;
                    copy.barrier()?;
                    // Ending the original ends its duplicate on this rank.
                    Communicator::<B>::abort(group, "test abort");
                    let after = copy
                        .all_reduce(tensor(&[1.0], DType::F32, device), ReduceOp::Sum)
                        .unwrap_err();
                    Ok::<_, CommError>((bits(one), bits(two), after))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    let one = bits(tensor(&[world as f32], DType::F32, &devices[0]));
    let two = bits(tensor(&[2.0 * world as f32], DType::F32, &devices[0]));
    for (rank, result) in results.into_iter().enumerate() {
        let (got_one, got_two, after) = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(
            (got_one, got_two),
            (one.clone(), two.clone()),
            "rank {rank}"
        );
        assert_eq!(
            after,
            CommError::PeerFailed {
                rank,
                reason: "test abort".into()
            }
        );
    }
}

#[test]
fn a_rank_that_stops_early_does_not_hang_the_others() {
    let Some((_gpus, devices)) = gpus("a_rank_that_stops_early_does_not_hang_the_others", 2) else {
        return;
    };
    let options = NcclOptions::default().with_timeout(Duration::from_secs(5));
    let started = std::time::Instant::now();
    let result = launch_nccl::<f32, i32, u8, _, _, _>(&devices[..2], &options, |ctx| {
        if ctx.rank() == 0 {
            return Ok(());
        }
        let input = tensor(&[1.0; 1024], DType::F32, ctx.device());
        ctx.comm().all_reduce(input, ReduceOp::Sum).map(|_| ())
    });
    match result {
        Err(LaunchError::RankFailed {
            rank: 1, failure, ..
        }) => {
            let text = failure.to_string();
            assert!(
                text.contains("aborted the communicator") || text.contains("NCCL failed"),
                "{text}"
            );
        }
        other => panic!("expected rank 1 to fail, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(60));
}

/// Runs `world` rank probes (`nccl-rank-probe`) as separate processes that meet through the
/// launcher environment, each with `env(rank)` added, and returns each rank's standard output
/// once all succeeded.
fn run_probes(world: usize, env: impl Fn(usize) -> Vec<(&'static str, String)>) -> Vec<String> {
    let port = burn_zero_testing::processes::free_port();
    // A test binary carried to another machine is told where the probe is (scripts/gpu-check.sh).
    let probe = std::env::var_os("NCCL_RANK_PROBE")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_nccl-rank-probe").into());
    // Start every rank before waiting for any: they meet in the rendezvous.
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&probe)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .envs(env(rank))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<_> = children
        .into_iter()
        .map(|child| child.wait_with_output().unwrap())
        .collect();
    outputs
        .iter()
        .enumerate()
        .map(|(rank, output)| {
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(output.status.success(), "rank {rank}: {stdout}\n{stderr}");
            assert!(
                stdout.contains(&format!("ok rank {rank} of {world}")),
                "{stdout}"
            );
            stdout
        })
        .collect()
}

#[test]
fn ranks_in_separate_processes_meet_through_the_environment() {
    let Some((_gpus, devices)) = gpus(
        "ranks_in_separate_processes_meet_through_the_environment",
        1,
    ) else {
        return;
    };
    run_probes(devices.len(), |_| Vec::new());
}

/// Three rank processes on one GPU (each told a host id of its own, so that NCCL takes them
/// for three hosts and connects them over sockets): the reductions in rank order over NCCL
/// (`RankOrderReduction`) are bitwise `LocalGroup`'s at three ranks, for every op and float
/// dtype, on values whose sums depend on the order they are added in. Three is the first
/// telling world size: a sum of two is the same in either order.
#[test]
fn three_ranks_on_one_gpu_reduce_in_rank_order_bitwise_as_local_group() {
    let Some((_gpus, _devices)) = gpus(
        "three_ranks_on_one_gpu_reduce_in_rank_order_bitwise_as_local_group",
        1,
    ) else {
        return;
    };
    let lines = run_probes(3, |rank| {
        vec![
            ("CUDA_VISIBLE_DEVICES", "0".to_string()),
            ("NCCL_HOSTID", format!("burn-zero-probe-{rank}")),
            ("PROBE_RANK_ORDER", "1".to_string()),
        ]
    });
    for line in lines {
        assert!(line.contains("bitwise LocalGroup's"), "{line}");
        // What NCCL's own order did, for the report.
        println!("{}", line.trim());
    }
}

#[test]
fn without_cuda_the_engine_reports_what_is_missing() {
    if cuda_device_count().expect("the CUDA driver answers") > 0 {
        skip::skip(
            "without_cuda_the_engine_reports_what_is_missing",
            "a CUDA device is visible",
        );
        return;
    }
    let error = NcclGroup::local_group(&[CudaDevice::new(0)], &NcclOptions::default()).unwrap_err();
    assert!(
        matches!(
            error,
            CommError::MissingLibrary(_)
                | CommError::Unavailable(_)
                | CommError::NoSuchDevice { .. }
        ),
        "{error}"
    );
    let text = error.to_string();
    assert!(
        text.contains("libcuda") || text.contains("libnccl") || text.contains("CUDA"),
        "{text}"
    );
}

#[test]
fn every_gpu_reports_its_memory_and_an_allocation_takes_from_the_free_part() {
    let test = "every_gpu_reports_its_memory_and_an_allocation_takes_from_the_free_part";
    let Some((_guard, devices)) = gpus(test, 1) else {
        return;
    };
    const TAKEN: usize = 256 << 20;
    for device in &devices {
        let read = || {
            device_capacity::<B>(device)
                .expect("Burn's CUDA backend has a capacity")
                .unwrap_or_else(|error| panic!("{device:?}: {error}"))
        };
        let before = read();
        assert!(
            before.total > TAKEN as u64 && before.free <= before.total,
            "{device:?}: {before:?}"
        );
        // cubecl reserves at least what it hands out: the driver's free memory falls by at
        // least the tensor's bytes while it lives.
        let held = Tensor::<B, 1>::zeros([TAKEN / 4], device);
        <B as burn::tensor::backend::Backend>::sync(device).unwrap();
        let during = read();
        assert_eq!(during.total, before.total, "{device:?}");
        assert!(
            during.free + TAKEN as u64 <= before.free,
            "{device:?}: {} MiB free before a {} MiB tensor, {} MiB with it",
            before.free >> 20,
            TAKEN >> 20,
            during.free >> 20
        );
        drop(held);
    }
}

#[test]
fn without_a_device_the_capacity_is_a_named_error() {
    if cuda_device_count().expect("the CUDA driver answers") > 0 {
        skip::skip(
            "without_a_device_the_capacity_is_a_named_error",
            "a CUDA device is visible",
        );
        return;
    }
    let error = device_capacity::<B>(&CudaDevice::new(0))
        .expect("Burn's CUDA backend has a capacity")
        .unwrap_err();
    assert!(
        matches!(
            error,
            CapacityError::MissingLibrary(_) | CapacityError::NoSuchDevice { .. }
        ),
        "{error}"
    );
    let text = error.to_string();
    assert!(
        text.contains("libcuda") || text.contains("CUDA device"),
        "{text}"
    );
}
