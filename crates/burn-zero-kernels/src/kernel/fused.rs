//! The kernels under Burn's fusion layer: `Fusion<CubeBackend<R, ..>>`.
//!
//! A fused tensor is an id in the device's fusion stream. Its `CubeTensor` is reached by
//! resolving it (the fusion server runs the pending operations that produce it). A kernel's
//! result goes back as the output of an operation registered in the stream, whose execution
//! only hands over the buffer the kernel already wrote: `FusionTensor`'s constructor is private
//! to burn-fusion, and registration is the public way to mint one. The kernels themselves run on
//! the caller's thread, never on the fusion server's.
//!
//! Public for the other engines of burn-zero that need the same bridge (NCCL collectives on
//! `burn::backend::Cuda`).

use std::any::TypeId;

use burn::tensor::backend::Backend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

/// Any `CubeBackend` on `R`: the fusion runtime, the device and the float handle conversion
/// do not depend on the element parameters.
type Cube<R> = CubeBackend<R, f32, i32, u8>;

/// A fused tensor of a `CubeBackend` on `R`.
pub type Fused<R> = FusionTensor<FusionCubeRuntime<R>>;

/// Whether `B`'s float tensors are fused tensors of a `CubeBackend` on `R`.
pub(crate) fn is_fused<B: Backend, R: CubeRuntime>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<Fused<R>>()
}

/// The `CubeTensor` a fused tensor stands for, once the operations producing it have run.
pub fn resolve<R: CubeRuntime>(tensor: Fused<R>) -> CubeTensor<R> {
    let client = tensor.client.clone();
    client.resolve_tensor_float::<Cube<R>>(tensor)
}

/// Runs `work` once the calling thread's pending fused operations on `device` are queued on its
/// cubecl stream: the fusion layer keeps operations back to fuse them, and device work that
/// must come after them in the stream (a queue mark) must first let them through. The host
/// waits for the fusion server to hand them to cubecl, not for the device to run them. `work`
/// runs with the calling thread's stream as its own.
pub(crate) fn after_pending<R: CubeRuntime, T: Send + 'static>(
    device: &R::Device,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    burn_fusion::get_client::<Cube<R>>(device).sync(work)
}

/// A fused tensor on `tensor`'s device holding `tensor` (already computed).
pub fn register<R: CubeRuntime>(tensor: CubeTensor<R>) -> Fused<R> {
    let client = burn_fusion::get_client::<Cube<R>>(&tensor.device);
    let out = TensorIr::uninit(
        client.create_empty_handle(),
        tensor.meta.shape().clone(),
        tensor.dtype,
    );
    let desc = CustomOpIr::new("burn_zero_computed", &[], &[out]);
    let mut outputs = client.register(
        OperationStreams::default(),
        OperationIr::Custom(desc.clone()),
        Computed { desc, tensor },
    );
    outputs
        .pop()
        .expect("the operation declares exactly one output")
}

/// The operation that makes an already computed tensor the value of a fused tensor.
#[derive(Debug)]
struct Computed<R: CubeRuntime> {
    desc: CustomOpIr,
    tensor: CubeTensor<R>,
}

impl<R: CubeRuntime> Operation<FusionCubeRuntime<R>> for Computed<R> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<FusionCubeRuntime<R> as FusionRuntime>::FusionHandle>,
    ) {
        let ([], [out]) = self.desc.as_fixed::<0, 1>();
        handles.register_float_tensor::<Cube<R>>(&out.id, self.tensor.clone());
    }
}
