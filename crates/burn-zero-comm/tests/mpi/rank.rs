//! The rank side of the MPI tests: the test binary started again by `mpirun -np N` or
//! `zero-run --nproc-per-node N` (with `MPI_PROBE` set to the mode) joins the job with
//! `MpiGroup::from_env` and runs one mode.
//!
//! - `collectives BACKEND` (`flex`, `ndarray` or `wgpu`): every collective, reduction and
//!   dtype the backend stores, on inputs drawn from the rank and the case, compared bit for bit
//!   with the same collectives of a `LocalGroup` of N ranks that this process runs on threads
//!   over every rank's inputs; also on a duplicate and on the two halves of a split. Prints
//!   `ok N cases` or the first difference (exit 4).
//! - `fail RANK HOW`: one all-reduce, then rank RANK fails (`panic`, `abort`: says so through
//!   the group and exits 1, `hang`: sleeps forever) while the others wait in a second.
//! - `diverge`: with schedule checks on, rank 1 gathers where the others reduce.
//!
//! Errors print `error: E` and `after-ms T` (exit 3), then `first-failure R: REASON` when the
//! job's first cause is known.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::{Flex, NdArray, Wgpu};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_zero_comm::{CommError, Communicator, LocalGroup, MpiGroup, MpiOptions, ReduceOp};

/// Runs the mode `MPI_PROBE` names and ends the process: exit 0 after `ok …`, 3 after an
/// error, as the module documentation says.
pub fn run(mode: &str) -> ! {
    let args: Vec<String> = mode.split_whitespace().map(str::to_string).collect();
    let mode = args.first().map(String::as_str).unwrap_or("collectives");
    let timeout = std::env::var("PROBE_TIMEOUT_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(Duration::from_secs(60), Duration::from_millis);
    let options = MpiOptions::default()
        .with_timeout(timeout)
        .with_check_schedule(mode == "diverge");
    let started = Instant::now();
    let outcome = match (mode, args.get(1).map(String::as_str)) {
        ("collectives", Some("ndarray")) => {
            collectives::<NdArray>(&options, &[DType::F32, DType::F64])
        }
        ("collectives", Some("wgpu")) => collectives::<Wgpu>(&options, &[DType::F32]),
        ("collectives", _) => {
            collectives::<Flex>(&options, &[DType::F32, DType::F16, DType::BF16, DType::F64])
        }
        ("fail", _) => fail(&options, &args),
        ("diverge", _) => diverge(&options),
        (other, _) => Err(format!("unknown mode {other}")),
    };
    // On a line of its own, after the test harness's unfinished `test … ` line.
    println!();
    match outcome {
        Ok(message) => {
            println!("{message}");
            std::process::exit(0);
        }
        Err(error) => {
            println!("error: {error}");
            println!("after-ms {}", started.elapsed().as_millis());
            std::process::exit(3);
        }
    }
}

/// SplitMix64, for inputs that depend on nothing but the rank and the case.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Rank `rank`'s input for case `case`: values of mixed magnitudes and signs, so that sums of
/// three or more round differently in different orders.
fn input<B: Backend>(
    rank: usize,
    case: u64,
    len: usize,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, 1> {
    let values: Vec<f64> = (0..len as u64)
        .map(|i| {
            let bits = splitmix(case << 40 ^ (rank as u64) << 32 ^ i);
            let unit = (bits >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            let scale = [1e-3, 1.0, 1e3, 7.0][(bits & 3) as usize];
            unit * scale
        })
        .collect();
    Tensor::<B, 1>::from_data(TensorData::new(values, [len]), (device, DType::F64)).cast(dtype)
}

/// The same value bits, or the first index where they differ.
fn same_bits<B: Backend>(got: Tensor<B, 1>, want: Tensor<B, 1>) -> Result<(), String> {
    let (got, want) = (got.into_data(), want.into_data());
    if got.dtype != want.dtype || got.shape != want.shape {
        return Err(format!(
            "{:?}{:?} against {:?}{:?}",
            got.dtype, got.shape, want.dtype, want.shape
        ));
    }
    let size = got.dtype.size();
    match got
        .as_bytes()
        .chunks(size)
        .zip(want.as_bytes().chunks(size))
        .position(|(a, b)| a != b)
    {
        None => Ok(()),
        Some(index) => Err(format!("element {index} differs")),
    }
}

/// One collective on `comm` with this rank's input, and the same on every rank of `local`.
type Collective<B> =
    dyn Fn(&dyn Communicator<B>, Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> + Sync;

fn collectives<B: Backend>(options: &MpiOptions, dtypes: &[DType]) -> Result<String, String> {
    let group = MpiGroup::<B>::from_env(options).map_err(|e| e.to_string())?;
    let (rank, world) = (group.rank(), group.world_size());
    let device = B::Device::default();
    let ops = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];
    let mut cases: Vec<(String, Box<Collective<B>>)> = vec![
        ("all_gather".into(), Box::new(|c, x| c.all_gather(x))),
        // What `RankOrderReduction` builds on: equal here, its sums are equal too.
        ("all_to_all".into(), Box::new(|c, x| c.all_to_all(x))),
        (
            "broadcast from the last rank".into(),
            Box::new(move |c, x| c.broadcast(x, c.world_size() - 1)),
        ),
    ];
    for op in ops {
        cases.push((
            format!("reduce_scatter({op})"),
            Box::new(move |c, x| c.reduce_scatter(x, op)),
        ));
        cases.push((
            format!("all_reduce({op})"),
            Box::new(move |c, x| c.all_reduce(x, op)),
        ));
    }
    let duplicate = group.duplicate().map_err(|e| e.to_string())?;
    // Two colors: ranks 0, 2, 4… and 1, 3, 5…, as hybrid sharding's replica groups.
    let half = group.split(rank % 2).map_err(|e| e.to_string())?;
    let mut checked = 0;
    for (case, (name, collective)) in cases.iter().enumerate() {
        for (d, &dtype) in dtypes.iter().enumerate() {
            // Lengths that divide by every group size up to 4 (the reduce-scatters of the whole
            // group and of its halves), one that does not, and one shorter than the group (an
            // all-reduce's empty blocks).
            for len in [12 * 1031, 12, 12 * 8191, 5, 1] {
                if (name.starts_with("reduce_scatter") || name == "all_to_all") && len % 12 != 0 {
                    continue;
                }
                let case_id = (case * 16 + d * 4) as u64 + len as u64 * 997;
                let mine = input::<B>(rank, case_id, len, dtype, &device);
                let got = collective(&group, mine.clone()).map_err(|e| e.to_string())?;
                let want = reference::<B>(
                    world,
                    rank,
                    |r| input::<B>(r, case_id, len, dtype, &device),
                    collective.as_ref(),
                )?;
                same_bits(got, want.clone())
                    .map_err(|e| format!("{name} of {len} {dtype:?}: {e}"))?;
                let again =
                    collective(duplicate.as_ref(), mine.clone()).map_err(|e| e.to_string())?;
                same_bits(again, want)
                    .map_err(|e| format!("{name} of {len} {dtype:?} on a duplicate: {e}"))?;
                let members: Vec<usize> = (0..world).filter(|r| r % 2 == rank % 2).collect();
                let got = collective(half.as_ref(), mine).map_err(|e| e.to_string())?;
                let want = reference::<B>(
                    members.len(),
                    half.rank(),
                    |r| input::<B>(members[r], case_id, len, dtype, &device),
                    collective.as_ref(),
                )?;
                same_bits(got, want)
                    .map_err(|e| format!("{name} of {len} {dtype:?} on a split: {e}"))?;
                checked += 3;
            }
        }
    }
    group.barrier().map_err(|e| e.to_string())?;
    Ok(format!("ok {checked} cases on rank {rank} of {world}"))
}

/// `collective` on a `LocalGroup` of `world` ranks in this process, each given `input(r)`;
/// rank `rank`'s result.
fn reference<B: Backend>(
    world: usize,
    rank: usize,
    input: impl Fn(usize) -> Tensor<B, 1> + Sync,
    collective: &Collective<B>,
) -> Result<Tensor<B, 1>, String> {
    let groups = LocalGroup::<B>::new(world).map_err(|e| e.to_string())?;
    let results: Vec<Result<Tensor<B, 1>, CommError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, group)| {
                let x = input(r);
                scope.spawn(move || collective(&group, x))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reference rank"))
            .collect()
    });
    results
        .into_iter()
        .nth(rank)
        .unwrap_or_else(|| Err(CommError::InvalidGroup("no such rank".into())))
        .map_err(|e| e.to_string())
}

fn fail(options: &MpiOptions, args: &[String]) -> Result<String, String> {
    let failing: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let how = args.get(2).map_or("panic", String::as_str);
    let group: Arc<dyn Communicator<Flex>> =
        Arc::new(MpiGroup::<Flex>::from_env(options).map_err(|e| e.to_string())?);
    let device = Default::default();
    let x = input::<Flex>(group.rank(), 1, 64, DType::F32, &device);
    group
        .all_reduce(x.clone(), ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if group.rank() == failing {
        match how {
            "abort" => {
                group.abort("disk full (on purpose)");
                std::process::exit(1);
            }
            "hang" => loop {
                std::thread::sleep(Duration::from_secs(60));
            },
            _ => panic!("rank {failing} panics on purpose"),
        }
    }
    let result = group.all_reduce(x, ReduceOp::Sum);
    match result {
        Ok(_) => Ok("ok".into()),
        Err(error) => {
            let cause = group.first_failure();
            let mut message = error.to_string();
            if let Some((rank, reason)) = cause {
                message.push_str(&format!("\nfirst-failure {rank}: {reason}"));
            }
            Err(message)
        }
    }
}

fn diverge(options: &MpiOptions) -> Result<String, String> {
    let group = MpiGroup::<Flex>::from_env(options).map_err(|e| e.to_string())?;
    let device = Default::default();
    let x = input::<Flex>(group.rank(), 2, 4 * group.world_size(), DType::F32, &device);
    let result = if group.rank() == 1 {
        group.all_gather(x).map(drop)
    } else {
        group.reduce_scatter(x, ReduceOp::Sum).map(drop)
    };
    result.map(|()| "ok".into()).map_err(|e| e.to_string())
}
