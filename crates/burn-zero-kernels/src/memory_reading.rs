//! [`DeviceMemory`]: one reading of a device's memory, as cubecl counts it. Its own module so
//! that the kernels that read it and the sampler that keeps the peak both depend on it, not
//! on each other.

/// Device memory as cubecl counts it, summed over every stream of the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes of live allocations.
    pub in_use: u64,
    /// Bytes cubecl has reserved from the device (live allocations, their padding and the
    /// free space of its pools): what the device has given up.
    pub reserved: u64,
}
