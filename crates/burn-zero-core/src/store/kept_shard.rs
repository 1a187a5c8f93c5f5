//! [`KeptShard`]: the device copy of a host parameter shard that the auto placement keeps
//! between uses, filled by the upload that makes it.
//!
//! # Why a slot
//!
//! The placement decides whether to keep a shard when its gather is issued, on the training
//! thread, so that what it keeps, evicts and counts follows the training thread's order alone
//! and is the same from run to run. The upload itself is made by whoever gathers the shard: a
//! prefetched gather's by the rank's issuing thread, on its stream, just before the
//! collective ([`crate::store::upload`]), so that the copy does not sit in front of the
//! training thread's kernels. Between the two the kept copy is a slot, filled when the upload
//! runs. A slot read before it was filled (the gather it was made for was dropped, or has not
//! been issued yet) is not used: the reader uploads again and the placement forgets the slot.

use std::sync::{Arc, OnceLock};

use burn::tensor::backend::Backend;

/// A kept shard's device values, once its upload has run (clones share the slot).
pub(crate) struct KeptShard<B: Backend> {
    values: Arc<OnceLock<B::FloatTensorPrimitive>>,
}

impl<B: Backend> Clone for KeptShard<B> {
    fn clone(&self) -> Self {
        Self {
            values: Arc::clone(&self.values),
        }
    }
}

impl<B: Backend> KeptShard<B> {
    /// A slot whose upload is still to be made.
    pub(crate) fn pending() -> Self {
        Self {
            values: Arc::new(OnceLock::new()),
        }
    }

    /// Fills the slot with the uploaded `values` (the first upload wins; there is one per
    /// slot).
    pub(crate) fn fill(&self, values: B::FloatTensorPrimitive) {
        let _ = self.values.set(values);
    }

    /// The device values, once uploaded.
    pub(crate) fn values(&self) -> Option<B::FloatTensorPrimitive> {
        self.values.get().cloned()
    }
}
