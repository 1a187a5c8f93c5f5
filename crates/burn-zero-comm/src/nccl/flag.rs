//! The device flags that order an NCCL group's stream after the streams that issue on it,
//! without the host waiting ([`super::NcclOptions::order_on_device`]).
//!
//! A one-thread kernel on the issuing thread's stream writes the next number of a sequence
//! into a flag after everything queued there; the group's stream waits on the device for the
//! flag to reach it (`cuStreamWaitValue32`, greater-or-equal) before NCCL runs. Each issuing
//! stream has its own flag: one stream runs its writes in order, so its flag only grows, while
//! two threads sharing one flag could have their writes land in the other order, and a wait
//! for the slower thread's number would pass on the faster one's. Threads that queue on one
//! stream (the issuing thread runs a position's work in the stream of the thread that took
//! it, `ThreadQueue`) take their numbers and launch their writes under one lock, so that
//! stream's order is the numbers' order.

use std::collections::HashMap;
use std::sync::Mutex;

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::prelude::ComputeClient;
use burn_cubecl::cubecl::stream_id::StreamId;
use burn_cubecl::tensor::CubeTensor;
use burn_zero_launch::sync::lock;
use cubecl_cuda::{CudaDevice, CudaRuntime};

use super::sys::DevicePtr;

/// The flags of one group, by issuing stream.
pub(crate) struct StreamFlags {
    device: CudaDevice,
    flags: Mutex<HashMap<StreamId, Flag>>,
}

/// One issuing stream's flag: a `u32` made on that stream's first collective and held for the
/// group's life, so nothing else ever gets its memory while a stream may wait on it.
struct Flag {
    tensor: CubeTensor<CudaRuntime>,
    /// The last number written into it.
    signals: u32,
}

impl StreamFlags {
    /// No flags yet, for a group on `device`.
    pub(crate) fn new(device: CudaDevice) -> Self {
        StreamFlags {
            device,
            flags: Mutex::new(HashMap::new()),
        }
    }

    /// Writes the next number into the calling thread's flag on its stream, after everything
    /// queued there (which cubecl orders after the input's writers on other streams when it
    /// resolves the input), and submits it; returns the flag's address and the number, for the
    /// group's stream to wait on. The first signal of a stream finishes its flag's zero on the
    /// host first, and calls `on_host_wait` to count it.
    pub(crate) fn signal(
        &self,
        client: &ComputeClient<CudaRuntime>,
        on_host_wait: impl FnOnce(),
    ) -> Result<(DevicePtr, u32), String> {
        let mut flags = lock(&self.flags);
        let flag = match flags.entry(StreamId::current()) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => {
                let handle = client.create_from_slice(&[0u8; 4]);
                // The zero is only queued: until it lands, the buffer holds whatever its
                // memory held before, and the group's stream, whose wait passes on any value at
                // or above the number it waits for, could start a collective before its input
                // is written.
                on_host_wait();
                <CubeBackend<CudaRuntime, f32, i32, u8> as burn::tensor::backend::Backend>::sync(
                    &self.device,
                )
                .map_err(|e| format!("zeroing the device flag: {e}"))?;
                entry.insert(Flag {
                    tensor: CubeTensor::new_contiguous(
                        client.clone(),
                        self.device.clone(),
                        Shape::new([1]),
                        handle,
                        DType::U32,
                    ),
                    signals: 0,
                })
            }
        };
        // Starts at 1, above the flag's first value; 2³² collectives would wrap it.
        flag.signals = flag.signals.wrapping_add(1);
        let value = flag.signals;
        burn_zero_kernels::flag::signal(&flag.tensor, value)
            .map_err(|e| format!("signalling the input: {e}"))?;
        // Queued work reaches CUDA only when cubecl's device thread submits it: the group's
        // stream must not wait for a number still in that queue.
        client
            .flush()
            .map_err(|e| format!("submitting the signal: {e:?}"))?;
        let resource = client
            .get_resource(flag.tensor.handle.clone())
            .map_err(|e| format!("the device flag: {e}"))?;
        Ok((DevicePtr(resource.resource().ptr), value))
    }
}
