//! Burn's static gradient-hook entry: how `DistributedBackend for Zero<B>`, which autodiff
//! calls without any receiver, finds the rank's gradient reducer.
//!
//! A per-thread registry: backward runs on the rank's own thread, and CPU backends give every
//! rank the same device id, so the device cannot tell ranks apart. Nothing else looks here:
//! the optimizer and checkpoints reach a sharded module's state through
//! [`crate::ZeroState`], which works on any thread.
//!
//! The registry only points at reducers (weakly): it keeps nothing alive. A sharded module's
//! reducer lives as long as its [`crate::ZeroState`] (and the optimizer built from it), so a
//! program that shards model after model on one thread frees each one, with its threads,
//! when it drops the model and its state.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::{Arc, Weak};

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::{DistributedParamId, DistributedParams};

use crate::reduce::reducer::GradientReducer;
use crate::reduce::slot::GradSlot;
use crate::tensor::ZeroTensor;

/// A registered reducer and the parameter marks it answers for.
struct Entry {
    reducer: Weak<dyn Any + Send + Sync>,
    params: HashSet<DistributedParamId>,
}

thread_local! {
    static REDUCERS: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// Makes `reducer` known to this thread's gradient hooks, without keeping it alive. Entries
/// of reducers that are gone, and of reducers whose parameters a newer one registers (the same
/// model sharded again), are removed.
pub(crate) fn register<B: Backend>(reducer: &Arc<GradientReducer<B>>) {
    let params = reducer.store().param_ids();
    let any: Arc<dyn Any + Send + Sync> = reducer.clone();
    REDUCERS.with(|reducers| {
        let mut reducers = reducers.borrow_mut();
        reducers
            .retain(|entry| entry.reducer.strong_count() > 0 && entry.params.is_disjoint(&params));
        reducers.push(Entry {
            reducer: Arc::downgrade(&any),
            params,
        });
    });
}

/// This thread's reducers of backend `B`, oldest first.
fn reducers<B: Backend>() -> Vec<Arc<GradientReducer<B>>> {
    REDUCERS.with(|reducers| {
        reducers
            .borrow()
            .iter()
            .filter_map(|entry| {
                entry
                    .reducer
                    .upgrade()?
                    .downcast::<GradientReducer<B>>()
                    .ok()
            })
            .collect()
    })
}

/// The reducer of the parameter marked `id`, and the parameter's key.
fn find<B: Backend>(id: &DistributedParamId) -> (Arc<GradientReducer<B>>, usize) {
    reducers::<B>()
        .into_iter()
        .find_map(|reducer| reducer.store().key_of(id).map(|key| (reducer, key)))
        .unwrap_or_else(|| {
            panic!(
                "burn-zero: a gradient hook fired for a parameter that no live `shard` on this \
                 thread knows: shard the module on the thread that runs backward, and keep the \
                 `ZeroState` that `shard` returned (or the `ZeroOptimizer` built from it) as long \
                 as the module trains"
            )
        })
}

/// `register_sync_parameters`: a backward pass with marked parameters begins.
pub(crate) fn register_sync_parameters<B: Backend>(params: &[DistributedParams]) {
    let mut started: Vec<Arc<GradientReducer<B>>> = Vec::new();
    for param in params {
        let (reducer, _) = find::<B>(&param.param_id);
        if !started.iter().any(|r| Arc::ptr_eq(r, &reducer)) {
            reducer.begin_backward();
            started.push(reducer);
        }
    }
}

/// `submit_gradient_sync`: one parameter's gradient, in autodiff's `slot`, is final.
pub(crate) fn submit_gradient_sync<B: Backend>(
    slot: *mut ZeroTensor<B>,
    params: &DistributedParams,
) {
    let (reducer, key) = find::<B>(&params.param_id);
    reducer.gradient_ready(key, GradSlot::new(slot));
}

/// `submit_sync_collective`: the backward pass is over.
pub(crate) fn submit_sync_collective<B: Backend>() {
    for reducer in reducers::<B>() {
        reducer.end_backward();
    }
}
