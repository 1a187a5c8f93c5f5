//! `NcclGroup` on Burn's default CUDA backend, `burn::backend::Cuda`: a `CubeBackend` under
//! Burn's fusion layer.
//!
//! Each collective resolves its input to the `CubeTensor` it stands for (the fusion server runs
//! whatever is pending for it), runs the `CubeBackend` collective on the calling thread, and
//! registers the result back into the fusion stream once the collective has completed. The blocking NCCL wait therefore
//! never happens on the device's fusion server thread, which every thread of the process shares:
//! a rank waiting there for its peers would stall all other work on the device, the
//! overlapped gradient reduction's included.

use std::sync::Arc;

use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use burn_fusion::Fusion;
use burn_zero_kernels::fused;
use cubecl_cuda::CudaRuntime;

use super::NcclGroup;
use crate::call::ReduceOp;
use crate::communicator::Communicator;
use crate::communicator::DataOp;
use crate::error::CommError;
use crate::issued::Issued;

/// Burn's default CUDA backend (`burn::backend::Cuda` with Burn's `fusion` feature, on by
/// default): `CubeBackend` under the fusion layer. [`NcclGroup`] runs collectives for it.
pub type FusedCudaBackend<F = f32, I = i32> = Fusion<CubeBackend<CudaRuntime, F, I, u8>>;

type Plain<F, I, BT> = CubeBackend<CudaRuntime, F, I, BT>;
type Fused<F, I, BT> = Fusion<Plain<F, I, BT>>;

/// The `CubeBackend` tensor a fused tensor stands for.
fn unfuse<F, I, BT>(tensor: Tensor<Fused<F, I, BT>, 1>) -> Tensor<Plain<F, I, BT>, 1>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let cube = fused::resolve::<CudaRuntime>(tensor.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(cube))
}

/// A fused tensor holding a finished `CubeBackend` result.
fn fuse<F, I, BT>(tensor: Tensor<Plain<F, I, BT>, 1>) -> Tensor<Fused<F, I, BT>, 1>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let fused = fused::register::<CudaRuntime>(tensor.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(fused))
}

impl<F, I, BT> Communicator<Fused<F, I, BT>> for NcclGroup
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn rank(&self) -> usize {
        Communicator::<Plain<F, I, BT>>::rank(self)
    }

    fn world_size(&self) -> usize {
        Communicator::<Plain<F, I, BT>>::world_size(self)
    }

    fn all_gather(
        &self,
        block: Tensor<Fused<F, I, BT>, 1>,
    ) -> Result<Tensor<Fused<F, I, BT>, 1>, CommError> {
        self.issue(DataOp::AllGather, block)?.wait()
    }

    fn reduce_scatter(
        &self,
        input: Tensor<Fused<F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<Fused<F, I, BT>, 1>, CommError> {
        self.issue(DataOp::ReduceScatter(op), input)?.wait()
    }

    fn all_reduce(
        &self,
        input: Tensor<Fused<F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<Fused<F, I, BT>, 1>, CommError> {
        self.issue(DataOp::AllReduce(op), input)?.wait()
    }

    fn all_to_all(
        &self,
        input: Tensor<Fused<F, I, BT>, 1>,
    ) -> Result<Tensor<Fused<F, I, BT>, 1>, CommError> {
        self.issue(DataOp::AllToAll, input)?.wait()
    }

    fn broadcast(
        &self,
        buffer: Tensor<Fused<F, I, BT>, 1>,
        root: usize,
    ) -> Result<Tensor<Fused<F, I, BT>, 1>, CommError> {
        self.issue(DataOp::Broadcast { root }, buffer)?.wait()
    }

    /// The `CubeBackend` collective on the tensor the input stands for; the result joins the
    /// fusion stream of the thread that waits for it, once it has completed.
    fn issue(
        &self,
        op: DataOp,
        input: Tensor<Fused<F, I, BT>, 1>,
    ) -> Result<Issued<Fused<F, I, BT>>, CommError> {
        Communicator::<Plain<F, I, BT>>::issue(self, op, unfuse(input))
            .map(|issued| issued.map(fuse))
    }

    fn barrier(&self) -> Result<(), CommError> {
        Communicator::<Plain<F, I, BT>>::barrier(self)
    }

    fn duplicate(&self) -> Result<Arc<dyn Communicator<Fused<F, I, BT>>>, CommError> {
        Ok(Arc::new(self.duplicate_group()?))
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator<Fused<F, I, BT>>>, CommError> {
        Ok(Arc::new(self.split_group(color)?))
    }

    fn abort(&self, reason: &str) {
        Communicator::<Plain<F, I, BT>>::abort(self, reason)
    }

    fn report_failure(&self, reason: &str) {
        self.note_failure(reason);
    }

    fn first_failure(&self) -> Option<(usize, String)> {
        self.cause()
    }

    /// As on the plain backend. Resolving a fused input lets its stream's pending operations
    /// through to cubecl first, so the flag signalled after it comes after them; a caller that
    /// marks its queue instead of finishing it gets the same (`QueueMark` lets the marking
    /// thread's pending operations through before it marks), and work run in a lent queue
    /// (`ThreadQueue`) joins the lender's fusion stream.
    fn orders_inputs_on_device(&self) -> bool {
        Communicator::<Plain<F, I, BT>>::orders_inputs_on_device(self)
    }

    fn count_into(&self, counters: &std::sync::Arc<crate::counters::RankCounters>) {
        <NcclGroup as Communicator<super::CudaBackend>>::count_into(self, counters);
    }
}
