//! `gpu_margin_mem_ratio` (Gemini, ColossalAI's `ShardedOptimizerV2`): optimizer chunks move
//! into the device memory the placement leaves over at the peak, and step there.
//!
//! The auto placement (`Placement::auto`) measures the device's peak
//! over its warm-up, with every parameter shard on the host, and moves the shards that fit in
//! `0.9 × capacity − peak`. What that room has left after the shards is memory the step never
//! needs at its peak; the ratio says how much of it the optimizer may take (the host shards the
//! placement keeps on the device between uses then plan for that much less). At the first step after the
//! placement decided, host chunks move to the device in layout order while their masters and
//! state (as measured on the host) fit in `ratio × left over`; the rest keep stepping on the
//! host. The decision is made once, as the placement's is.

use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;

use super::ZeroOptimizer;

/// The policy's setting (`Placement::gpu_margin_mem_ratio`) and, once it acted, what it did.
#[derive(Debug, Clone, Copy)]
pub(super) struct Margin {
    pub(super) ratio: f64,
    pub(super) shared: Option<MarginReport>,
}

/// What `gpu_margin_mem_ratio` moved on a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarginReport {
    /// The bytes the optimizer chunks were allowed on the device: the ratio of what the auto
    /// placement left over.
    pub budget_bytes: u64,
    /// Chunks whose state moved to the device.
    pub moved_chunks: usize,
    /// Their masters' and state's bytes.
    pub moved_bytes: u64,
    /// Chunks still stepping on the host.
    pub host_chunks: usize,
}

impl<B: Backend, O, H: Backend> ZeroOptimizer<B, O, H>
where
    O: SimpleOptimizer<B> + SimpleOptimizer<H>,
{
    /// What the margin policy moved, once it has.
    pub fn margin_report(&self) -> Option<MarginReport> {
        self.margin?.shared
    }

    /// The policy's one decision, at the first step boundary after the auto placement's.
    pub(super) fn share_margin(&mut self) {
        let Some(Margin {
            ratio,
            shared: None,
        }) = self.margin
        else {
            return;
        };
        let zero = self.device.zero_state().expect("made bound");
        let Some(placed) = zero.store().auto_placement() else {
            return;
        };
        if self.device.micro_steps() != 0 {
            return;
        }
        let budget = (ratio * placed.left_over_bytes() as f64) as u64;
        let mut moving = Vec::new();
        let mut taken = 0u64;
        for &id in &self.host_chunks {
            let Some(bytes) = self.chunk_state_bytes(id) else {
                break;
            };
            if taken + bytes as u64 > budget {
                break;
            }
            taken += bytes as u64;
            moving.push(id);
        }
        // The state moved takes room the kept parameter shards planned for (the store is told
        // as the chunks move).
        self.place_on_device(&moving)
            .expect("at a step boundary, host chunks only");
        let report = MarginReport {
            budget_bytes: budget,
            moved_chunks: moving.len(),
            moved_bytes: taken,
            host_chunks: self.host_chunks.len(),
        };
        tracing::info!(?report, "optimizer chunks placed in the device's margin");
        self.margin = Some(Margin {
            ratio,
            shared: Some(report),
        });
    }
}
