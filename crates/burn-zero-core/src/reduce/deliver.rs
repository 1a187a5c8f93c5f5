//! Delivery: each reduced bucket's gradients, written into autodiff's slots in the form the
//! optimizer expects — the mean gradient in the parameter's shape (all-reduce), or this
//! rank's shard of it (reduce-scatter) — or kept as orphans when this rank has no slot.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::TensorData;
use burn::tensor::backend::Backend;

use crate::reduce::bucket::{Bucket, Member, Mode};
use crate::reduce::queue::Reduced;
use crate::reduce::reduction::Values;
use crate::reduce::slot::GradSlot;
use crate::reduce::stats::ReductionStats;
use crate::store::{ParamStore, ShardedParam, SharedRow};
use crate::tensor::{ShardedView, ZeroTensor};

/// Where reduced gradients go: autodiff's slots of this pass, by key, and the orphans (reduced
/// gradients of parameters this rank did not use).
pub(crate) struct Destinations<'a, B: Backend> {
    pub slots: &'a mut BTreeMap<usize, GradSlot<B>>,
    pub orphans: &'a mut BTreeMap<usize, ZeroTensor<B>>,
}

/// Delivers every reduced bucket (`reduced`, indices into `buckets`) and counts it in `stats`.
pub(crate) fn deliver<B: Backend>(
    store: &Arc<ParamStore<B>>,
    buckets: &[Bucket],
    reduced: Vec<Reduced<B>>,
    to: Destinations<'_, B>,
    stats: &mut ReductionStats,
) {
    // With hybrid sharding a bucket is reduced in its shard group, then across the groups.
    let per_bucket = if store.groups().replicas.is_some() {
        2
    } else {
        1
    };
    for Reduced { bucket, values } in reduced {
        let bucket = &buckets[bucket];
        stats.collectives += per_bucket;
        stats.bytes += bucket.bytes(store.world_size());
        let mode = bucket.mode;
        let values: Vec<ZeroTensor<B>> = match values {
            Values::Device(values) => (bucket.members.iter().zip(values))
                .map(|(member, value)| gradient(store, mode, member, value))
                .collect(),
            Values::Row(row) => {
                let row = SharedRow::new(row);
                (bucket.members.iter())
                    .map(|member| gradient_part(store, member, &row))
                    .collect()
            }
            Values::Host(shards) => (bucket.members.iter().zip(shards))
                .map(|(member, data)| host_gradient(store, member, data))
                .collect(),
        };
        for (member, value) in bucket.members.iter().zip(values) {
            match to.slots.remove(&member.key) {
                Some(slot) => slot.write(value),
                None => {
                    to.orphans.insert(member.key, value);
                }
            }
            if mode == Mode::ReduceScatter {
                store.reuse_block_for_gradient(member.key);
            }
        }
    }
}

/// A member's reduced gradient shard, already read back to host memory, as the tensor
/// autodiff receives.
fn host_gradient<B: Backend>(
    store: &Arc<ParamStore<B>>,
    member: &Member,
    data: TensorData,
) -> ZeroTensor<B> {
    let (shape, dtype) = (member.shape.clone(), member.dtype);
    let shard = ShardedParam::gradient_on_host(store, member.key, data, shape, dtype);
    ZeroTensor::Sharded(ShardedView::new(Arc::new(shard)))
}

/// A member's reduced gradient shard as its range of its chunk's reduced `row`, the tensor
/// autodiff receives.
fn gradient_part<B: Backend>(
    store: &Arc<ParamStore<B>>,
    member: &Member,
    row: &Arc<SharedRow<B>>,
) -> ZeroTensor<B> {
    let range = member.offset..member.offset + member.len;
    let shard = ShardedParam::gradient_part(store, member.key, row, range, member.shape.clone());
    ZeroTensor::Sharded(ShardedView::new(Arc::new(shard)))
}

/// Turns a member's reduced flat gradient into the tensor autodiff receives.
fn gradient<B: Backend>(
    store: &Arc<ParamStore<B>>,
    mode: Mode,
    member: &Member,
    reduced: B::FloatTensorPrimitive,
) -> ZeroTensor<B> {
    match mode {
        Mode::AllReduce => ZeroTensor::Local(B::float_reshape(reduced, member.shape.clone())),
        Mode::ReduceScatter => {
            let shard = ShardedParam::gradient(
                store,
                member.key,
                reduced,
                member.shape.clone(),
                member.dtype,
            );
            ZeroTensor::Sharded(ShardedView::new(Arc::new(shard)))
        }
    }
}
