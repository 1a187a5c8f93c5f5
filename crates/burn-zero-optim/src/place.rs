//! Where a rank keeps its fp32 master shards, optimizer state and gradient accumulators: on the
//! device the model computes on, or offloaded to a host backend (the seeds' `cpu_offload` /
//! `offload_config {device: cpu}`).

use std::marker::PhantomData;

use burn::tensor::backend::Backend;
use burn::tensor::{Device, Tensor, TensorData};
use burn_zero_comm::RankCounters;

/// Where the optimizer's tensors live, for a model computing on `B`.
pub trait Place<B: Backend>: Send + Sync + Clone + 'static {
    /// The backend the master shards and optimizer state live on.
    type Host: Backend;

    /// Whether the masters, optimizer state and accumulators live in host memory (the memory
    /// accounting reports them apart from the device's).
    const STATE_ON_HOST: bool;

    /// Whether reduced gradient shards should go to host memory as they arrive (during
    /// backward), rather than stay on the device until the step: where the step runs, unless
    /// a placement says otherwise.
    const GRADIENTS_ON_HOST: bool = Self::STATE_ON_HOST;

    /// Moves a flat tensor from the model's device to the host; a transfer counts as a host
    /// read in `counters`.
    fn to_host(tensor: Tensor<B, 1>, counters: &RankCounters) -> Tensor<Self::Host, 1>;

    /// Moves a flat tensor from the host to the model's `device`, keeping its dtype; a transfer
    /// counts as a host write in `counters`.
    fn to_model(
        tensor: Tensor<Self::Host, 1>,
        device: &Device<B>,
        counters: &RankCounters,
    ) -> Tensor<B, 1>;

    /// The host device that corresponds to the model's `device`.
    fn host_device(device: &Device<B>) -> Device<Self::Host>;

    /// A flat tensor's values in host memory: read back from the device (a host read counted
    /// in `counters`) when the masters live there, taken as they are when they live on a host
    /// backend.
    fn into_host_data(tensor: Tensor<Self::Host, 1>, counters: &RankCounters) -> TensorData;

    /// A flat tensor where the masters live from values already in host memory (a gradient
    /// shard moved there during backward), keeping their dtype.
    fn from_host_data(data: TensorData, device: &Device<B>) -> Tensor<Self::Host, 1> {
        let dtype = data.dtype;
        Tensor::from_data(data, (&Self::host_device(device), dtype))
    }
}

/// Masters and optimizer state on the model's own device (no offload).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OnDevice;

impl<B: Backend> Place<B> for OnDevice {
    type Host = B;
    const STATE_ON_HOST: bool = false;

    fn to_host(tensor: Tensor<B, 1>, _counters: &RankCounters) -> Tensor<B, 1> {
        tensor
    }

    fn to_model(
        tensor: Tensor<B, 1>,
        _device: &Device<B>,
        _counters: &RankCounters,
    ) -> Tensor<B, 1> {
        tensor
    }

    fn host_device(device: &Device<B>) -> Device<B> {
        device.clone()
    }

    fn into_host_data(tensor: Tensor<B, 1>, counters: &RankCounters) -> TensorData {
        let data = tensor.into_data();
        counters.host_read(data.as_bytes().len());
        data
    }
}

/// Masters, optimizer state and gradient accumulators on backend `H`'s default device (a CPU
/// backend such as `Flex` or `NdArray`), while the model computes on another backend.
///
/// Each bucket's or chunk's reduced gradient shards are read back to host memory by the
/// reduction, in one transfer, during backward (replicated parameters' whole gradients at the
/// step); the step runs there and copies the updated shard back in fp32 before casting it to
/// the parameter's dtype on the device (a shard offloaded with `offload_param_frac` stays on
/// the host, cast there): the device then holds only parameters and gradients ((2 + 2)Ψ/N
/// bytes at stage 3 in half precision), the host the 12Ψ/N bytes of fp32 masters and Adam
/// moments.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Offload<H>(PhantomData<H>);

impl<B: Backend, H: Backend> Place<B> for Offload<H> {
    type Host = H;
    const STATE_ON_HOST: bool = true;

    fn to_host(tensor: Tensor<B, 1>, counters: &RankCounters) -> Tensor<H, 1> {
        let dtype = tensor.dtype();
        let data = tensor.into_data();
        counters.host_read(data.as_bytes().len());
        Tensor::from_data(data, (&Device::<H>::default(), dtype))
    }

    fn to_model(tensor: Tensor<H, 1>, device: &Device<B>, counters: &RankCounters) -> Tensor<B, 1> {
        let dtype = tensor.dtype();
        let data = tensor.into_data();
        counters.host_write(data.as_bytes().len());
        Tensor::from_data(data, (device, dtype))
    }

    fn host_device(_device: &Device<B>) -> Device<H> {
        Device::<H>::default()
    }

    fn into_host_data(tensor: Tensor<H, 1>, _counters: &RankCounters) -> TensorData {
        tensor.into_data()
    }
}
