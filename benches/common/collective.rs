//! The collectives the bandwidth benchmarks time, with nccl-tests' size and bandwidth
//! conventions: `bytes` is the whole buffer (all-gather output, reduce-scatter input, all-reduce
//! buffer) of f32 elements.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero::comm::{CommError, Communicator, ReduceOp};

pub const KIB: usize = 1024;
pub const MIB: usize = KIB * KIB;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl Op {
    pub const ALL: [Op; 3] = [Op::AllGather, Op::ReduceScatter, Op::AllReduce];

    pub fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
        }
    }

    /// nccl-tests' bus-bandwidth factor.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::AllReduce => 2.0 * (n - 1.0) / n,
        }
    }

    /// Each rank's input for a `bytes` buffer over `world` ranks: filled with `rank + 1`.
    pub fn input<B: Backend>(
        self,
        bytes: usize,
        world: usize,
        rank: usize,
        device: &B::Device,
    ) -> Tensor<B, 1> {
        let full = bytes / 4;
        let len = match self {
            Op::AllGather => full / world,
            Op::ReduceScatter | Op::AllReduce => full,
        };
        Tensor::<B, 1>::ones([len], device).mul_scalar(rank as f32 + 1.0)
    }

    /// Issues the collective (reductions sum).
    pub fn call<B: Backend>(
        self,
        comm: &dyn Communicator<B>,
        input: Tensor<B, 1>,
    ) -> Result<Tensor<B, 1>, CommError> {
        match self {
            Op::AllGather => comm.all_gather(input),
            Op::ReduceScatter => comm.reduce_scatter(input, ReduceOp::Sum),
            Op::AllReduce => comm.all_reduce(input, ReduceOp::Sum),
        }
    }
}

/// `64KiB`, `16MiB`, …
pub fn label(bytes: usize) -> String {
    if bytes >= MIB {
        format!("{}MiB", bytes / MIB)
    } else {
        format!("{}KiB", bytes / KIB)
    }
}
