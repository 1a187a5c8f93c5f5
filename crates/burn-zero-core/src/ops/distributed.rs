//! `DistributedBackend` for `Zero<B>`, for any `B`: autodiff's gradient hooks, routed to the
//! rank's gradient reducer. Burn's own sync server is never started.

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::{
    DistributedBackend, DistributedConfig, DistributedParams, TensorRef,
};

use crate::backend::Zero;
use crate::reduce::hook;

impl<B: Backend> DistributedBackend for Zero<B> {
    fn start_communication_server(_devices: &[B::Device], _config: DistributedConfig) {}

    fn close_communication_server(_device: &B::Device) {}

    fn register_sync_parameters(_device: &B::Device, params: Vec<DistributedParams>) {
        hook::register_sync_parameters::<B>(&params);
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        hook::submit_gradient_sync::<B>(tensor.0, &params);
    }

    fn submit_sync_collective(_device: &B::Device) {
        hook::submit_sync_collective::<B>();
    }
}
