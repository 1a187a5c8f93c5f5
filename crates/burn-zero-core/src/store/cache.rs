//! The bounded cache of gathered parameters: a parameter used several times in one pass is
//! gathered once while it fits under `max_live_gathered_bytes`.

use std::collections::VecDeque;

/// Least-recently-used cache of gathered tensors keyed by shard version.
///
/// Every rank sees the same sequence of lookups (the passes are identical), so every rank makes
/// the same hit/miss decisions and issues the same collectives.
#[derive(Debug)]
pub(crate) struct GatherCache<T> {
    entries: VecDeque<(u64, T, usize)>,
    bytes: usize,
    limit: usize,
}

impl<T: Clone> GatherCache<T> {
    pub fn new(limit: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            bytes: 0,
            limit,
        }
    }

    /// The cached tensor for `version`, marked most recently used.
    pub fn get(&mut self, version: u64) -> Option<T> {
        let pos = self.entries.iter().position(|(v, _, _)| *v == version)?;
        let entry = self.entries.remove(pos)?;
        let tensor = entry.1.clone();
        self.entries.push_back(entry);
        Some(tensor)
    }

    /// Caches `tensor` of `bytes`, evicting the least recently used entries to make room.
    /// Returns the bytes evicted. A tensor larger than the whole budget is not cached.
    pub fn insert(&mut self, version: u64, tensor: T, bytes: usize) -> usize {
        if bytes > self.limit {
            return 0;
        }
        let mut evicted = 0;
        while self.bytes + bytes > self.limit {
            match self.entries.pop_front() {
                Some((_, _, b)) => {
                    self.bytes -= b;
                    evicted += b;
                }
                None => break,
            }
        }
        self.entries.push_back((version, tensor, bytes));
        self.bytes += bytes;
        evicted
    }

    /// Whether `version` is cached (without marking it used).
    pub fn contains(&self, version: u64) -> bool {
        self.entries.iter().any(|(v, _, _)| *v == version)
    }

    /// Evicts least recently used entries until at most `bytes` are held; returns the bytes
    /// evicted.
    pub fn shrink_to(&mut self, bytes: usize) -> usize {
        let mut evicted = 0;
        while self.bytes > bytes {
            match self.entries.pop_front() {
                Some((_, _, b)) => {
                    self.bytes -= b;
                    evicted += b;
                }
                None => break,
            }
        }
        evicted
    }

    /// Drops every entry; returns the bytes freed.
    pub fn clear(&mut self) -> usize {
        self.entries.clear();
        std::mem::take(&mut self.bytes)
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::GatherCache;

    #[test]
    fn evicts_least_recently_used_and_respects_the_bound() {
        let mut cache = GatherCache::new(10);
        assert_eq!(cache.insert(1, "a", 4), 0);
        assert_eq!(cache.insert(2, "b", 4), 0);
        assert_eq!(cache.get(1), Some("a"));
        // 3 needs room: 2 is the least recently used.
        assert_eq!(cache.insert(3, "c", 4), 4);
        assert_eq!(cache.get(2), None);
        assert_eq!(cache.get(1), Some("a"));
        assert!(cache.bytes() <= 10);
        // Too large for the budget: not cached, nothing evicted.
        assert_eq!(cache.insert(4, "d", 11), 0);
        assert_eq!(cache.get(4), None);
        assert_eq!(cache.clear(), 8);
        assert_eq!(cache.bytes(), 0);
    }
}
