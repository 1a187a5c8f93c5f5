//! `BufferPool`: host buffers handed out again once every tensor that used them is gone.

use std::sync::{Arc, Mutex, MutexGuard};

use super::{HostBackend, HostFloat, HostTensor};

/// How many buffers a pool remembers, idle or still in use.
const MAX_ENTRIES: usize = 64;

/// Buffers written once per step (a packed bucket, a collective's result) reused from one
/// step to the next.
///
/// A fresh large allocation is mapped lazily by the OS, so its first write costs a page fault
/// per 4 KiB page: for a 64 MiB bucket, 16 K faults every step, more time than the copy
/// itself. The pool keeps a handle on each buffer it hands out and gives the buffer out again
/// once that handle is the only one left (the tensors made from it were dropped), so no
/// buffer is ever written while a tensor can still read it.
///
/// Buffers are matched by backend, dtype and length. Idle buffers (held by nobody else) beyond
/// `max_idle_bytes` are released, least recently used first, and at most 64 buffers are
/// remembered. Used only on host backends ([`HostBackend`]); elsewhere it stays empty.
/// Cloning gives an empty pool with the same limit.
#[derive(Debug)]
pub struct BufferPool {
    max_idle_bytes: usize,
    /// Shared with the packers working from this pool, which give their bucket back to it.
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    entries: Vec<Entry>,
    /// Increases with every `keep`: the entries' recency.
    clock: u64,
}

#[derive(Debug)]
struct Entry {
    tensor: HostTensor,
    used: u64,
}

impl BufferPool {
    /// The idle limit of [`BufferPool::default`]: 256 MiB.
    pub const DEFAULT_MAX_IDLE_BYTES: usize = 256 << 20;

    /// A pool that keeps at most `max_idle_bytes` of buffers nobody uses.
    pub fn new(max_idle_bytes: usize) -> Self {
        Self {
            max_idle_bytes,
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    /// Another handle on this same pool (unlike `clone`, which makes a new one).
    pub(crate) fn share(&self) -> Self {
        Self {
            max_idle_bytes: self.max_idle_bytes,
            state: self.state.clone(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The pool's state stays consistent through a panic (entries are only pushed or
        // removed), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// A contiguous 1-D tensor of `numel` `E`s that no other tensor shares: the most recently
    /// kept idle buffer of the same backend, dtype and length if the pool has one (its old
    /// contents left in place), or a new zeroed one. Give it back with [`BufferPool::keep`] once written.
    pub fn take<E: HostFloat>(&self, backend: HostBackend, numel: usize) -> HostTensor {
        let mut state = self.lock();
        // The most recently kept match: the likeliest to be still in cache.
        let found = state
            .entries
            .iter()
            .enumerate()
            .filter(|(_, entry)| {
                entry.tensor.backend() == backend
                    && entry.tensor.dtype() == E::DTYPE
                    && entry.tensor.numel() == numel
                    && entry.tensor.is_unique()
            })
            .max_by_key(|(_, entry)| entry.used)
            .map(|(index, _)| index);
        let taken = found.map(|index| state.entries.swap_remove(index).tensor);
        // Buffers turn idle when their last tensor is dropped, between calls.
        self.trim(&mut state);
        drop(state);
        taken.unwrap_or_else(|| HostTensor::zeros::<E>(backend, numel))
    }

    /// Remembers `tensor`'s buffer so that a later [`BufferPool::take`] can hand it out again
    /// once every other handle on it is gone.
    pub fn keep(&self, tensor: &HostTensor) {
        let mut state = self.lock();
        state.clock += 1;
        let used = state.clock;
        state.entries.push(Entry {
            tensor: tensor.clone(),
            used,
        });
        self.trim(&mut state);
    }

    /// Forgets the least recently used entries beyond the count limit, then idle ones beyond
    /// the byte limit.
    fn trim(&self, state: &mut State) {
        while state.entries.len() > MAX_ENTRIES {
            let oldest = oldest(&state.entries, |_| true);
            if let Some(index) = oldest {
                state.entries.swap_remove(index);
            }
        }
        loop {
            let idle: usize = state
                .entries
                .iter()
                .filter(|entry| entry.tensor.is_unique())
                .map(|entry| entry.tensor.bytes())
                .sum();
            if idle <= self.max_idle_bytes {
                break;
            }
            match oldest(&state.entries, |entry| entry.tensor.is_unique()) {
                Some(index) => {
                    state.entries.swap_remove(index);
                }
                None => break,
            }
        }
    }

    /// Bytes of the buffers the pool alone holds.
    pub fn idle_bytes(&self) -> usize {
        self.lock()
            .entries
            .iter()
            .filter(|entry| entry.tensor.is_unique())
            .map(|entry| entry.tensor.bytes())
            .sum()
    }
}

/// The index of the least recently used entry among those `eligible`.
fn oldest(entries: &[Entry], eligible: impl Fn(&Entry) -> bool) -> Option<usize> {
    entries
        .iter()
        .enumerate()
        .filter(|(_, entry)| eligible(entry))
        .min_by_key(|(_, entry)| entry.used)
        .map(|(index, _)| index)
}

impl Default for BufferPool {
    /// A pool keeping at most [`BufferPool::DEFAULT_MAX_IDLE_BYTES`] idle.
    fn default() -> Self {
        Self::new(Self::DEFAULT_MAX_IDLE_BYTES)
    }
}

impl Clone for BufferPool {
    /// An empty pool with the same limit: buffers are never shared between two pools.
    fn clone(&self) -> Self {
        Self::new(self.max_idle_bytes)
    }
}
