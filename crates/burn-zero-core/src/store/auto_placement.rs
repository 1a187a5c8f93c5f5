//! The auto placement's warm-up and decision (`Placement::auto`, after
//! ColossalAI Gemini's auto policy).
//!
//! Gemini records the non-model memory of each period between chunk uses and moves chunks in
//! and out of the device as the step goes. Here the warm-up runs with every parameter shard in
//! host memory, so what the device holds is everything except the shards (activations,
//! gradients, the gathered parameters, buffers, on-device optimizer state). Two decisions
//! follow from it:
//!
//! - for good: `0.9 × capacity − peak` over the whole warm-up is room every period has, and the
//!   chunks that fit in it move to the device for the rest of training;
//! - per period: the warm-up's last pass is recorded as periods, one starting at each
//!   parameter gather and one between passes, each with its own peak; the rest of the chunks
//!   stay in host memory, and their shards, uploaded for each gather, stay on the device
//!   between uses while the period's room allows (`residency`, which evicts the one used
//!   furthest ahead).
//!
//! What a rank reads is its own device's memory, so ranks sharing nothing decide alike when
//! their devices' usage is alike; shards on the host or the device hold the same values, so a
//! different choice on two ranks changes no result, only speed.
//!
//! The device is read at every parameter gather and at the end of each pass, at every
//! parameter's gradient as backward hands it over (the peak of a pass falls between two
//! gathers, where a layer's gradient and activations are alive together), and between them by
//! a sampler thread every millisecond; the sampler stops with the warm-up. On a GPU a period
//! lasts well under a millisecond (the host runs ahead of the device, and cubecl counts an
//! allocation when it is queued), so the readings at gathers and gradients are the ones that
//! see its peak; the sampler catches what lasts longer. A peak between two readings may still
//! escape: the 10% margin is for that.
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
use crate::placement::Capacity;

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
    /// The pass being recorded.
    pass: PassRecord,
    /// The last whole pass, each period's need the largest over the passes before it that
    /// gathered in the same order.
    recorded: Option<PassRecord>,
    /// The reading that opened the current period.
    opened_at: Option<u64>,
    decided: Option<AutoPlacementReport>,
}

/// One pass of the warm-up as periods: the chunk each gather began one with, and each closed
/// period's peak (the last, between passes, closes at the next pass's first gather).
#[derive(Debug, Default, Clone)]
pub(crate) struct PassRecord {
    pub(crate) order: Vec<usize>,
    pub(crate) needs: Vec<u64>,
    ended: bool,
}

/// A warm-up reading above the capacity: the model does not fit even with every shard on the
/// host.
#[derive(Debug, thiserror::Error)]
#[error(
    "the device had {needed} bytes in use ({:.1} MiB) during the placement's warm-up, with every \
     parameter shard in host memory, but its capacity is {capacity} bytes ({:.1} MiB) \
     (the auto placement's capacity): the model does not fit; a smaller micro-batch, activation \
     checkpointing, more ranks, or the optimizer on the host (offload_optim_frac) need \
     less",
    *needed as f64 / MIB,
    *capacity as f64 / MIB
)]
pub struct CapacityExceeded {
    pub needed: u64,
    pub capacity: u64,
}

const MIB: f64 = 1048576.0;

/// `config` with the auto placement's capacity in MiB (`Capacity::MiB`), read from `device`
/// when `Capacity::Device` asks for it; refuses a backend whose memory cubecl does not report
/// (the placement's readings) or, for a read capacity, whose driver reports no size.
pub(crate) fn with_capacity<B: Backend>(
    config: &ZeroConfig,
    device: &B::Device,
) -> Result<ZeroConfig, ZeroError> {
    let Some(capacity) = config.placement.auto else {
        return Ok(config.clone());
    };
    let backend = std::any::type_name::<B>();
    let Some(held) = burn_zero_kernels::device_memory::<B>(device) else {
        return Err(ZeroError::InvalidConfig(format!(
            "the auto placement needs a backend whose device memory cubecl reports (wgpu or \
             CUDA, with burn-zero's `wgpu` or `cuda` feature); {backend} reports none: place \
             parameter shards by fraction (`Placement::fractions`)"
        )));
    };
    if capacity != Capacity::Device {
        return Ok(config.clone());
    }
    let Some(capacity) = burn_zero_comm::device_capacity::<B>(device) else {
        return Err(ZeroError::InvalidConfig(format!(
            "the auto placement's `Capacity::Device` reads the capacity from the CUDA driver, \
             and {backend} is not a CUDA backend: give the capacity with `Capacity::MiB`"
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
    config.placement.auto = Some(Capacity::MiB(bytes as f64 / MIB));
    Ok(config)
}

impl AutoPlacement {
    pub(crate) fn new(capacity_mib: f64) -> Self {
        Self {
            capacity: (capacity_mib * MIB) as u64,
            passes: 0,
            peak: 0,
            sampler: None,
            pass: PassRecord::default(),
            recorded: None,
            opened_at: None,
            decided: None,
        }
    }

    /// Starts the warm-up's sampler with `start` unless it runs already.
    pub(crate) fn keep_sampling(&mut self, start: impl FnOnce() -> Option<DeviceMemorySampler>) {
        if self.sampler.is_none() {
            self.sampler = start();
        }
    }

    /// The most bytes in use the sampler has seen since the last call.
    pub(crate) fn sampled(&self) -> Option<u64> {
        Some(self.sampler.as_ref()?.take_peak().in_use)
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

    /// A reading inside the current period (at a gradient): it counts towards the period's
    /// peak as the readings at its boundaries do.
    pub(crate) fn within(&mut self, reading: u64) -> Result<(), CapacityExceeded> {
        self.observe(reading)?;
        if let Some(opened) = self.opened_at.as_mut() {
            *opened = (*opened).max(reading);
        }
        Ok(())
    }

    /// A period ends at `reading` bytes in use (its peak over the readings from its start),
    /// and the next begins: at a gather of chunk `gathered`, or (`None`) between passes.
    pub(crate) fn boundary(&mut self, reading: u64, gathered: Option<usize>) {
        if let Some(start) = self.opened_at.take() {
            self.pass.needs.push(start.max(reading));
        }
        match gathered {
            Some(chunk) => {
                if self.pass.ended {
                    let finished = std::mem::take(&mut self.pass);
                    self.keep(finished);
                }
                self.pass.order.push(chunk);
            }
            None => self.pass.ended = true,
        }
        self.opened_at = Some(reading);
    }

    /// Keeps `finished` as the recorded pass, with the larger need of each period where the
    /// pass before gathered in the same order.
    fn keep(&mut self, mut finished: PassRecord) {
        if finished.needs.len() != finished.order.len() + 1 {
            return;
        }
        if let Some(before) = self.recorded.as_ref().filter(|r| r.order == finished.order) {
            for (need, earlier) in finished.needs.iter_mut().zip(&before.needs) {
                *need = (*need).max(*earlier);
            }
        }
        self.recorded = Some(finished);
    }

    /// The last whole pass of the warm-up.
    pub(crate) fn recorded(&self) -> Option<&PassRecord> {
        self.recorded.as_ref()
    }

    /// The bytes the placement plans for: 0.9 of the capacity.
    pub(crate) fn planned(&self) -> u64 {
        (PLANNED_SHARE * self.capacity as f64) as u64
    }

    /// Counts a finished pass.
    pub(crate) fn end_pass(&mut self) {
        self.passes += 1;
    }

    /// The bytes the shards may take on the device, once the warm-up is over and nothing was
    /// decided yet.
    pub(crate) fn room(&self) -> Option<u64> {
        (self.decided.is_none() && self.passes >= WARMUP_PASSES)
            .then(|| self.planned().saturating_sub(self.peak))
    }

    /// Records the decision: `device` chunks (`device_bytes` of shards) moved, `host` stayed,
    /// in `room` bytes, `step` bytes kept out of it for the optimizer step; a pass of
    /// `periods` periods, the roomiest leaving `most_room` bytes for host shards kept between
    /// uses.
    pub(crate) fn decide(
        &mut self,
        (room, step): (u64, u64),
        (device, device_bytes): (usize, u64),
        host: usize,
        (periods, most_room): (usize, u64),
    ) -> AutoPlacementReport {
        let report = AutoPlacementReport {
            capacity_bytes: self.capacity,
            warmup_peak_bytes: self.peak,
            step_bytes: step,
            room_bytes: room,
            device_chunks: device,
            host_chunks: host,
            device_shard_bytes: device_bytes,
            periods,
            most_period_room_bytes: most_room,
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
        auto.decide((1, 0), (2, 0), 3, (0, 0));
        assert_eq!(auto.room(), None, "decided once");
        assert!(!auto.warming_up());
    }

    #[test]
    fn a_pass_is_recorded_as_periods_with_the_larger_need_of_equal_passes() {
        let mut auto = AutoPlacement::new(100.0);
        // Pass one: gathers of chunks 0 and 1, readings 10, 30, then 20 at its end; its step
        // period closes at the next pass's first gather (reading 5).
        auto.boundary(10, Some(0));
        auto.boundary(30, Some(1));
        auto.boundary(20, None);
        auto.boundary(5, Some(0));
        let first = auto.recorded().unwrap().clone();
        assert_eq!((first.order, first.needs), (vec![0, 1], vec![30, 30, 20]));
        // Pass two, same order, one period needing more and one less.
        auto.boundary(40, Some(1));
        auto.boundary(8, None);
        auto.boundary(5, Some(0));
        let second = auto.recorded().unwrap();
        assert_eq!(second.needs, vec![40, 40, 20]);
        // A pass in another order replaces the record.
        auto.boundary(7, None);
        auto.boundary(6, Some(1));
        assert_eq!(auto.recorded().unwrap().order, vec![0]);
        assert_eq!(auto.recorded().unwrap().needs, vec![7, 7]);
    }

    #[test]
    fn a_reading_inside_a_period_raises_its_need_and_only_its_own() {
        let mut auto = AutoPlacement::new(1.0);
        auto.boundary(100, Some(0));
        auto.within(700).unwrap();
        auto.boundary(200, Some(1));
        auto.boundary(150, None);
        auto.within(300).unwrap();
        auto.boundary(120, Some(0));
        // The pass is kept once the next one starts; the between-passes period got 300.
        assert_eq!(auto.recorded().unwrap().needs, vec![700, 200, 300]);
        assert_eq!(auto.peak, 700);
        // Above the capacity, a reading inside a period is refused like any other.
        assert!(auto.within(2 << 20).is_err());
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
