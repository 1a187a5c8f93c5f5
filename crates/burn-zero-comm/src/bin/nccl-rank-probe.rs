//! One rank of a multi-process NCCL job, for burn-zero-comm's CUDA tests (not meant for users).
//!
//! Started with the launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//! MASTER_PORT): creates its NcclGroup on GPU LOCAL_RANK through the TCP rendezvous, checks an
//! all-reduce and an all-gather, and prints `ok rank R of N`. Exits with 1 and the error
//! otherwise.
//!
//! With `PROBE_RANK_ORDER=1` it then checks the reductions in rank order
//! (`RankOrderReduction` over the NCCL group): every reduction, on values whose sums depend on
//! the order they are added in, against `LocalGroup` at the same world size in this process
//! (its ranks are threads on the same GPU), bit for bit; and says how many of NCCL's own
//! reductions differed from `LocalGroup`'s (from three ranks on, NCCL's order is its own). Ranks
//! of one GPU need `NCCL_HOSTID` set differently in each process (NCCL before 2.30.7 refuses
//! two ranks of one communicator on one GPU).

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{DType, Tensor, TensorData};
use burn_zero_comm::nccl::{CudaBackend, CudaDevice, NcclGroup, NcclOptions};
use burn_zero_comm::{CommError, Communicator, RankOrderReduction, ReduceOp, launch};

type B = CudaBackend;

fn run() -> Result<String, CommError> {
    let options = NcclOptions {
        timeout: Duration::from_secs(60),
        init_timeout: Duration::from_secs(60),
        rendezvous_timeout: Duration::from_secs(60),
        check_schedule: true,
        // `PROBE_HOST_ORDER=1`: the host-synchronised path, for comparison.
        order_on_device: std::env::var("PROBE_HOST_ORDER").map_or(true, |v| v != "1"),
    };
    let group = NcclGroup::from_env(&options)?;
    let (rank, world) = (
        Communicator::<B>::rank(&group),
        Communicator::<B>::world_size(&group),
    );
    let device = group.device().clone();
    let mine = Tensor::<B, 1>::ones([8], &device).mul_scalar(rank as f32 + 1.0);
    let sum = group.all_reduce(mine.clone(), ReduceOp::Sum)?;
    let expected = (world * (world + 1) / 2) as f32;
    let sum: Vec<f32> = sum.into_data().to_vec().unwrap_or_default();
    if sum != vec![expected; 8] {
        return Err(CommError::InvalidGroup(format!(
            "all_reduce gave {sum:?}, expected {expected}"
        )));
    }
    let gathered: Vec<f32> = group
        .all_gather(mine)?
        .into_data()
        .to_vec()
        .unwrap_or_default();
    let expected: Vec<f32> = (0..world).flat_map(|r| [r as f32 + 1.0; 8]).collect();
    if gathered != expected {
        return Err(CommError::InvalidGroup(format!(
            "all_gather gave {gathered:?}"
        )));
    }
    Communicator::<B>::barrier(&group)?;
    let mut line = format!("ok rank {rank} of {world}");
    if std::env::var("PROBE_RANK_ORDER").is_ok_and(|v| v == "1") {
        line += &rank_order(group, &device)?;
    }
    Ok(line)
}

/// Rank `rank`'s values for case `salt`: magnitudes over eight decades with both signs, so
/// that sums of three or more depend on the order they are added in.
fn values(salt: usize, rank: usize, len: usize) -> Vec<f32> {
    let mut state =
        ((salt * 7919 + rank * 104_729 + len) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
            let sign = if state & 1 == 0 { 1.0 } else { -1.0 };
            (sign * 10f64.powf(unit * 8.0 - 4.0)) as f32
        })
        .collect()
}

/// Every reduction of this rank, labelled, as bytes.
type Results = Vec<(String, Vec<u8>)>;

fn reductions(comm: &dyn Communicator<B>, device: &CudaDevice) -> Result<Results, CommError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let tensor = |salt: usize, len: usize, dtype: DType| {
        let data = TensorData::new(values(salt, rank, len), [len]).convert_dtype(dtype);
        Tensor::<B, 1>::from_data(data, (device, dtype))
    };
    let bytes = |t: Tensor<B, 1>| t.into_data().as_bytes().to_vec();
    let mut out = Vec::new();
    for (d, dtype) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        for (o, op) in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min]
            .into_iter()
            .enumerate()
        {
            for block in [1, 4099] {
                let salt = d * 100 + o * 10 + block % 7;
                let scattered = comm.reduce_scatter(tensor(salt, block * world, dtype), op)?;
                out.push((
                    format!("reduce_scatter({op}) {dtype:?} block {block}"),
                    bytes(scattered),
                ));
                let reduced = comm.all_reduce(tensor(salt + 1, block * world + 1, dtype), op)?;
                out.push((
                    format!("all_reduce({op}) {dtype:?} {}", block * world + 1),
                    bytes(reduced),
                ));
            }
        }
        let exchanged = comm.all_to_all(tensor(d + 7, 64 * world, dtype))?;
        out.push((format!("all_to_all {dtype:?}"), bytes(exchanged)));
    }
    Ok(out)
}

/// The rank-order check (see the crate docs above).
fn rank_order(group: NcclGroup, device: &CudaDevice) -> Result<String, CommError> {
    let (rank, world) = (
        Communicator::<B>::rank(&group),
        Communicator::<B>::world_size(&group),
    );
    let devices = vec![device.clone(); world];
    let local = launch::<B, _, _, _>(world, &devices, |ctx| {
        reductions(ctx.comm().as_ref(), ctx.device())
    })
    .map_err(|e| CommError::InvalidGroup(format!("LocalGroup: {e}")))?
    .swap_remove(rank);
    let group: Arc<dyn Communicator<B>> = Arc::new(group);
    let nccl = reductions(group.as_ref(), device)?;
    let ordered = RankOrderReduction::new(group.clone());
    let in_rank_order = reductions(&ordered, device)?;
    let mut differ = Vec::new();
    for ((name, got), (_, expected)) in in_rank_order.iter().zip(&local) {
        if got != expected {
            differ.push(name.clone());
        }
    }
    if !differ.is_empty() {
        return Err(CommError::InvalidGroup(format!(
            "in rank order over NCCL, {} of {} reductions differ from LocalGroup's: {differ:?}",
            differ.len(),
            local.len()
        )));
    }
    let nccl_differs = nccl
        .iter()
        .zip(&local)
        .filter(|((_, got), (_, expected))| got != expected)
        .count();
    group.barrier()?;
    Ok(format!(
        "; rank order: {} reductions bitwise LocalGroup's; NCCL's own order: {nccl_differs} differ",
        local.len()
    ))
}

fn main() {
    match run() {
        Ok(line) => println!("{line}"),
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    }
}
