//! Moving chunks' optimizer state from the host side of a split to the device side, between
//! two steps.
//!
//! A chunk's state is its fp32 master (the flat master of a chunk, or each member's when the
//! layout has one parameter per chunk or a restored record has not been joined yet) and the
//! optimizer's state for it. The values cross as tensor data; the state crosses through its
//! Burn record (`state_tree`), which works for any optimizer whatever it keeps private. From
//! the next backward on, the chunk's gradient shards stay on the device and the device side
//! steps it.

use std::collections::HashSet;
use std::sync::Arc;

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_zero_comm::RankCounters;
use burn_zero_core::chunk::placement::member_keys;

use super::record::cross_state;
use super::{SplitError, SplitZeroOptimizer};
use crate::master::Master;
use crate::optimizer::Owned;

impl<O, B: Backend, H: Backend> SplitZeroOptimizer<O, B, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// Moves the optimizer state of the host chunks `ids` to the device, where they step from
    /// the next step on (their gradients stay on the device from the next backward). Only
    /// between steps: inside an accumulation window the sums would have to move too.
    pub fn place_on_device(&mut self, ids: &[usize]) -> Result<(), SplitError> {
        if self.device.micro_steps != 0 {
            return Err(SplitError::InsideAccumulation(self.device.micro_steps));
        }
        if let Some(&id) = ids.iter().find(|id| !self.host_chunks.contains(id)) {
            return Err(SplitError::NotOnHost(id));
        }
        let zero = self.device.zero_state().expect("made bound").clone();
        let store = zero.store();
        let device = zero.device().clone();
        let counters = store.counters();
        for &id in ids {
            if let Some(master) = self.host.flat.remove(&id) {
                let master = to_device::<O, B, H>(master, &device, counters);
                self.device.flat.insert(id, master);
            }
        }
        let keys = member_keys(store.chunks(), ids);
        for &key in &keys {
            if let Some(master) = self.host.masters.remove(&key) {
                let master = to_device::<O, B, H>(master, &device, counters);
                self.device.masters.insert(key, master);
            }
        }
        let on_host: HashSet<usize> = match &self.host.owned {
            Owned::Only(owned) => owned.difference(&keys).copied().collect(),
            Owned::All | Owned::Except(_) => unreachable!("a split's host side owns given keys"),
        };
        let on_host = Arc::new(on_host);
        self.host.owned = Owned::Only(on_host.clone());
        self.device.owned = Owned::Except(on_host);
        store.keep_gradients_on_device_of(keys.iter().copied());
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

/// A host master on the model's `device`: its values as data (one host write, counted), its
/// state through its record.
fn to_device<O, B: Backend, H: Backend>(
    master: Master<O, H>,
    device: &B::Device,
    counters: &RankCounters,
) -> Master<O, B>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    counters.host_write();
    let values = Tensor::<B, 1>::from_data(master.values.into_data(), (device, DType::F32));
    let state = cross_state::<O, H, B>(master.state, device);
    Master { values, state }
}
