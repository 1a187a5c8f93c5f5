//! What the issuing thread keeps aside while a collective it issued runs on the device.
//!
//! # Why
//!
//! Some work reads a collective's result on the issuing thread itself: a gradient bucket's
//! unpack runs there because the reduced buffer belongs to that thread's stream (see
//! [`crate::ordered`]). Waiting for the device right after issuing costs the issuing thread a
//! round trip per bucket, and every later position of the rank queues behind it. Kept aside
//! instead, the rest of the work runs once the device says the collective is done, asked
//! between positions without waiting, so the thread issues the next positions meanwhile.
//!
//! The thread waits only where it has to: for the oldest kept collective when more than
//! [`Parked::MOST`] are in flight, when it has had nothing else to do for [`Parked::PATIENCE`]
//! (a collective that long is waited for, and a failed one reported, by the engine's own
//! wait), and when it stops.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A collective in flight and the work that follows it on the issuing thread.
pub(crate) trait Unfinished: Send {
    /// Asks, without waiting, whether [`Self::finish`] would run without waiting.
    fn is_done(&self) -> bool;

    /// Waits for the collective where it has not finished, runs the work that follows it and
    /// hands the result over.
    fn finish(self: Box<Self>);
}

/// The work one issuing thread has kept aside, oldest first.
#[derive(Default)]
pub(crate) struct Parked {
    waiting: VecDeque<(Box<dyn Unfinished>, Instant)>,
}

impl Parked {
    /// The most collectives kept in flight at once: a bucket being reduced and the one before
    /// it, as double-buffered buckets are.
    const MOST: usize = 2;
    /// How often an otherwise idle thread asks again.
    pub(crate) const POLL: Duration = Duration::from_micros(100);
    /// How long an otherwise idle thread asks before it waits: long enough that no bucket's
    /// collective reaches it in a healthy job, and short beside the group's timeout, which the
    /// engine's wait watches (a query alone would ask forever about a collective that a dead
    /// peer never joins).
    const PATIENCE: Duration = Duration::from_secs(1);

    /// Keeps `work` aside while its collective runs, finishing the oldest kept work first
    /// if that would keep more than [`Self::MOST`]; work whose collective is done already
    /// finishes now.
    pub(crate) fn park(&mut self, work: Box<dyn Unfinished>) {
        if work.is_done() {
            work.finish();
            return;
        }
        self.waiting.push_back((work, Instant::now()));
        while self.waiting.len() > Self::MOST {
            self.finish_oldest();
        }
    }

    /// Finishes, oldest first, the work whose collectives the device has finished.
    pub(crate) fn finish_done(&mut self) {
        while self.waiting.front().is_some_and(|(work, _)| work.is_done()) {
            self.finish_oldest();
        }
    }

    /// Called when the thread has nothing to issue: finishes what is done, and the oldest
    /// work once it has been kept for [`Self::PATIENCE`].
    pub(crate) fn idle(&mut self) {
        self.finish_done();
        if self
            .waiting
            .front()
            .is_some_and(|(_, since)| since.elapsed() >= Self::PATIENCE)
        {
            self.finish_oldest();
        }
    }

    /// Finishes every kept work, oldest first.
    pub(crate) fn finish_all(&mut self) {
        while !self.waiting.is_empty() {
            self.finish_oldest();
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    fn finish_oldest(&mut self) {
        if let Some((work, _)) = self.waiting.pop_front() {
            work.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    struct Work {
        name: &'static str,
        done: Arc<AtomicBool>,
        log: Arc<Mutex<Vec<&'static str>>>,
    }

    impl Unfinished for Work {
        fn is_done(&self) -> bool {
            self.done.load(Ordering::SeqCst)
        }

        fn finish(self: Box<Self>) {
            self.log.lock().unwrap().push(self.name);
        }
    }

    #[test]
    fn work_finishes_in_order_once_done_and_at_most_two_stay_in_flight() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let flags: Vec<Arc<AtomicBool>> =
            (0..4).map(|_| Arc::new(AtomicBool::new(false))).collect();
        let work = |i: usize, name| {
            Box::new(Work {
                name,
                done: flags[i].clone(),
                log: log.clone(),
            })
        };
        let mut parked = Parked::default();
        flags[0].store(true, Ordering::SeqCst);
        parked.park(work(0, "done when issued"));
        assert_eq!(*log.lock().unwrap(), ["done when issued"]);
        parked.park(work(1, "a"));
        parked.park(work(2, "b"));
        parked.finish_done();
        assert_eq!(log.lock().unwrap().len(), 1, "nothing done yet");
        // The second finishes first on the device, but work leaves in order.
        flags[2].store(true, Ordering::SeqCst);
        parked.finish_done();
        assert_eq!(log.lock().unwrap().len(), 1);
        // A third in flight: the oldest is finished, waiting for it.
        parked.park(work(3, "c"));
        assert_eq!(*log.lock().unwrap(), ["done when issued", "a"]);
        parked.finish_done();
        assert_eq!(*log.lock().unwrap(), ["done when issued", "a", "b"]);
        parked.finish_all();
        assert_eq!(*log.lock().unwrap(), ["done when issued", "a", "b", "c"]);
        assert!(parked.is_empty());
    }
}
