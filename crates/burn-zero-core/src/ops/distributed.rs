//! `DistributedBackend` for `Zero<B>`, for any `B`: autodiff's gradient hooks, routed to the
//! rank's group. Burn's own sync server is never started.

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::{
    DistributedBackend, DistributedConfig, DistributedParams, TensorRef,
};

use crate::backend::Zero;
use crate::hooks;

impl<B: Backend> DistributedBackend for Zero<B> {
    fn start_communication_server(_devices: &[B::Device], _config: DistributedConfig) {}

    fn close_communication_server(_device: &B::Device) {}

    fn register_sync_parameters(_device: &B::Device, params: Vec<DistributedParams>) {
        hooks::begin_backward::<B>(&params);
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        hooks::gradient_ready::<B>(tensor.0, &params);
    }

    fn submit_sync_collective(_device: &B::Device) {
        hooks::end_backward::<B>();
    }
}
