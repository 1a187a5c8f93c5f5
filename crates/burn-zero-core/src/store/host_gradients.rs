//! Where the optimizer steps each parameter ([`StepSite`], what it tells the store), and so
//! which reduced gradient shards go to host memory as their reduction delivers them: all of
//! them (`offload_optim_frac` 1) or the parameters of the chunks stepped on the host (the
//! other chunks step on the device and keep their gradients there).
//!
//! Shared between the store and the communication thread that reduces during backward: the
//! thread holds this, not the store, which it must not keep alive.

use std::collections::HashSet;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};

use burn_zero_comm::sync::{read, write};

/// Where an optimizer steps some parameters of a sharded module: the one thing the store needs
/// to know of the optimizer's placement ([`crate::ParamStore::step_on`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepSite {
    /// In host memory: their reduced gradient shards are read back there as their reduction
    /// delivers them (during backward, on the thread that reduces), so the device frees
    /// gradients as it goes instead of holding them until the step.
    Host,
    /// On the device, where their gradients stay. `moved_state_bytes` of optimizer state (masters
    /// and moments) came onto the device for them, for good: the auto placement's kept
    /// parameter shards plan for that much less room in every period (0 when nothing moved).
    Device { moved_state_bytes: u64 },
}

/// The parameters whose reduced gradient shards go to host memory.
#[derive(Debug, Default)]
pub struct HostGradients {
    all: AtomicBool,
    keys: RwLock<HashSet<usize>>,
}

impl HostGradients {
    /// Every parameter's.
    pub fn keep_all(&self) {
        self.all.store(true, Ordering::Relaxed);
    }

    /// Those of the parameters `keys`, besides any asked for before.
    pub fn keep(&self, keys: impl IntoIterator<Item = usize>) {
        write(&self.keys).extend(keys);
    }

    /// No longer those of the parameters `keys` (they step on the device from now on).
    pub fn forget(&self, keys: impl IntoIterator<Item = usize>) {
        let mut set = write(&self.keys);
        for key in keys {
            set.remove(&key);
        }
    }

    /// No parameter's any more.
    pub fn forget_all(&self) {
        self.all.store(false, Ordering::Relaxed);
        write(&self.keys).clear();
    }

    /// Whether parameter `key`'s goes to host memory.
    pub fn of(&self, key: usize) -> bool {
        self.all.load(Ordering::Relaxed) || read(&self.keys).contains(&key)
    }

    /// Whether a bucket of the parameters `keys` goes to host memory: only when every
    /// member's does, since the bucket is read back in one transfer.
    pub fn of_all(&self, mut keys: impl Iterator<Item = usize>) -> bool {
        if self.all.load(Ordering::Relaxed) {
            return true;
        }
        let set = read(&self.keys);
        !set.is_empty() && keys.all(|key| set.contains(&key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_goes_to_the_host_only_when_every_member_does() {
        let home = HostGradients::default();
        assert!(!home.of(1) && !home.of_all([1, 2].into_iter()));
        home.keep([1, 2, 5]);
        assert!(home.of(1) && !home.of(3));
        assert!(home.of_all([1, 2].into_iter()));
        assert!(!home.of_all([2, 3].into_iter()));
        home.forget([2]);
        assert!(home.of(1) && !home.of(2) && !home.of_all([1, 2].into_iter()));
        home.keep_all();
        assert!(home.of(3) && home.of_all([3, 4].into_iter()));
    }
}
