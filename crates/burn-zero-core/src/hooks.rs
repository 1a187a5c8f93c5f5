//! Where autodiff's gradient hooks find the rank's group: a per-thread registry (backward runs
//! on the rank's own thread; CPU backends give every rank the same device id, so the device
//! cannot tell ranks apart).

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::{DistributedParamId, DistributedParams};

use crate::grads::GradSlot;
use crate::group::ZeroGroup;
use crate::tensor::ZeroTensor;

/// A registered group and the parameter marks it answers for.
struct Entry {
    group: Arc<dyn Any + Send + Sync>,
    params: HashSet<DistributedParamId>,
}

thread_local! {
    static GROUPS: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// Makes `group` known to this thread's gradient hooks. The registry holds the group (below
/// stage 3 no tensor does); a group whose parameters a newer group re-registers (the same
/// model sharded again) is dropped.
pub(crate) fn register<B: Backend>(group: &Arc<ZeroGroup<B>>) {
    let params = group.param_ids();
    GROUPS.with(|groups| {
        let mut groups = groups.borrow_mut();
        groups.retain(|entry| entry.params.is_disjoint(&params));
        groups.push(Entry {
            group: group.clone(),
            params,
        });
    });
}

/// This thread's groups of backend `B`, oldest first.
pub fn groups<B: Backend>() -> Vec<Arc<ZeroGroup<B>>> {
    GROUPS.with(|groups| {
        groups
            .borrow()
            .iter()
            .filter_map(|entry| entry.group.clone().downcast::<ZeroGroup<B>>().ok())
            .collect()
    })
}

/// The most recently sharded module's group on this thread.
pub fn current_group<B: Backend>() -> Option<Arc<ZeroGroup<B>>> {
    groups::<B>().pop()
}

/// The group that sharded the parameter with this mark (`DistributedParamId::from(param_id.val())`)
/// on this thread, and the parameter's key in it.
pub fn group_of<B: Backend>(id: &DistributedParamId) -> Option<(Arc<ZeroGroup<B>>, usize)> {
    groups::<B>()
        .into_iter()
        .find_map(|group| group.key_of(id).map(|key| (group, key)))
}

fn find<B: Backend>(id: &DistributedParamId) -> (Arc<ZeroGroup<B>>, usize) {
    group_of::<B>(id).unwrap_or_else(|| {
        panic!(
            "burn-zero: a gradient hook fired for a parameter that no `shard` on this thread \
                 knows; shard the module on the thread that runs backward"
        )
    })
}

/// `register_sync_parameters`: a backward pass with marked parameters begins.
pub(crate) fn begin_backward<B: Backend>(params: &[DistributedParams]) {
    let mut started: Vec<Arc<ZeroGroup<B>>> = Vec::new();
    for param in params {
        let (group, _) = find::<B>(&param.param_id);
        if !started.iter().any(|g| Arc::ptr_eq(g, &group)) {
            group.begin_backward();
            started.push(group);
        }
    }
}

/// `submit_gradient_sync`: one parameter's gradient is final.
pub(crate) fn gradient_ready<B: Backend>(slot: *mut ZeroTensor<B>, params: &DistributedParams) {
    let (group, key) = find::<B>(&params.param_id);
    group.gradient_ready(key, GradSlot::new(slot));
}

/// `submit_sync_collective`: the backward pass is over.
pub(crate) fn end_backward<B: Backend>() {
    for group in groups::<B>() {
        group.end_backward();
    }
}
