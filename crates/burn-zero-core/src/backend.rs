//! The `Zero<B>` backend type.

use std::marker::PhantomData;

use burn::tensor::backend::{Backend, BackendTypes, DTypeUsageSet, ExecutionError};
use burn::tensor::{DType, TensorData};

use crate::tensor::ZeroTensor;

/// A backend decorator for ZeRO-style sharded data parallelism.
///
/// `Zero<B>` is `B` with one difference: its float tensors may be *sharded* parameters, of
/// which each rank holds a flat 1/N slice. Compute ops gather a sharded operand, run `B`'s op
/// and drop the full copy; view ops stay lazy. Int, bool and quantized tensors, devices and
/// element types are `B`'s own. Train with `Autodiff<Zero<B>>` and [`crate::shard()`] the model.
#[derive(Clone, Copy, Debug, Default)]
pub struct Zero<B> {
    _inner: PhantomData<B>,
}

impl<B: Backend> BackendTypes for Zero<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = ZeroTensor<B>;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> Backend for Zero<B> {
    fn ad_enabled(device: &Self::Device) -> bool {
        B::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        B::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        B::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("zero<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        B::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        B::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        B::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        B::device_count(type_id)
    }
}
