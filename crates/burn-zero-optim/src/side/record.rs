//! One side's state as a record of its entries where it keeps them, and back.

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;

use super::Side;
use super::owned::keep_host_gradients;
use crate::master::Master;
use crate::masters::Masters;
use crate::place::Place;
use crate::record::ZeroOptimizerRecord;

impl<O, B: Backend, P: Place<B>> Side<O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// This side's state as a record of entries where it keeps them (no communication).
    pub(crate) fn record(&self) -> ZeroOptimizerRecord<B, O, P::Host> {
        ZeroOptimizerRecord::new(
            self.placement,
            self.masters
                .entries(self.zero.as_ref().map(|zero| zero.store().chunks()))
                .into_iter()
                .map(|(key, m)| (key, m.values, m.state))
                .collect(),
            self.accumulated
                .iter()
                .map(|(&key, sum)| (key, sum.clone()))
                .collect(),
            self.micro_steps,
            self.scaler.as_ref().map(|s| s.state()),
            self.skipped,
        )
    }

    /// Replaces this rank's state with `record`. The optimizer's own settings (the wrapped
    /// optimizer, clipping, accumulation, loss-scaler knobs) stay; a recorded loss-scaler state
    /// is restored only into an optimizer that has a scaler.
    pub(crate) fn restore(mut self, record: ZeroOptimizerRecord<B, O, P::Host>) -> Self {
        if let Some(zero) = record.binding {
            keep_host_gradients::<B, P>(&zero, &self.owned);
            self.zero = Some(zero);
        }
        self.placement = record.placement;
        // Chunks' masters are joined from these entries at the next step.
        self.masters = Masters::from_entries(
            record
                .masters
                .into_iter()
                .map(|(key, values, state)| (key, Master { values, state })),
        );
        self.accumulated = record.accumulated.into_iter().collect();
        self.micro_steps = record.micro_steps;
        self.skipped = record.skipped;
        match (&mut self.scaler, record.scaler) {
            (Some(scaler), Some(state)) => scaler.set_state(state),
            (None, Some(_)) => tracing::warn!(
                "the optimizer record has a loss-scaler state but this optimizer has no scaler"
            ),
            _ => {}
        }
        self.report_memory();
        self
    }
}
