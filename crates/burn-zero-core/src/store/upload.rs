//! A shard to gather whose values may still be in host memory, uploaded by the thread that
//! gathers it.
//!
//! # Why
//!
//! An offloaded shard is uploaded for each gather. Uploaded on the training thread, its copy
//! runs in that thread's stream: a prefetch issued at the start of a layer puts the copy in
//! front of the layer's own kernels, which wait for it. Uploaded by the rank's issuing thread,
//! just before the gather it feeds, the copy runs in the issuing thread's stream while the
//! training thread's kernels run in theirs, and the collective is ordered after it there
//! (Gemini and DeepSpeed copy on a stream of their own for the same reason). cubecl stages an
//! upload through page-locked memory and queues the copy without waiting for the device, so
//! neither thread waits for the copy.
//!
//! A shard the auto placement keeps on the device between uses is uploaded the same way: the
//! placement decides to keep it when the gather is issued and hands the upload a slot
//! ([`KeptShard`]), which the upload fills with the device copy wherever it runs.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_zero_comm::RankCounters;

use crate::store::block::Block;
use crate::store::kept_shard::KeptShard;

/// A shard's values for a gather: on the device, or in host memory still.
pub(crate) enum ShardValues<B: Backend> {
    /// On the device.
    Device(Tensor<B, 1>),
    /// In host memory, to be uploaded by whoever gathers it.
    Host(Upload<B>),
}

impl<B: Backend> ShardValues<B> {
    /// The values on the device, uploaded here if they are not yet.
    pub fn on_device(self) -> Tensor<B, 1> {
        match self {
            ShardValues::Device(values) => values,
            ShardValues::Host(upload) => upload.run(),
        }
    }
}

/// Host bytes bound for `device`: one transfer, counted in `counters` when it is made, and
/// kept in the placement's slot `keep` when it keeps the copy.
pub(crate) struct Upload<B: Backend> {
    data: TensorData,
    device: B::Device,
    counters: Arc<RankCounters>,
    keep: Option<KeptShard<B>>,
}

impl<B: Backend> Upload<B> {
    pub fn new(
        data: TensorData,
        device: B::Device,
        counters: Arc<RankCounters>,
        keep: Option<KeptShard<B>>,
    ) -> Self {
        Self {
            data,
            device,
            counters,
            keep,
        }
    }

    /// Uploads the values, on this thread's stream.
    pub fn run(self) -> Tensor<B, 1> {
        let values = Block::<B>::upload(self.data, &self.device, &self.counters);
        if let Some(slot) = &self.keep {
            slot.fill(values.clone());
        }
        Tensor::from_primitive(TensorPrimitive::Float(values))
    }
}
