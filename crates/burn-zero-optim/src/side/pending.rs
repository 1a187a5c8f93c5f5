//! The chunks of one step waiting for the module walk to reach them.
//!
//! A chunked step joins each chunk's gradient before the walk, then steps a chunk when the walk
//! reaches its first member; this module holds what waits between the two: the joined
//! gradients, the members' old values and the new values not yet written into the module.

use std::collections::HashMap;

use burn::module::ParamId;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_core::{ParamStore, ZeroTensor};

/// The chunks of one step not yet stepped. The step walks the module and steps a chunk when
/// it reaches the chunk's first member; the members' new values wait in `stepped` for the walk
/// to reach them, and their old values leave `values`. So a chunk's old values are dropped
/// (when nothing else holds the module) before the next chunk's new ones are written: the
/// device holds one chunk twice at most, not every parameter twice, as stepping every chunk
/// before the walk did.
pub(crate) struct PendingChunks<B: Backend, H: Backend> {
    /// Each chunk's gradient, by chunk id.
    grads: HashMap<usize, ChunkGrad<H>>,
    /// The chunk of each member with a gradient, by parameter.
    chunk_of: HashMap<ParamId, usize>,
    /// The current value of every collected parameter not yet stepped, by key.
    values: HashMap<usize, ZeroTensor<B>>,
    /// Every collected parameter's id, by key.
    ids: HashMap<usize, ParamId>,
    /// New values of stepped chunks' members the walk has not reached yet.
    stepped: HashMap<ParamId, ZeroTensor<B>>,
}

impl<B: Backend, H: Backend> PendingChunks<B, H> {
    /// The chunks of `grads` to step, their members' current `values` and ids by key.
    pub(crate) fn new(
        store: &ParamStore<B>,
        grads: Vec<ChunkGrad<H>>,
        values: HashMap<usize, ZeroTensor<B>>,
        ids: HashMap<usize, ParamId>,
    ) -> Self {
        let chunks = store.chunks();
        let mut chunk_of = HashMap::new();
        for grad in &grads {
            for member in &chunks.chunks()[grad.chunk].members {
                if let Some(&id) = ids.get(&member.key) {
                    chunk_of.insert(id, grad.chunk);
                }
            }
        }
        Self {
            grads: grads.into_iter().map(|g| (g.chunk, g)).collect(),
            chunk_of,
            values,
            ids,
            stepped: HashMap::new(),
        }
    }

    /// Drops parameter `key`'s old value, stepped outside chunks.
    pub(crate) fn forget(&mut self, key: usize) {
        self.values.remove(&key);
    }

    /// The chunk gradient to step when `id` is the first member of its chunk the walk reaches,
    /// once: `None` for a parameter of no pending chunk or of one already stepped.
    pub(crate) fn first_reached(&mut self, id: ParamId) -> Option<ChunkGrad<H>> {
        let chunk = self.chunk_of.remove(&id)?;
        self.grads.remove(&chunk)
    }

    /// The current values of the collected parameters not yet stepped, by key.
    pub(crate) fn values(&self) -> &HashMap<usize, ZeroTensor<B>> {
        &self.values
    }

    /// Records a stepped chunk: its members' (`keys`) old values are dropped, and the `new`
    /// values wait for the walk, by parameter.
    pub(crate) fn replace(
        &mut self,
        keys: impl IntoIterator<Item = usize>,
        new: HashMap<usize, ZeroTensor<B>>,
    ) {
        for key in keys {
            self.values.remove(&key);
        }
        for (key, value) in new {
            if let Some(&id) = self.ids.get(&key) {
                self.stepped.insert(id, value);
            }
        }
    }

    /// Parameter `id`'s new value, once its chunk was stepped.
    pub(crate) fn take_new_value(&mut self, id: ParamId) -> Option<ZeroTensor<B>> {
        self.stepped.remove(&id)
    }

    /// Whether every chunk was stepped and every new value written.
    pub(crate) fn is_done(&self) -> bool {
        self.grads.is_empty() && self.stepped.is_empty()
    }
}

/// A trainable chunk's gradient on this rank: its members' parts end to end, in f32.
pub(crate) struct ChunkGrad<H: Backend> {
    /// The chunk's id in the layout.
    pub chunk: usize,
    /// Whether the parts are shards (every rank's part counts in the global norm) rather than
    /// whole replicated gradients (counted on rank 0 only).
    pub sharded: bool,
    pub grad: Tensor<H, 1>,
}
