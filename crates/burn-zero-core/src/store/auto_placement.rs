//! The auto placement's warm-up and decision (`ZeroConfig::auto_placement_capacity_mib`, after
//! ColossalAI Gemini's auto policy).
//!
//! Gemini records the non-model memory of each period between chunk uses and moves chunks in
//! and out of the device as the step goes. Here the decision is made once, from a warm-up run
//! with every parameter shard in host memory: the device's peak over the warm-up is then
//! everything except the device-resident shards (activations, gradients, the gathered
//! parameters, buffers, on-device optimizer state), so `0.9 × capacity − peak` is the room the
//! shards may take. The chunks that fit in that room move to the device for the rest of
//! training. What a rank reads is its own device's memory, so ranks sharing nothing decide
//! alike when their devices' usage is alike; shards on the host or the device hold the same
//! values, so a different choice on two ranks changes no result, only speed.
//!
//! The device is read at every parameter gather and at the end of each pass, and between them
//! by a sampler thread every millisecond (the peak of a pass falls between two gathers, where
//! a layer's gradient and activations are alive together); the sampler stops with the
//! warm-up. A peak shorter than a millisecond may still escape the readings: the 10% margin is
//! for that.
//!
//! The readings are cubecl's bytes in use (live allocations), as Gemini counts allocated
//! memory rather than the allocator's cache: the pages cubecl keeps reserved are reused for
//! later allocations, and they stay reserved after a model is dropped, so a reading of them
//! would carry one model's peak into the next.

use std::time::Duration;

use burn::tensor::backend::Backend;
use burn_zero_kernels::DeviceMemorySampler;

use crate::config::ZeroConfig;
use crate::error::ZeroError;
use crate::memory::AutoPlacementReport;

/// How often the warm-up's sampler reads the device's memory.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_millis(1);

/// Passes of the warm-up: the optimizer makes its masters and state at the end of the first,
/// so the second is the first to run with the memory of every later one.
pub(crate) const WARMUP_PASSES: usize = 2;

/// The share of the capacity the placement plans for (the rest absorbs what the readings
/// missed between two of them, as Gemini keeps a margin below the device's size).
const PLANNED_SHARE: f64 = 0.9;

/// One rank's auto placement: its readings during the warm-up, then its decision.
#[derive(Debug)]
pub(crate) struct AutoPlacement {
    capacity: u64,
    passes: usize,
    peak: u64,
    /// Reads the device's memory between the readings at gathers, during the warm-up.
    sampler: Option<DeviceMemorySampler>,
    decided: Option<AutoPlacementReport>,
}

/// A warm-up reading above the capacity: the model does not fit even with every shard on the
/// host.
#[derive(Debug, thiserror::Error)]
#[error(
    "the device had {needed} bytes in use ({:.1} MiB) during the placement's warm-up, with every \
     parameter shard in host memory, but its capacity is {capacity} bytes ({:.1} MiB) \
     (auto_placement_capacity_mib): the model does not fit; a smaller micro-batch, activation \
     checkpointing, more ranks, or the optimizer on the host (ZeroOptimizer::offloaded) need \
     less",
    *needed as f64 / MIB,
    *capacity as f64 / MIB
)]
pub struct CapacityExceeded {
    pub needed: u64,
    pub capacity: u64,
}

const MIB: f64 = 1048576.0;

/// `config` with the auto placement's capacity in `auto_placement_capacity_mib`, read from
/// `device` when `auto_placement_device_capacity` asks for it; refuses a backend whose memory
/// cubecl does not report (the placement's readings) or, for a read capacity, whose driver
/// reports no size.
pub(crate) fn with_capacity<B: Backend>(
    config: &ZeroConfig,
    device: &B::Device,
) -> Result<ZeroConfig, ZeroError> {
    let option = if config.auto_placement_device_capacity {
        "auto_placement_device_capacity"
    } else if config.auto_placement_capacity_mib.is_some() {
        "auto_placement_capacity_mib"
    } else {
        return Ok(config.clone());
    };
    let backend = std::any::type_name::<B>();
    let Some(held) = burn_zero_kernels::device_memory::<B>(device) else {
        return Err(ZeroError::InvalidConfig(format!(
            "{option} needs a backend whose device memory cubecl reports (wgpu or CUDA, with \
             burn-zero's `wgpu` or `cuda` feature); {backend} reports none: use \
             offload_param_frac"
        )));
    };
    if !config.auto_placement_device_capacity {
        return Ok(config.clone());
    }
    let Some(capacity) = burn_zero_comm::device_capacity::<B>(device) else {
        return Err(ZeroError::InvalidConfig(format!(
            "auto_placement_device_capacity reads the capacity from the CUDA driver, and \
             {backend} is not a CUDA backend: give the capacity with \
             auto_placement_capacity_mib"
        )));
    };
    let capacity = capacity?;
    // What this process may still have: the free memory, and the pools cubecl reserved
    // already (free to the placement, taken to the driver).
    let bytes = capacity
        .free
        .saturating_add(held.reserved)
        .min(capacity.total);
    tracing::info!(
        total = capacity.total,
        free = capacity.free,
        reserved = held.reserved,
        planned_for = bytes,
        "auto placement: device capacity read from the driver"
    );
    let mut config = config.clone();
    config.auto_placement_device_capacity = false;
    config.auto_placement_capacity_mib = Some(bytes as f64 / MIB);
    Ok(config)
}

impl AutoPlacement {
    pub(crate) fn new(capacity_mib: f64) -> Self {
        Self {
            capacity: (capacity_mib * MIB) as u64,
            passes: 0,
            peak: 0,
            sampler: None,
            decided: None,
        }
    }

    /// Starts the warm-up's sampler with `start` unless it runs already.
    pub(crate) fn keep_sampling(&mut self, start: impl FnOnce() -> Option<DeviceMemorySampler>) {
        if self.sampler.is_none() {
            self.sampler = start();
        }
    }

    /// The most bytes in use the sampler has seen so far.
    pub(crate) fn sampled(&self) -> Option<u64> {
        Some(self.sampler.as_ref()?.peak().in_use)
    }

    /// Whether the warm-up still reads the device's memory.
    pub(crate) fn warming_up(&self) -> bool {
        self.decided.is_none()
    }

    /// Takes a reading of the device's bytes in use.
    pub(crate) fn observe(&mut self, in_use: u64) -> Result<(), CapacityExceeded> {
        self.peak = self.peak.max(in_use);
        if in_use > self.capacity {
            return Err(CapacityExceeded {
                needed: in_use,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Counts a finished pass.
    pub(crate) fn end_pass(&mut self) {
        self.passes += 1;
    }

    /// The bytes the shards may take on the device, once the warm-up is over and nothing was
    /// decided yet.
    pub(crate) fn room(&self) -> Option<u64> {
        (self.decided.is_none() && self.passes >= WARMUP_PASSES).then(|| {
            let planned = (PLANNED_SHARE * self.capacity as f64) as u64;
            planned.saturating_sub(self.peak)
        })
    }

    /// Records the decision: `device` chunks (`device_bytes` of shards) moved, `host` stayed,
    /// in `room` bytes.
    pub(crate) fn decide(
        &mut self,
        room: u64,
        (device, device_bytes): (usize, u64),
        host: usize,
    ) -> AutoPlacementReport {
        let report = AutoPlacementReport {
            capacity_bytes: self.capacity,
            warmup_peak_bytes: self.peak,
            room_bytes: room,
            device_chunks: device,
            host_chunks: host,
            device_shard_bytes: device_bytes,
        };
        self.decided = Some(report);
        self.sampler = None;
        report
    }

    /// The decision, once made.
    pub(crate) fn report(&self) -> Option<AutoPlacementReport> {
        self.decided
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_room_is_nine_tenths_of_the_capacity_less_the_warmup_peak_after_two_passes() {
        let mut auto = AutoPlacement::new(100.0);
        let capacity = 100 * 1048576;
        auto.observe(30 * 1048576).unwrap();
        assert_eq!(auto.room(), None);
        auto.end_pass();
        auto.observe(50 * 1048576).unwrap();
        assert_eq!(auto.room(), None, "one pass is not the warm-up");
        auto.end_pass();
        assert_eq!(auto.room(), Some(capacity * 9 / 10 - 50 * 1048576));
        auto.decide(1, (2, 0), 3);
        assert_eq!(auto.room(), None, "decided once");
        assert!(!auto.warming_up());
    }

    #[test]
    fn a_reading_above_the_capacity_names_both() {
        let mut auto = AutoPlacement::new(1.0);
        let error = auto.observe(2 * 1048576).unwrap_err().to_string();
        assert!(
            error.contains("2097152 bytes in use (2.0 MiB)")
                && error.contains("1048576 bytes (1.0 MiB)"),
            "{error}"
        );
    }
}
