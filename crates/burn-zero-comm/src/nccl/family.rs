//! What the NCCL groups of one job in this process share: the job's first failure, the first
//! cause a rank reported, and which ranks left each group.
//!
//! The ranks of one process ([`super::NcclGroup::local_group`]) and every duplicate or split
//! of their groups belong to one family, so the first failure of any of them ends them all.
//! Departures are kept per group, because each group numbers its calls apart.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn_zero_launch::sync::lock;

use crate::error::CommError;

/// The state the groups of one family share; [`Family`] is the handle each group holds.
#[derive(Debug, Default)]
pub(crate) struct FamilyState {
    /// The first failure of any of them.
    failure: Mutex<Option<CommError>>,
    /// For each group of the family: the record of its ranks that left it.
    departed: Mutex<HashMap<Lineage, Departures>>,
    /// The first rank (numbered as the group everything was split from numbers it) that
    /// reported a failure of its own, with its reason.
    cause: Mutex<Option<(usize, String)>>,
}

pub(crate) type Family = Arc<FamilyState>;

/// Where a group comes from: the duplicates and splits that lead to it from the group the job
/// started with, each as the number of the call on its parent and the split's color (none for
/// a duplicate). The ranks' handles on one group have the same lineage, because every rank
/// makes it with the same call on the same parent; the call numbers of different groups are
/// not comparable.
pub(crate) type Lineage = Vec<(u64, Option<usize>)>;

impl FamilyState {
    /// The family's first failure, if one of its groups failed.
    pub(crate) fn failure(&self) -> Option<CommError> {
        lock(&self.failure).clone()
    }

    /// Records `error` as the family's failure, unless an earlier one was recorded.
    pub(crate) fn fail(&self, error: &CommError) {
        lock(&self.failure).get_or_insert_with(|| error.clone());
    }

    /// Records `reason`, reported by job rank `rank`, as the family's cause, unless another
    /// rank reported one first.
    pub(crate) fn note_cause(&self, rank: usize, reason: &str) {
        lock(&self.cause).get_or_insert_with(|| (rank, reason.to_string()));
    }

    /// The first cause a rank of this family reported.
    pub(crate) fn cause(&self) -> Option<(usize, String)> {
        lock(&self.cause).clone()
    }

    /// The record of departures of the group at `lineage`, made for `world_size` ranks by the
    /// first of its handles in this process.
    pub(crate) fn departures(&self, lineage: &Lineage, world_size: usize) -> Departures {
        lock(&self.departed)
            .entry(lineage.clone())
            .or_insert_with(|| Departures(Arc::new(Mutex::new(vec![None; world_size]))))
            .clone()
    }
}

/// For each rank of one group: how many collectives it had issued on the group when it left.
/// Shared by the handles of the group's ranks in this process.
#[derive(Debug, Clone)]
pub(crate) struct Departures(Arc<Mutex<Vec<Option<u64>>>>);

impl Departures {
    /// Records that `rank` left after issuing `issued` collectives (the first record stands).
    pub(crate) fn record(&self, rank: usize, issued: u64) {
        if let Some(slot) = lock(&self.0).get_mut(rank) {
            slot.get_or_insert(issued);
        }
    }

    /// A rank other than `rank` that left before issuing call number `seq`, which it will
    /// therefore never join.
    pub(crate) fn left_before(&self, rank: usize, seq: u64) -> Option<usize> {
        lock(&self.0)
            .iter()
            .enumerate()
            .find(|&(peer, issued)| peer != rank && issued.is_some_and(|n| n < seq))
            .map(|(peer, _)| peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_group_of_a_family_keeps_its_own_departures() {
        let family = FamilyState::default();
        let root = family.departures(&Lineage::new(), 4);
        let duplicate = family.departures(&vec![(3, None)], 4);
        let split = family.departures(&vec![(3, Some(1))], 2);
        root.record(1, 7);
        // Another rank's handle on the same group sees it; the rank that left is not asked
        // about itself, and it did join the calls up to its count.
        let root_again = family.departures(&Lineage::new(), 4);
        assert_eq!(root_again.left_before(0, 8), Some(1));
        assert_eq!(root_again.left_before(0, 7), None);
        assert_eq!(root_again.left_before(1, 8), None);
        // Leaving one group says nothing about the others, whose calls count apart.
        assert_eq!(duplicate.left_before(0, 8), None);
        split.record(1, 2);
        assert_eq!(split.left_before(0, 3), Some(1));
        let split_of_duplicate = family.departures(&vec![(3, None), (1, Some(1))], 2);
        assert_eq!(split_of_duplicate.left_before(0, 100), None);
        // A smaller split leaves the larger group's record whole: its last rank still records.
        root.record(3, 1);
        assert_eq!(root_again.left_before(0, 2), Some(3));
        // The first count stands.
        root.record(3, 9);
        assert_eq!(root_again.left_before(0, 2), Some(3));
    }

    #[test]
    fn the_first_failure_and_cause_stand() {
        let family = FamilyState::default();
        assert_eq!(family.failure(), None);
        family.fail(&CommError::InvalidGroup("first".into()));
        family.fail(&CommError::InvalidGroup("second".into()));
        assert_eq!(
            family.failure(),
            Some(CommError::InvalidGroup("first".into()))
        );
        family.note_cause(2, "out of memory");
        family.note_cause(0, "later");
        assert_eq!(family.cause(), Some((2, "out of memory".to_string())));
    }
}
