//! The learner's optimizer and scheduler state, out of a `Learner` and back in.
//!
//! burn-train's `Learner` keeps its optimizer and scheduler private. It loads their records
//! (`load_optim`, `load_scheduler`) but hands them out only to a `LearningCheckpointer`. So the
//! records are taken through one whose checkpointers keep what they are given in memory; the
//! sharded checkpoint then writes them (the optimizer's record is this rank's part only, and
//! taking it gathers nothing).

use std::sync::Mutex;
use std::sync::mpsc;

use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::Backend;
use burn_train::checkpoint::{
    AsyncCheckpointer, Checkpointer, CheckpointerError, CheckpointingAction, CheckpointingStrategy,
};
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    Learner, LearnerOptimizerRecord, LearnerSchedulerRecord, LearningCheckpointer,
    LearningComponentsTypes,
};
use burn_zero_comm::sync::lock;

use crate::error::TrainError;

/// A checkpointer that passes each saved record on through a channel (or drops it).
struct Capture<R> {
    sender: Option<Mutex<mpsc::Sender<R>>>,
}

impl<R, B> Checkpointer<R, B> for Capture<R>
where
    R: Record<B>,
    B: Backend,
{
    fn save(&self, _epoch: usize, record: R) -> Result<(), CheckpointerError> {
        if let Some(sender) = &self.sender {
            let sender = lock(sender);
            sender
                .send(record)
                .map_err(|_| CheckpointerError::Unknown("the record's receiver is gone".into()))?;
        }
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _epoch: usize, _device: &B::Device) -> Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "records are put back with the learner's load methods".into(),
        ))
    }
}

/// Saves on every call: the caller decides when.
struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(&mut self, _epoch: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

/// The learner's optimizer and scheduler records, as they are now.
pub(crate) fn take<LC: LearningComponentsTypes>(
    learner: &Learner<LC>,
    epoch: usize,
    store: &EventStoreClient,
) -> Result<(LearnerOptimizerRecord<LC>, LearnerSchedulerRecord<LC>), TrainError> {
    let (optim_tx, optim_rx) = mpsc::channel();
    let (scheduler_tx, scheduler_rx) = mpsc::channel();
    {
        let mut checkpointer = LearningCheckpointer::<LC>::new(
            // The model is the caller's to save: its record is dropped.
            AsyncCheckpointer::new(Capture { sender: None }),
            AsyncCheckpointer::new(Capture {
                sender: Some(Mutex::new(optim_tx)),
            }),
            AsyncCheckpointer::new(Capture {
                sender: Some(Mutex::new(scheduler_tx)),
            }),
            Box::new(Always),
        );
        checkpointer.checkpoint(learner, epoch, store);
        // Dropping it ends its threads once they are done with the records.
    }
    let optim = optim_rx
        .recv()
        .map_err(|_| TrainError::State("the learner gave no optimizer record".into()))?;
    let scheduler = scheduler_rx
        .recv()
        .map_err(|_| TrainError::State("the learner gave no scheduler record".into()))?;
    Ok((optim, scheduler))
}

/// A scheduler record as JSON, to travel in a checkpoint's metadata.
pub(crate) fn scheduler_to_json<LC: LearningComponentsTypes>(
    record: LearnerSchedulerRecord<LC>,
) -> Result<serde_json::Value, TrainError> {
    let item = Record::<LC::Backend>::into_item::<FullPrecisionSettings>(record);
    serde_json::to_value(item)
        .map_err(|e| TrainError::State(format!("the scheduler's record: {e}")))
}

/// A scheduler record back from [`scheduler_to_json`].
pub(crate) fn scheduler_from_json<LC: LearningComponentsTypes>(
    value: serde_json::Value,
    device: &burn::tensor::Device<LC::Backend>,
) -> Result<LearnerSchedulerRecord<LC>, TrainError> {
    let item = serde_json::from_value(value).map_err(|e| {
        TrainError::State(format!(
            "the checkpoint's scheduler state does not fit this scheduler: {e}"
        ))
    })?;
    Ok(
        <LearnerSchedulerRecord<LC> as Record<LC::Backend>>::from_item::<FullPrecisionSettings>(
            item, device,
        ),
    )
}
