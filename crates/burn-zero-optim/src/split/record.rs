//! A split optimizer's record: its whole state as one record on the host backend, the record
//! `ZeroOptimizer::offloaded` keeps.
//!
//! Which side steps a chunk is a decision of the run (the fraction, the chunks the margin or
//! `place_on_device` moved), not of the state: a parameter's master and optimizer state are the
//! same values on either side. So the record holds every parameter's entry on the host backend,
//! and loading it gives each entry to the side that steps that parameter now. A record saved
//! by a split of one fraction loads into a split of another, into one whose chunks moved since,
//! or into an offloaded `ZeroOptimizer`, and the other way round; and it saves as a sharded
//! checkpoint like any `ZeroOptimizerRecord`, which also resumes it at another world size.
//!
//! Device entries cross as chunks moving between steps do (`migrate`): values as data (one
//! read back or upload each, counted), optimizer state through its Burn record.

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;

use super::SplitZeroOptimizer;
use super::migrate::{cross_state, master_to_device};
use crate::placement::{Offload, OnDevice, Placement};
use crate::record::ZeroOptimizerRecord;

impl<O, B: Backend, H: Backend> SplitZeroOptimizer<O, B, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// This rank's whole state as one record on the host backend (see the module docs): the
    /// host side's entries as they are, the device side's read back.
    pub fn record(&self) -> ZeroOptimizerRecord<O, B, Offload<H>> {
        let zero = self.device.zero_state().expect("made bound");
        let counters = zero.store().counters();
        let host_device = <Offload<H> as Placement<B>>::host_device(zero.device());
        let on_device = self.device.record();
        let mut record = self.host.record();
        record
            .masters
            .extend(on_device.masters.into_iter().map(|(key, values, state)| {
                let values = <Offload<H> as Placement<B>>::to_host(values, counters);
                (key, values, cross_state::<O, B, H>(state, &host_device))
            }));
        record.masters.sort_by_key(|(key, _, _)| *key);
        record.accumulated.extend(
            on_device
                .accumulated
                .into_iter()
                .map(|(key, sum)| (key, <Offload<H> as Placement<B>>::to_host(sum, counters))),
        );
        record.accumulated.sort_by_key(|(key, _)| *key);
        // The device side holds the step's loss scaler and skipped steps; both sides count the
        // same micro-steps.
        record.placement = on_device.placement.or(record.placement);
        record.scaler = on_device.scaler;
        record.skipped = on_device.skipped;
        record
    }

    /// Replaces this rank's state with `record` (a split's, of any fraction, or an offloaded
    /// optimizer's): each parameter's entry goes to the side that steps it now.
    pub fn restore(mut self, record: ZeroOptimizerRecord<O, B, Offload<H>>) -> Self {
        let zero = self.device.zero_state().expect("made bound").clone();
        let counters = zero.store().counters();
        let device = zero.device();
        let on_host = |key: usize| self.host.owned.steps(key);
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
                    <Offload<H> as Placement<B>>::to_model(sum, device, counters),
                )
            })
            .collect();
        let mut on_device = ZeroOptimizerRecord::<O, B, OnDevice>::new(
            record.placement,
            device_masters,
            device_sums,
            record.micro_steps,
            record.scaler,
            record.skipped,
        );
        let mut on_host = ZeroOptimizerRecord::<O, B, Offload<H>>::new(
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
