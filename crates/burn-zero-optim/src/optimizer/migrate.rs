//! Moving chunks' optimizer state from the host side to the device side, between two steps.
//!
//! A chunk's state is its fp32 master (the flat master of a chunk, or each member's when the
//! layout has one parameter per chunk or a restored record has not been joined yet) and the
//! optimizer's state for it. The values cross as tensor data; the state crosses through its
//! Burn record (`state_tree`), which works for any optimizer whatever it keeps private. From
//! the next backward on, the chunk's gradient shards stay on the device and the device side
//! steps it. The record crosses the device side's entries the same way.

use burn::optim::SimpleOptimizer;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_comm::RankCounters;
use burn_zero_core::StepSite;
use burn_zero_core::chunk::placement::member_keys;

use super::ZeroOptimizer;
use crate::error::OptimizerError;
use crate::master::Master;
use crate::place::{Offload, Place};
use crate::state_tree::{from_tree, to_tree};

impl<B: Backend, O, H: Backend> ZeroOptimizer<B, O, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// Moves the optimizer state of the host chunks `ids` to the device, where they step from
    /// the next step on (their gradients stay on the device from the next backward, and the
    /// auto placement's kept shards give up the room the state takes). Only between steps:
    /// inside an accumulation window the sums would have to move too.
    pub fn place_on_device(&mut self, ids: &[usize]) -> Result<(), OptimizerError> {
        if self.device.micro_steps() != 0 {
            return Err(OptimizerError::InsideAccumulation(
                self.device.micro_steps(),
            ));
        }
        if let Some(&id) = ids.iter().find(|id| !self.host_chunks.contains(id)) {
            return Err(OptimizerError::NotOnHost(id));
        }
        let moved_state_bytes = ids
            .iter()
            .filter_map(|&id| self.chunk_state_bytes(id))
            .sum::<usize>() as u64;
        let zero = self.device.bound_state().clone();
        let store = zero.store();
        let device = zero.device().clone();
        let counters = store.counters();
        for &id in ids {
            if let Some(Master { values, state }) = self.host.masters_mut().take_chunk(id) {
                let (values, state) = master_to_device::<O, B, H>(values, state, &device, counters);
                self.device
                    .masters_mut()
                    .put_chunk(id, Master { values, state });
            }
        }
        let keys = member_keys(store.chunks(), ids);
        for &key in &keys {
            if let Some(Master { values, state }) = self.host.masters_mut().take_param(key) {
                let (values, state) = master_to_device::<O, B, H>(values, state, &device, counters);
                self.device
                    .masters_mut()
                    .put_param(key, Master { values, state });
            }
        }
        let on_host = self.host.give_up(&keys);
        self.device.step_all_but(on_host);
        store.step_on(Some(&keys), StepSite::Device { moved_state_bytes });
        self.host_chunks.retain(|id| !ids.contains(id));
        // The accounting moves the bytes from the host's kinds to the device's.
        self.device.report_memory();
        self.host.report_memory();
        Ok(())
    }

    /// Bytes a host chunk's state would take on the device (its masters and optimizer state
    /// as they are on the host), or `None` before its first step made them.
    pub(crate) fn chunk_state_bytes(&self, id: usize) -> Option<usize> {
        if let Some(bytes) = self.host.flat_bytes(id) {
            return Some(bytes);
        }
        let zero = self.device.zero_state()?;
        let keys = member_keys(zero.store().chunks(), &[id]);
        keys.iter()
            .map(|&key| self.host.master_entry_bytes(key))
            .sum()
    }
}

/// A host master's `values` and `state` on the model's `device`: the values as data (one host
/// write, counted), the state through its record.
pub(super) fn master_to_device<O, B: Backend, H: Backend>(
    values: Tensor<H, 1>,
    state: Option<<O as SimpleOptimizer<H>>::State<1>>,
    device: &B::Device,
    counters: &RankCounters,
) -> (Tensor<B, 1>, Option<<O as SimpleOptimizer<B>>::State<1>>)
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    let values = <Offload<H> as Place<B>>::to_model(values, device, counters);
    (values, cross_state::<O, H, B>(state, device))
}

/// An optimizer state of backend `F` on backend `T`'s `device`, through its Burn record: any
/// optimizer's state crosses this way, whatever it keeps private.
pub(super) fn cross_state<O, F: Backend, T: Backend>(
    state: Option<<O as SimpleOptimizer<F>>::State<1>>,
    device: &T::Device,
) -> Option<<O as SimpleOptimizer<T>>::State<1>>
where
    O: SimpleOptimizer<F> + SimpleOptimizer<T>,
{
    state.map(|state| {
        to_tree::<F, <O as SimpleOptimizer<F>>::State<1>>(state)
            .and_then(|tree| from_tree::<T, <O as SimpleOptimizer<T>>::State<1>>(tree, device))
            .unwrap_or_else(|reason| {
                panic!(
                    "burn-zero: an optimizer state could not cross between device and host: \
                     {reason}"
                )
            })
    })
}
