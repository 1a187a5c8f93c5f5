//! The optimizer's record: its whole state as one record on the host backend.
//!
//! Which side steps a chunk is a decision of the run (the placement's fraction, the chunks the
//! margin or `place_on_device` moved), not of the state: a parameter's master and optimizer
//! state are the same values on either side. So the record holds every parameter's entry on
//! the host backend, and loading it gives each entry to the side that steps that parameter
//! now. A record saved under one placement loads under any other, or after chunks moved; and
//! it saves as a sharded checkpoint, which also resumes it at another world size.
//!
//! Device entries cross as chunks moving between steps do (`migrate`): values as data (one
//! read back or upload each, counted), optimizer state through its Burn record.

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;

use super::ZeroOptimizer;
use super::migrate::{cross_state, master_to_device};
use crate::place::{Offload, Place};
use crate::record::ZeroOptimizerRecord;

impl<B: Backend, O, H: Backend> ZeroOptimizer<B, O, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// This rank's whole state as one record on the host backend (see the module docs): the
    /// host side's entries as they are, the device side's read back.
    ///
    /// # Panics
    /// When the optimizer was made unbound and never bound.
    pub fn record(&self) -> ZeroOptimizerRecord<B, O, H> {
        let zero = self.device.bound_state();
        let counters = zero.store().counters();
        let host_device = <Offload<H> as Place<B>>::host_device(zero.device());
        let on_device = self.device.record();
        let mut record = self.host.record();
        record
            .masters
            .extend(on_device.masters.into_iter().map(|(key, values, state)| {
                let values = <Offload<H> as Place<B>>::to_host(values, counters);
                (key, values, cross_state::<O, B, H>(state, &host_device))
            }));
        record.masters.sort_by_key(|(key, _, _)| *key);
        record.accumulated.extend(
            on_device
                .accumulated
                .into_iter()
                .map(|(key, sum)| (key, <Offload<H> as Place<B>>::to_host(sum, counters))),
        );
        record.accumulated.sort_by_key(|(key, _)| *key);
        // The device side holds the step's loss scaler and skipped steps; both sides count the
        // same micro-steps.
        record.placement = on_device.placement.or(record.placement);
        record.scaler = on_device.scaler;
        record.skipped = on_device.skipped;
        record
    }

    /// Replaces this rank's state with `record` (saved under any placement): each parameter's
    /// entry goes to the side that steps it now. A record with a binding
    /// ([`ZeroOptimizerRecord::binding`]) binds an unbound optimizer first. The optimizer's
    /// own settings (clipping, accumulation, loss-scaler knobs) stay.
    ///
    /// # Panics
    /// When the optimizer is unbound and the record does not bind it.
    pub fn restore(mut self, record: ZeroOptimizerRecord<B, O, H>) -> Self {
        if let Some(binding) = &record.binding
            && self.device.zero_state().is_none()
        {
            self.bind(binding);
        }
        let zero = self.device.bound_state().clone();
        let counters = zero.store().counters();
        let device = zero.device();
        let on_host = |key: usize| self.host.steps(key);
        let (host_masters, device_masters): (Vec<_>, Vec<_>) = record
            .masters
            .into_iter()
            .partition(|(key, _, _)| on_host(*key));
        let (host_sums, device_sums): (Vec<_>, Vec<_>) = record
            .accumulated
            .into_iter()
            .partition(|(key, _)| on_host(*key));
        let device_masters = device_masters
            .into_iter()
            .map(|(key, values, state)| {
                let (values, state) = master_to_device::<O, B, H>(values, state, device, counters);
                (key, values, state)
            })
            .collect();
        let device_sums = device_sums
            .into_iter()
            .map(|(key, sum)| {
                (
                    key,
                    <Offload<H> as Place<B>>::to_model(sum, device, counters),
                )
            })
            .collect();
        let mut on_device = ZeroOptimizerRecord::<B, O, B>::new(
            record.placement,
            device_masters,
            device_sums,
            record.micro_steps,
            record.scaler,
            record.skipped,
        );
        let mut on_host = ZeroOptimizerRecord::<B, O, H>::new(
            record.placement,
            host_masters,
            host_sums,
            record.micro_steps,
            None,
            0,
        );
        if let Some(binding) = record.binding {
            on_device = on_device.bound_to(&binding);
            on_host = on_host.bound_to(&binding);
        }
        self.device = self.device.restore(on_device);
        self.host = self.host.restore(on_host);
        self
    }
}
