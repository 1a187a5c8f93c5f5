//! What cubecl holds on a device, summed over every stream.
//!
//! cubecl keeps one memory manager per stream, and a stream per thread that used the device
//! (thread ids map onto `max_streams` slots): a rank's training thread, its communication
//! threads and Burn's fusion each allocate on their own. `ComputeClient::memory_usage` reports
//! the calling thread's stream only, so the device's total is the sum over every slot, each
//! read by running the query on that slot's stream id. The figures are cubecl's own (bytes in
//! use and reserved), not burn-zero's accounting, which makes them an independent check of it.

use burn::tensor::backend::Backend;
use burn_cubecl::CubeRuntime;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl::stream_id::StreamId;

use super::{is_runtime, same_type_ref};
use crate::memory_reading::DeviceMemory;

/// The device memory of `device` on runtime `R`, summed over every stream slot.
pub(super) fn usage<B: Backend, R: CubeRuntime>(device: &B::Device) -> Option<DeviceMemory> {
    if !is_runtime::<B, R>() {
        return None;
    }
    let device: &R::Device = same_type_ref(device)?;
    let client = R::client(device);
    let slots = u64::from(CubeClRuntimeConfig::get().streaming.max_streams).max(1);
    let mut total = DeviceMemory::default();
    for value in 0..slots {
        let usage = StreamId { value }.executes(|| client.memory_usage()).ok()?;
        total.in_use += usage.bytes_in_use;
        total.reserved += usage.bytes_reserved;
    }
    Some(total)
}
