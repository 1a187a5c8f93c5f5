//! The auto placement during training: host parameter shards kept on the device between their
//! uses, period by period, evicting the one used furthest ahead (after ColossalAI Gemini's
//! auto policy, which evicts by Belady's rule).
//!
//! The warm-up recorded one pass as periods: one starting at each parameter gather, in
//! gather order, and one between the end of backward and the next pass's first gather (the
//! optimizer step). For each it measured the device's peak with every shard on the host: the
//! memory the period needs apart from the shards (activations, gradients, gathered
//! parameters, buffers). What the device may give the kept shards during a period is
//! `0.9 × capacity` less that need and less the shards the placement moved to the device for
//! good. A reading close to a boundary can fall on either side of it, so a period's need is
//! taken as the largest of its own and its two neighbours'.
//!
//! A chunk in host memory is uploaded for each of its gathers anyway. Keeping the uploaded
//! shard instead of freeing it saves the next upload, and costs nothing to undo: the host
//! copy stays authoritative, so eviction is dropping the device copy. At each gather the kept
//! shards are cut down to the new period's room, and a shard just uploaded is kept if it fits
//! there: the candidates are taken nearest next use first, each kept while it fits, so what
//! leaves is what is used furthest ahead. A pass that leaves the recorded order keeps nothing
//! until it comes back to the order's start. Which shards are kept never changes a value or
//! a collective, only where a copy of the values lives.

use std::collections::HashMap;

use crate::memory::KeptShardStats;

/// One kept shard: the member versions its values are of, the device copy, its bytes.
#[derive(Debug)]
struct Kept<T> {
    versions: Vec<u64>,
    shard: T,
    bytes: u64,
}

/// One rank's schedule of kept shards and the shards it keeps (`T`: a device tensor).
#[derive(Debug)]
pub(crate) struct Residency<T> {
    /// The chunk gathered at the start of each period of a pass.
    order: Vec<usize>,
    /// Each chunk's positions in `order`, ascending.
    uses: HashMap<usize, Vec<usize>>,
    /// Bytes the kept shards may take in each period: one per gather, then the one between
    /// passes.
    room: Vec<u64>,
    /// Bytes taken out of every period's room since (optimizer state moved to the device).
    taken: u64,
    /// The current period, `None` while off the recorded order.
    at: Option<usize>,
    kept: HashMap<usize, Kept<T>>,
    stats: KeptShardStats,
}

impl<T> Residency<T> {
    /// The schedule of a pass that gathered the chunks `order` and whose periods (one per
    /// gather, then the one between passes) needed `needs` bytes apart from the shards, for a
    /// device that may hold `planned` bytes of which `fixed` are shards placed for good.
    pub(crate) fn new(order: Vec<usize>, needs: &[u64], planned: u64, fixed: u64) -> Self {
        debug_assert_eq!(
            needs.len(),
            order.len() + 1,
            "a period per gather and one between"
        );
        let room = (0..needs.len())
            .map(|i| {
                let neighbours = needs[i.saturating_sub(1)..(i + 2).min(needs.len())].iter();
                let need = neighbours.copied().max().unwrap_or(0);
                planned.saturating_sub(fixed).saturating_sub(need)
            })
            .collect();
        let mut uses: HashMap<usize, Vec<usize>> = HashMap::new();
        for (position, &chunk) in order.iter().enumerate() {
            uses.entry(chunk).or_default().push(position);
        }
        Self {
            order,
            uses,
            room,
            taken: 0,
            at: None,
            kept: HashMap::new(),
            stats: KeptShardStats::default(),
        }
    }

    /// Periods of a pass.
    pub(crate) fn periods(&self) -> usize {
        self.room.len()
    }

    /// The most room any period leaves the kept shards.
    pub(crate) fn most_room(&self) -> u64 {
        self.room.iter().copied().max().unwrap_or(0)
    }

    /// What the kept shards did so far.
    pub(crate) fn stats(&self) -> KeptShardStats {
        self.stats
    }

    /// Bytes of the shards kept now.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.kept.values().map(|k| k.bytes).sum()
    }

    /// A gather of `chunk` starts the next period: the kept shards are cut down to its room.
    /// Returns the bytes freed.
    pub(crate) fn gathering(&mut self, chunk: usize) -> u64 {
        let expected = self.at.map_or(0, |at| at + 1);
        self.at = if self.order.get(expected) == Some(&chunk) {
            Some(expected)
        } else if self.order.first() == Some(&chunk) {
            Some(0)
        } else {
            self.stats.off_schedule += 1;
            None
        };
        self.fit(None, Some(chunk)).0
    }

    /// The pass ended: the period between passes starts. Returns the bytes freed.
    pub(crate) fn end_pass(&mut self) -> u64 {
        self.at = self.at.map(|_| self.order.len());
        self.fit(None, None).0
    }

    /// The kept shard of `chunk` when it holds the values of `versions` (its members' current
    /// shard versions), as `usable` takes it. One that `usable` refuses (a copy whose upload
    /// never ran) is dropped, not counted as a use or an eviction: the caller uploads again and
    /// offers that. Returns the shard taken and the bytes freed.
    pub(crate) fn get<U>(
        &mut self,
        chunk: usize,
        versions: &[u64],
        usable: impl FnOnce(&T) -> Option<U>,
    ) -> (Option<U>, u64) {
        let Some(kept) = self.kept.get(&chunk).filter(|k| k.versions == versions) else {
            return (None, 0);
        };
        match usable(&kept.shard) {
            Some(shard) => {
                self.stats.kept_uses += 1;
                (Some(shard), 0)
            }
            None => (None, self.kept.remove(&chunk).map_or(0, |kept| kept.bytes)),
        }
    }

    /// Offers `shard`, just uploaded for a gather of `chunk` (its members at `versions`), to
    /// be kept: it is when it fits the current period's room with the shards used before it.
    /// Returns whether it was kept and the bytes freed by evicting others.
    pub(crate) fn offer(
        &mut self,
        chunk: usize,
        versions: Vec<u64>,
        shard: T,
        bytes: u64,
    ) -> (bool, u64) {
        if self.at.is_none() || !self.uses.contains_key(&chunk) {
            return (false, 0);
        }
        let (freed, keeps_new) = self.fit(Some((chunk, bytes)), None);
        if keeps_new {
            let replaced = self.kept.insert(
                chunk,
                Kept {
                    versions,
                    shard,
                    bytes,
                },
            );
            debug_assert!(replaced.is_none(), "an offered chunk was not kept already");
            self.stats.kept += 1;
        }
        (keeps_new, freed)
    }

    /// New values of `chunk`'s members replaced the kept ones (an optimizer step): drops its
    /// kept shard. Returns the bytes freed.
    pub(crate) fn forget(&mut self, chunk: usize) -> u64 {
        self.kept.remove(&chunk).map_or(0, |kept| {
            self.stats.evicted += 1;
            kept.bytes
        })
    }

    /// `bytes` of the device's room went to something else for good (optimizer state moved to
    /// the device): every period has that much less for the kept shards.
    pub(crate) fn take(&mut self, bytes: u64) -> u64 {
        self.taken = self.taken.saturating_add(bytes);
        self.fit(None, None).0
    }

    /// Keeps, of the kept shards and the `offered` chunk of the given bytes, those nearest their
    /// next use while they fit the current period's room, and evicts the others; the chunk
    /// gathered `now` is the nearest of all. Returns the bytes evicted and whether the offered
    /// chunk is to be kept.
    fn fit(&mut self, offered: Option<(usize, u64)>, now: Option<usize>) -> (u64, bool) {
        let room = self
            .at
            .map_or(0, |at| self.room[at].saturating_sub(self.taken));
        let mut candidates: Vec<(usize, u64, usize)> = self
            .kept
            .iter()
            .map(|(&chunk, kept)| {
                let next = if now == Some(chunk) {
                    0
                } else {
                    self.next_use(chunk)
                };
                (next, kept.bytes, chunk)
            })
            .chain(offered.map(|(chunk, bytes)| (self.next_use(chunk), bytes, chunk)))
            .collect();
        candidates.sort_unstable();
        let mut used = 0;
        let mut freed = 0;
        let mut keeps_offered = false;
        for (_, bytes, chunk) in candidates {
            let fits = used + bytes <= room;
            if fits {
                used += bytes;
            }
            if offered.is_some_and(|(offered, _)| offered == chunk) {
                keeps_offered = fits;
            } else if !fits {
                freed += self.forget(chunk);
            }
        }
        (freed, keeps_offered)
    }

    /// How many periods ahead of the current one `chunk` is next gathered (wrapping into the
    /// next pass); `usize::MAX` for a chunk the order never gathers.
    fn next_use(&self, chunk: usize) -> usize {
        let Some(positions) = self.uses.get(&chunk) else {
            return usize::MAX;
        };
        let at = self.at.unwrap_or(0);
        let pass = self.room.len();
        positions
            .iter()
            .find(|&&p| p > at)
            .map_or(positions[0] + pass - at, |&p| p - at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forward and backward over three chunks (0 1 2, then 2 1 0), each shard 10 bytes, with
    /// the room per period given.
    fn schedule(room: &[u64]) -> Residency<&'static str> {
        let order = vec![0, 1, 2, 2, 1, 0];
        // A device of 100 bytes with nothing fixed: need = 100 − room. Each period's room is
        // the least of its neighbours', so give the needs such that it equals `room`.
        let needs: Vec<u64> = room.iter().map(|r| 100 - r).collect();
        let mut residency = Residency::new(order, &needs, 100, 0);
        residency.room = room.to_vec();
        residency
    }

    /// Every kept copy of these tests has its values.
    fn ready(shard: &&'static str) -> Option<&'static str> {
        Some(*shard)
    }

    /// Runs one pass, offering each chunk's shard when it is not kept; returns the uploads.
    fn pass(residency: &mut Residency<&'static str>, versions: u64) -> usize {
        let mut uploads = 0;
        for chunk in residency.order.clone() {
            residency.gathering(chunk);
            if residency.get(chunk, &[versions], ready).0.is_none() {
                uploads += 1;
                residency.offer(chunk, vec![versions], "shard", 10);
            }
            assert!(residency.bytes() <= residency.room[residency.at.unwrap()]);
        }
        residency.end_pass();
        uploads
    }

    #[test]
    fn no_room_keeps_nothing_and_every_gather_uploads() {
        let mut residency = schedule(&[0; 7]);
        assert_eq!(pass(&mut residency, 1), 6);
        assert_eq!(residency.stats().kept, 0);
    }

    #[test]
    fn room_for_one_keeps_the_chunk_used_next() {
        // Room for one shard everywhere: the last forward chunk (2) is kept for its backward
        // use right after; 1 is kept from its backward use over to... its next use is the next
        // pass's forward, but 0 (gathered last) comes first there: 0 is kept over the step.
        let mut residency = schedule(&[10; 7]);
        assert_eq!(
            pass(&mut residency, 1),
            5,
            "the backward of 2 uses the kept copy"
        );
        // The next pass, same values (no step between): 0 is kept over the boundary.
        assert_eq!(pass(&mut residency, 1), 4);
        assert_eq!(residency.stats().kept_uses, 3);
    }

    #[test]
    fn the_chunk_used_furthest_ahead_is_evicted_when_a_period_shrinks() {
        // Room for all three in the forward, for one in the backward's first period.
        let mut residency = schedule(&[30, 30, 30, 10, 30, 30, 30]);
        residency.gathering(0);
        residency.offer(0, vec![1], "0", 10);
        residency.gathering(1);
        residency.offer(1, vec![1], "1", 10);
        residency.gathering(2);
        residency.offer(2, vec![1], "2", 10);
        assert_eq!(residency.bytes(), 30);
        // Period 3 gathers 2 again: 1 (next use 4) and 0 (next use 5) are further ahead.
        assert_eq!(residency.gathering(2), 20);
        assert!(residency.get(2, &[1], ready).0.is_some());
        assert!(
            residency.get(1, &[1], ready).0.is_none() && residency.get(0, &[1], ready).0.is_none()
        );
    }

    #[test]
    fn a_shard_of_older_values_is_never_returned_and_forget_frees_it() {
        let mut residency = schedule(&[30; 7]);
        residency.gathering(0);
        residency.offer(0, vec![1], "old", 10);
        assert_eq!(residency.get(0, &[2], ready), (None, 0));
        assert_eq!(residency.forget(0), 10);
        assert_eq!(residency.bytes(), 0);
    }

    #[test]
    fn a_copy_whose_upload_never_ran_is_dropped_uncounted_and_offered_again() {
        let mut residency = schedule(&[30; 7]);
        residency.gathering(0);
        assert_eq!(residency.offer(0, vec![1], "never uploaded", 10), (true, 0));
        let before = residency.stats();
        assert_eq!(residency.get(0, &[1], |_| None::<&str>), (None, 10));
        assert_eq!(residency.bytes(), 0);
        assert_eq!(
            (residency.stats().kept_uses, residency.stats().evicted),
            (before.kept_uses, before.evicted)
        );
        assert_eq!(residency.offer(0, vec![1], "uploaded", 10), (true, 0));
        assert_eq!(residency.get(0, &[1], ready), (Some("uploaded"), 0));
    }

    #[test]
    fn a_gather_off_the_order_keeps_nothing_until_the_order_starts_again() {
        let mut residency = schedule(&[30; 7]);
        residency.gathering(0);
        residency.offer(0, vec![1], "0", 10);
        assert_eq!(
            residency.gathering(2),
            10,
            "2 is not the order's next gather"
        );
        assert_eq!(residency.offer(2, vec![1], "2", 10), (false, 0));
        assert_eq!(residency.stats().off_schedule, 1);
        residency.gathering(0);
        assert_eq!(residency.offer(0, vec![1], "0", 10), (true, 0));
    }

    #[test]
    fn room_taken_for_good_shrinks_every_period() {
        let mut residency = schedule(&[20; 7]);
        residency.gathering(0);
        residency.offer(0, vec![1], "0", 10);
        residency.gathering(1);
        residency.offer(1, vec![1], "1", 10);
        assert_eq!(residency.take(5), 10, "one of the two no longer fits");
        assert!(
            residency.get(1, &[1], ready).0.is_some(),
            "1 is used next (period 4)"
        );
    }

    #[test]
    fn a_period_plans_for_its_neighbours_needs() {
        let residency = Residency::<()>::new(vec![0, 1], &[10, 50, 20], 100, 5);
        assert_eq!(residency.room, vec![45, 45, 45]);
        let residency = Residency::<()>::new(vec![0, 1, 2, 3], &[10, 10, 10, 60, 10], 100, 0);
        assert_eq!(residency.room, vec![90, 90, 40, 40, 40]);
        assert_eq!(residency.most_room(), 90);
    }
}
