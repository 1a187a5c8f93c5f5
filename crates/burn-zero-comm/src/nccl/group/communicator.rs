//! [`Communicator`] for [`NcclGroup`]: the trait's collectives on CubeCL CUDA tensors, each
//! issued through the group's collective path and waited for by whoever reads it.

use std::sync::Arc;

use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use burn_zero_launch::sync::lock;
use cubecl_cuda::CudaRuntime;

use super::{Kind, NcclGroup};
use crate::call::{CollectiveOp, ReduceOp};
use crate::communicator::{Communicator, DataOp};
use crate::counters::RankCounters;
use crate::error::CommError;
use crate::issued::Issued;
use crate::nccl::sys::RedOp;

impl<F, I, BT> Communicator<CubeBackend<CudaRuntime, F, I, BT>> for NcclGroup
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(
        &self,
        block: Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>,
    ) -> Result<Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>, CommError> {
        self.issue(DataOp::AllGather, block)?.wait()
    }

    fn reduce_scatter(
        &self,
        input: Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>, CommError> {
        self.issue(DataOp::ReduceScatter(op), input)?.wait()
    }

    fn all_reduce(
        &self,
        input: Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>, CommError> {
        self.issue(DataOp::AllReduce(op), input)?.wait()
    }

    fn broadcast(
        &self,
        buffer: Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>,
        root: usize,
    ) -> Result<Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>, CommError> {
        self.issue(DataOp::Broadcast { root }, buffer)?.wait()
    }

    fn all_to_all(
        &self,
        input: Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>,
    ) -> Result<Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>, CommError> {
        self.issue(DataOp::AllToAll, input)?.wait()
    }

    /// Queues the collective on the group's stream and returns at once: the thread that
    /// waits on the result polls the collective's event (`InFlight`), so the issuing thread
    /// never waits for the device. A mean's division runs after completion, on the waiting
    /// thread.
    fn issue(
        &self,
        op: DataOp,
        input: Tensor<CubeBackend<CudaRuntime, F, I, BT>, 1>,
    ) -> Result<Issued<CubeBackend<CudaRuntime, F, I, BT>>, CommError> {
        // A mean is NCCL's sum, divided after it completed.
        let mean = match op {
            DataOp::ReduceScatter(op) | DataOp::AllReduce(op) => Some(op),
            _ => None,
        };
        let world_size = self.world_size;
        let (output, in_flight) =
            self.start(op.into(), input.into_primitive().tensor(), op.into())?;
        let result = move || {
            let output = Tensor::from_primitive(TensorPrimitive::Float(output));
            match mean {
                Some(op) => mean_if(output, op, world_size),
                None => output,
            }
        };
        Ok(match in_flight {
            Some(in_flight) => Issued::pending(Box::new(in_flight), result),
            None => Issued::ready(result()),
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        // NCCL has no barrier: an all-reduce of one element completes on a rank only once
        // every rank has joined it.
        let token = Tensor::<CubeBackend<CudaRuntime, f32, i32, u8>, 1>::zeros([1], &self.device);
        self.run(
            CollectiveOp::Barrier,
            token.into_primitive().tensor(),
            Kind::AllReduce(RedOp::Sum),
        )
        .map(|_| ())
    }

    fn duplicate(
        &self,
    ) -> Result<Arc<dyn Communicator<CubeBackend<CudaRuntime, F, I, BT>>>, CommError> {
        Ok(Arc::new(self.duplicate_group()?))
    }

    fn split(
        &self,
        color: usize,
    ) -> Result<Arc<dyn Communicator<CubeBackend<CudaRuntime, F, I, BT>>>, CommError> {
        Ok(Arc::new(self.split_group(color)?))
    }

    fn report_failure(&self, reason: &str) {
        self.note_failure(reason);
    }

    fn first_failure(&self) -> Option<(usize, String)> {
        self.cause()
    }

    fn orders_inputs_on_device(&self) -> bool {
        self.options.order_on_device
    }

    fn count_into(&self, counters: &Arc<RankCounters>) {
        // A group is given the counters of its one rank; a second call changes nothing.
        let _ = self.counters.set(counters.clone());
    }

    fn abort(&self, reason: &str) {
        self.note_failure(reason);
        let error = CommError::PeerFailed {
            rank: self.rank,
            reason: reason.to_string(),
        };
        match self.link.try_lock() {
            Ok(mut link) => {
                self.fail(&mut link, error);
            }
            // Another thread holds the communicator: it aborts it when it sees the request
            // (at its next poll, or this group's next call). The other processes hear of the
            // failure now, not then: the holder may be a short query after which this group is
            // never called again.
            Err(_) => {
                *lock(&self.abort_request) = Some(reason.to_string());
                self.family.fail(&error);
                if let Some(control) = &self.control {
                    control.abort(&error.to_string());
                }
            }
        }
    }
}

/// Divides a sum by the world size when the op is a mean, as `LocalGroup` does.
fn mean_if<B: burn::tensor::backend::Backend>(
    sum: Tensor<B, 1>,
    op: ReduceOp,
    world_size: usize,
) -> Tensor<B, 1> {
    match op {
        ReduceOp::Mean if world_size > 1 => sum.div_scalar(world_size as f64),
        _ => sum,
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Tensor;

    use super::*;

    #[test]
    fn mean_divides_once_and_only_for_several_ranks() {
        type Cpu = burn::backend::NdArray;
        let sum = Tensor::<Cpu, 1>::from_floats([6.0, 3.0], &Default::default());
        let mean: Vec<f32> = mean_if(sum.clone(), ReduceOp::Mean, 3)
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(mean, vec![2.0, 1.0]);
        let alone: Vec<f32> = mean_if(sum, ReduceOp::Mean, 1)
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(alone, vec![6.0, 3.0]);
    }
}
