//! How much memory a device has, as its driver reports it: what an automatic placement plans
//! against when the user gives no capacity.
//!
//! Only the CUDA driver reports it (`cuMemGetInfo`, through cudarc): cubecl 0.10 counts the
//! bytes it has in use and reserved, per stream, but not the device's size, and wgpu exposes no
//! size at all. Other backends get `None`, and the user gives the capacity.

use burn::tensor::backend::Backend;

/// A device's memory as its driver reports it, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCapacity {
    /// The device's whole memory.
    pub total: u64,
    /// Memory no process holds now (allocations of this process included, so bytes that
    /// cubecl keeps reserved in its pools count as taken).
    pub free: u64,
}

/// Why the driver could not report a device's memory.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CapacityError {
    /// The CUDA driver library cannot be loaded.
    #[error(transparent)]
    MissingLibrary(#[from] crate::libraries::MissingLibrary),
    /// The device index is past the devices this process can see.
    #[error("{device} does not exist: {visible} CUDA device(s) visible to this process")]
    NoSuchDevice {
        /// The device asked for.
        device: String,
        /// How many devices the process sees.
        visible: usize,
    },
    /// The driver refused the query.
    #[error("the CUDA driver could not report the memory of {device}: {reason}")]
    Driver {
        /// The device asked for.
        device: String,
        /// The driver's error.
        reason: String,
    },
}

/// The memory of `device` when `B` computes on a CUDA device in this build (Burn's `Cuda`,
/// plain or fused: their device type is cubecl's `CudaDevice`); `None` for every other
/// backend.
pub fn device_capacity<B: Backend>(
    device: &B::Device,
) -> Option<Result<DeviceCapacity, CapacityError>> {
    #[cfg(feature = "cuda")]
    {
        let any: &dyn std::any::Any = device;
        any.downcast_ref::<cubecl_cuda::CudaDevice>().map(cuda)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

#[cfg(feature = "cuda")]
fn cuda(device: &cubecl_cuda::CudaDevice) -> Result<DeviceCapacity, CapacityError> {
    use cudarc::driver::CudaContext;

    crate::libraries::check(&[crate::CudaLibrary::Driver])?;
    let name = format!("{device:?}");
    let driver = |error: cudarc::driver::DriverError| CapacityError::Driver {
        device: name.clone(),
        reason: error.to_string(),
    };
    let visible = CudaContext::device_count().map_err(driver)?.max(0) as usize;
    if device.index >= visible {
        return Err(CapacityError::NoSuchDevice {
            device: name,
            visible,
        });
    }
    // The device's primary context, the one cubecl computes in: querying it creates nothing
    // that cubecl does not share.
    let (free, total) = CudaContext::new(device.index)
        .and_then(|context| context.mem_get_info())
        .map_err(driver)?;
    Ok(DeviceCapacity {
        total: total as u64,
        free: free as u64,
    })
}

#[cfg(test)]
mod tests {
    use burn::backend::{Flex, NdArray};

    use super::*;

    #[test]
    fn cpu_backends_report_no_capacity() {
        assert!(device_capacity::<Flex>(&Default::default()).is_none());
        assert!(device_capacity::<NdArray>(&Default::default()).is_none());
    }
}
