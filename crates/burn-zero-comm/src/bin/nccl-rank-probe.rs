//! One rank of a multi-process NCCL job, for burn-zero-comm's CUDA tests (not meant for users).
//!
//! Started with the launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//! MASTER_PORT): creates its NcclGroup on GPU LOCAL_RANK through the TCP rendezvous, checks an
//! all-reduce and an all-gather, and prints `ok rank R of N`. Exits with 1 and the error
//! otherwise.

use std::time::Duration;

use burn::tensor::Tensor;
use burn_zero_comm::nccl::{CudaBackend, NcclGroup, NcclOptions};
use burn_zero_comm::{CommError, Communicator, ReduceOp};

type B = CudaBackend;

fn run() -> Result<String, CommError> {
    let options = NcclOptions {
        timeout: Duration::from_secs(60),
        init_timeout: Duration::from_secs(60),
        rendezvous_timeout: Duration::from_secs(60),
        check_schedule: true,
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
    Ok(format!("ok rank {rank} of {world}"))
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
