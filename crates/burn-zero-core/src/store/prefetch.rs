//! Gather prefetch: the order in which a pass gathers parameters, recorded in one pass and
//! replayed in the next to issue gathers ahead of use.
//!
//! The bookkeeping lives here; [`crate::store::ParamStore::gather`] drives it. Every rank
//! makes the same decisions: the recorded order, the cache's contents and the in-flight
//! gathers are functions of the program alone, and prefetches are issued (their positions in
//! the rank's order of collectives taken) on the training thread at the gather that triggers
//! them. A rank whose program asks for another parameter than the recorded next one drops its
//! prefetches and gathers on demand for the rest of the pass; if the ranks' programs differ,
//! their collectives differ too, and the engine's schedule check names them.

use std::collections::VecDeque;
use std::time::Duration;

use burn::tensor::backend::Backend;
use burn_zero_comm::Pending;

/// The most parameter requests one pass records. Forward passes without a backward (evaluation,
/// generation) never end a pass: past this many requests the pass stops recording, is not
/// recorded, and the order recorded before it stays.
const MAX_RECORDED: usize = 1 << 16;

/// A gather running ahead of use: of one parameter, or of a chunk of several.
pub(crate) struct InFlight<B: Backend> {
    /// The parameters it gathers, with the shard version each was gathered at, in the order
    /// their blocks lie in the gathered tensor.
    pub members: Vec<(usize, u64)>,
    /// Bytes it gathers.
    pub bytes: usize,
    pub pending: Pending<B>,
}

/// What prefetching did since the module was sharded.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct GatherStats {
    /// Parameter gathers asked for that missed the cache.
    pub gathers: u64,
    /// Of those, the ones a prefetch had already issued.
    pub prefetched: u64,
    /// Prefetches dropped unused (a pass left the recorded order, or ended first).
    pub discarded: u64,
    /// Passes that left the recorded order.
    pub diverged_passes: u64,
    /// Time the training thread spent waiting for gathered parameters: the gather time that
    /// compute did not hide.
    pub exposed: Duration,
}

/// One rank's prefetch state.
pub(crate) struct Prefetcher<B: Backend> {
    /// How many gathers may be in flight.
    depth: usize,
    /// The parameter order of the last complete pass that followed it (or was recorded).
    recorded: Option<Vec<usize>>,
    /// This pass's parameter requests so far.
    requests: Vec<usize>,
    /// This pass left the recorded order.
    diverged: bool,
    /// This pass made more than [`MAX_RECORDED`] requests.
    overflowed: bool,
    inflight: VecDeque<InFlight<B>>,
    inflight_bytes: usize,
    pub stats: GatherStats,
}

impl<B: Backend> Prefetcher<B> {
    pub fn new(depth: usize) -> Self {
        Self {
            depth,
            recorded: None,
            requests: Vec::new(),
            diverged: false,
            overflowed: false,
            inflight: VecDeque::new(),
            inflight_bytes: 0,
            stats: GatherStats::default(),
        }
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Notes a request for parameter `key`. Returns the bytes of the prefetches dropped when it
    /// leaves the recorded order (for the memory accounting).
    pub fn request(&mut self, key: usize) -> usize {
        let position = self.requests.len();
        if position == MAX_RECORDED {
            self.overflowed = true;
            return self.leave_order(key, position);
        }
        if self.overflowed {
            return 0;
        }
        self.requests.push(key);
        match &self.recorded {
            Some(recorded) if !self.diverged && recorded.get(position) != Some(&key) => {
                self.leave_order(key, position)
            }
            _ => 0,
        }
    }

    /// This pass leaves the recorded order at `position`: prefetch stops for the rest of it.
    /// Returns the bytes of the prefetches dropped.
    fn leave_order(&mut self, key: usize, position: usize) -> usize {
        if self.diverged {
            return 0;
        }
        self.diverged = true;
        self.stats.diverged_passes += 1;
        tracing::debug!(
            key,
            position,
            "a pass left the recorded gather order; prefetch stops for this pass"
        );
        self.discard()
    }

    /// The in-flight gather of `key` at `version` (of it alone or of its chunk), if one was
    /// issued.
    pub fn take(&mut self, key: usize, version: u64) -> Option<InFlight<B>> {
        let at = self
            .inflight
            .iter()
            .position(|f| f.members.contains(&(key, version)))?;
        let found = self.inflight.remove(at)?;
        self.inflight_bytes -= found.bytes;
        Some(found)
    }

    /// The parameters the recorded order asks for next, after this request, that are neither
    /// cached (`cached(key)`) nor in flight: at most enough to fill the depth.
    pub fn upcoming(&self, cached: impl Fn(usize) -> bool) -> Vec<usize> {
        let Some(recorded) = self
            .recorded
            .as_ref()
            .filter(|_| !self.diverged && !self.overflowed)
        else {
            return Vec::new();
        };
        let room = self.depth.saturating_sub(self.inflight.len());
        let mut next = Vec::new();
        for &key in recorded.iter().skip(self.requests.len()) {
            if next.len() == room {
                break;
            }
            if !cached(key) && !next.contains(&key) && !self.in_flight(key) {
                next.push(key);
            }
        }
        next
    }

    /// Whether a gather of `key` (alone or with its chunk) is in flight.
    pub fn in_flight(&self, key: usize) -> bool {
        self.inflight
            .iter()
            .any(|f| f.members.iter().any(|&(member, _)| member == key))
    }

    /// Bytes of gathers in flight.
    pub fn inflight_bytes(&self) -> usize {
        self.inflight_bytes
    }

    /// Records a gather issued ahead.
    pub fn issued(&mut self, inflight: InFlight<B>) {
        self.inflight_bytes += inflight.bytes;
        self.inflight.push_back(inflight);
    }

    /// Drops every in-flight gather; returns their bytes.
    fn discard(&mut self) -> usize {
        self.stats.discarded += self.inflight.len() as u64;
        self.inflight.clear();
        std::mem::take(&mut self.inflight_bytes)
    }

    /// Ends a pass (the end of backward): its order becomes the recorded one if there was
    /// none or it left the old one (unless it overflowed). Returns the bytes of prefetches
    /// dropped.
    pub fn end_pass(&mut self) -> usize {
        let requests = std::mem::take(&mut self.requests);
        let recordable = !self.overflowed && !requests.is_empty();
        if recordable && (self.recorded.is_none() || self.diverged) {
            self.recorded = Some(requests);
        }
        self.diverged = false;
        self.overflowed = false;
        self.discard()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    fn pass(prefetcher: &mut Prefetcher<Flex>, keys: impl IntoIterator<Item = usize>) {
        for key in keys {
            prefetcher.request(key);
        }
        prefetcher.end_pass();
    }

    #[test]
    fn the_first_pass_is_recorded_and_a_diverging_one_replaces_it() {
        let mut prefetcher = Prefetcher::<Flex>::new(2);
        assert!(
            prefetcher.upcoming(|_| false).is_empty(),
            "nothing recorded yet"
        );
        pass(&mut prefetcher, [0, 1, 2, 1, 0]);
        prefetcher.request(0);
        assert_eq!(prefetcher.upcoming(|_| false), [1, 2]);
        assert_eq!(prefetcher.upcoming(|key| key == 1), [2, 0]);
        // This pass leaves the order at its second request and is recorded in its place.
        prefetcher.request(2);
        assert!(prefetcher.upcoming(|_| false).is_empty());
        prefetcher.request(1);
        prefetcher.end_pass();
        assert_eq!(prefetcher.stats.diverged_passes, 1);
        prefetcher.request(0);
        assert_eq!(prefetcher.upcoming(|_| false), [2, 1]);
    }

    #[test]
    fn a_pass_without_end_stops_recording_and_keeps_the_old_order() {
        let mut prefetcher = Prefetcher::<Flex>::new(1);
        pass(&mut prefetcher, [0, 1]);
        // Forward passes without a backward: one long pass, never ended until now.
        for i in 0..MAX_RECORDED + 10 {
            prefetcher.request(i % 2);
        }
        assert_eq!(prefetcher.requests.len(), MAX_RECORDED);
        assert!(prefetcher.upcoming(|_| false).is_empty());
        prefetcher.end_pass();
        prefetcher.request(0);
        assert_eq!(prefetcher.upcoming(|_| false), [1], "the old order stays");
    }
}
