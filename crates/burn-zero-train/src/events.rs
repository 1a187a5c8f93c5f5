//! Where the ranks' training and validation items meet burn-train's event processor.
//!
//! Burn's metrics keep sums and counts (a loss weighted by its batch size, correct predictions
//! over items seen). Fed with every rank's items, they compute the metric of the whole global
//! batch — the sum over ranks divided by the count over ranks — rather than a mean of per-rank
//! means. So every rank of this process hands its items here, and they reach the processor
//! once all ranks' items of an iteration are in, in rank order: the same order every run, so
//! the metrics are reproducible bit for bit. An epoch ends for the processor when the last rank
//! ends it. Nothing here waits for a rank: a rank that fails leaves an incomplete iteration
//! behind, and the others are stopped by their collectives.

use std::collections::BTreeMap;
use std::sync::Mutex;

use burn_zero_comm::sync::{into_inner, lock};

use burn_train::{EventProcessorTraining, LearnerEvent, TrainingItem};

/// Which part of an epoch an event belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Split {
    Train,
    Valid,
}

/// Items of one iteration, by rank.
type Slots<T> = Vec<Option<TrainingItem<T>>>;

struct State<P, TO, VO> {
    processor: P,
    train: BTreeMap<(usize, usize), Slots<TO>>,
    valid: BTreeMap<(usize, usize), Slots<VO>>,
    /// Ranks that ended each (split, epoch).
    ended: BTreeMap<(Split, usize), usize>,
}

/// The event processor shared by the ranks of this process.
///
/// `ranks` is the number of ranks whose items count here: every rank of an in-process group,
/// every rank of the job when rank 0 receives all ranks' items, or the one rank of this process
/// otherwise. `enders` is how many `end_epoch` calls end an epoch: one per rank that hands in
/// items.
pub(crate) struct Funnel<P, TO, VO> {
    state: Mutex<State<P, TO, VO>>,
    ranks: usize,
    enders: usize,
}

impl<P, TO, VO> Funnel<P, TO, VO>
where
    P: EventProcessorTraining<LearnerEvent<TO>, LearnerEvent<VO>>,
{
    pub(crate) fn new(processor: P, ranks: usize, enders: usize) -> Self {
        Self {
            state: Mutex::new(State {
                processor,
                train: BTreeMap::new(),
                valid: BTreeMap::new(),
                ended: BTreeMap::new(),
            }),
            ranks,
            enders,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<P, TO, VO>> {
        // A rank that panicked while holding the lock leaves the state as consistent as any
        // event boundary: keep going, the run is being stopped anyway.
        lock(&self.state)
    }

    /// Rank `slot`'s training item of `iteration` in `epoch`.
    pub(crate) fn train_item(
        &self,
        slot: usize,
        epoch: usize,
        iteration: usize,
        item: TrainingItem<TO>,
    ) {
        let mut state = self.lock();
        let ranks = self.ranks;
        let slots = state
            .train
            .entry((epoch, iteration))
            .or_insert_with(|| (0..ranks).map(|_| None).collect());
        slots[slot] = Some(item);
        if slots.iter().all(Option::is_some) {
            let slots = state.train.remove(&(epoch, iteration)).unwrap_or_default();
            for item in slots.into_iter().flatten() {
                state
                    .processor
                    .process_train(LearnerEvent::ProcessedItem(item));
            }
        }
    }

    /// Rank `slot`'s validation item of `iteration` in `epoch`.
    pub(crate) fn valid_item(
        &self,
        slot: usize,
        epoch: usize,
        iteration: usize,
        item: TrainingItem<VO>,
    ) {
        let mut state = self.lock();
        let ranks = self.ranks;
        let slots = state
            .valid
            .entry((epoch, iteration))
            .or_insert_with(|| (0..ranks).map(|_| None).collect());
        slots[slot] = Some(item);
        if slots.iter().all(Option::is_some) {
            let slots = state.valid.remove(&(epoch, iteration)).unwrap_or_default();
            for item in slots.into_iter().flatten() {
                state
                    .processor
                    .process_valid(LearnerEvent::ProcessedItem(item));
            }
        }
    }

    /// One rank finished `split` of `epoch`; the last one tells the processor.
    pub(crate) fn end_epoch(&self, split: Split, epoch: usize) {
        let mut state = self.lock();
        let ended = state.ended.entry((split, epoch)).or_insert(0);
        *ended += 1;
        if *ended == self.enders {
            state.ended.remove(&(split, epoch));
            match split {
                Split::Train => state.processor.process_train(LearnerEvent::EndEpoch(epoch)),
                Split::Valid => state.processor.process_valid(LearnerEvent::EndEpoch(epoch)),
            }
        }
    }

    /// The processor, once every rank is done.
    pub(crate) fn into_processor(self) -> P {
        into_inner(self.state).processor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataloader::Progress;

    /// Records what reaches the processor.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl EventProcessorTraining<LearnerEvent<u32>, LearnerEvent<u32>> for Log {
        fn process_train(&mut self, event: LearnerEvent<u32>) {
            self.0.push(describe("train", event));
        }
        fn process_valid(&mut self, event: LearnerEvent<u32>) {
            self.0.push(describe("valid", event));
        }
        fn renderer(self) -> Box<dyn burn_train::renderer::MetricsRenderer> {
            unreachable!("not used by the funnel")
        }
    }

    fn describe(split: &str, event: LearnerEvent<u32>) -> String {
        match event {
            LearnerEvent::ProcessedItem(item) => format!("{split} item {}", item.item),
            LearnerEvent::EndEpoch(epoch) => format!("{split} end {epoch}"),
            _ => format!("{split} other"),
        }
    }

    fn item(value: u32) -> TrainingItem<u32> {
        TrainingItem::new(value, Progress::new(0, 1), Progress::new(1, 1), None, None)
    }

    #[test]
    fn items_reach_the_processor_per_iteration_in_rank_order() {
        let funnel = Funnel::new(Log::default(), 2, 2);
        // Rank 1 runs ahead of rank 0.
        funnel.train_item(1, 1, 1, item(11));
        funnel.train_item(1, 1, 2, item(12));
        funnel.end_epoch(Split::Train, 1);
        funnel.train_item(0, 1, 1, item(1));
        funnel.valid_item(1, 1, 1, item(21));
        funnel.train_item(0, 1, 2, item(2));
        funnel.end_epoch(Split::Train, 1);
        funnel.valid_item(0, 1, 1, item(20));
        funnel.end_epoch(Split::Valid, 1);
        funnel.end_epoch(Split::Valid, 1);
        assert_eq!(
            funnel.into_processor().0,
            [
                "train item 1",
                "train item 11",
                "train item 2",
                "train item 12",
                "train end 1",
                "valid item 20",
                "valid item 21",
                "valid end 1",
            ]
        );
    }

    #[test]
    fn an_incomplete_iteration_is_never_processed() {
        let funnel = Funnel::new(Log::default(), 2, 2);
        funnel.train_item(0, 1, 1, item(1));
        funnel.end_epoch(Split::Train, 1);
        assert!(funnel.into_processor().0.is_empty());
    }
}
