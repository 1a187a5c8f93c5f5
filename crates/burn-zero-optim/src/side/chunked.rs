//! Chunked steps: one flat fp32 master per chunk, stepped in one optimizer call.
//!
//! With a chunk layout (`ZeroConfig::chunk_size`), a rank's part of a chunk is its members'
//! parts end to end — their blocks (sharded gradients) or whole values (all-reduced ones) — so
//! the master copy and the optimizer's state of a chunk are one flat tensor each, and one call
//! of the optimizer steps them all: a dozen tensor operations per chunk for Adam instead of a
//! dozen per parameter. Burn's Adam, AdamW and SGD are elementwise, so the values are bitwise
//! those of stepping each parameter alone; an optimizer whose step is not elementwise (a
//! per-tensor norm) would differ, and needs `ChunkSize::PerParameter`.
//!
//! Records stay per parameter: a chunk's master and state are split into its members' when
//! recorded, and members' entries are joined into the chunk's master at the first step after
//! they are restored. Checkpoints and records written with or without chunks load either way.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::ParamId;
use burn::optim::SimpleOptimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use burn_zero_core::chunk::{Chunk, ChunkKind};
use burn_zero_core::store::{SharedRow, host_slices};
use burn_zero_core::{ParamStore, ShardedView, ZeroTensor};
use burn_zero_kernels::{KernelError, PackPath, join};

use super::Side;
use super::collect::{Grad, Taken, flat};
use super::pending::{ChunkGrad, PendingChunks};
use crate::master::{Master, cast_to};
use crate::masters::Masters;
use crate::place::Place;

/// New values by parameter key, while a step writes them.
type ByKey<B> = HashMap<usize, ZeroTensor<B>>;

impl<O, B: Backend, P: Place<B>> Side<O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// Takes the gradients of every trainable chunk whose members have one out of `taken` and
    /// joins them into the chunk's flat gradient (its parts end to end, in f32), so that
    /// statistics and the step see one tensor per chunk. Parameters of no chunk stay in
    /// `taken`.
    pub(crate) fn join_chunk_grads(
        &self,
        taken: &mut HashMap<ParamId, Taken<P::Host>>,
    ) -> Vec<ChunkGrad<P::Host>> {
        let zero = self.zero.as_ref().expect("a stepping optimizer is bound");
        let mut ids: HashMap<usize, ParamId> = taken.iter().map(|(id, t)| (t.key, *id)).collect();
        let mut joined = Vec::new();
        for chunk in zero
            .store()
            .chunks()
            .chunks()
            .iter()
            .filter(|c| c.trainable)
        {
            let present = chunk
                .members
                .iter()
                .filter(|m| ids.contains_key(&m.key))
                .count();
            if present == 0 {
                continue;
            }
            if present < chunk.members.len() {
                panic!(
                    "burn-zero: rank {}: {present} of the {} parameters of chunk #{} have a \
                     gradient; a chunk's gradients are reduced together, so all or none do",
                    zero.rank(),
                    chunk.members.len(),
                    chunk.id
                );
            }
            let parts: Vec<Grad<P::Host>> = chunk
                .members
                .iter()
                .map(|m| {
                    let id = ids.remove(&m.key).expect("counted above");
                    taken.remove(&id).expect("taken").grad
                })
                .collect();
            let grad = match whole_row(chunk, &parts) {
                Some(row) => cast_to(row, DType::F32),
                None => join_parts(&parts).unwrap_or_else(|error| {
                    panic!(
                        "burn-zero: rank {}: the gradients of chunk #{} could not be joined: \
                         {error}",
                        zero.rank(),
                        chunk.id
                    )
                }),
            };
            joined.push(ChunkGrad {
                chunk: chunk.id,
                sharded: chunk.kind == ChunkKind::Sharded,
                grad,
            });
        }
        joined
    }

    /// The new value of parameter `id` when a chunk of `pending` holds it: stepped now, with
    /// the rest of its chunk, if this is the first member the step reaches. `None` for a
    /// parameter of no pending chunk.
    pub(crate) fn take_stepped(
        &mut self,
        lr: f64,
        factor: f64,
        pending: &mut PendingChunks<B, P::Host>,
        id: ParamId,
    ) -> Option<ZeroTensor<B>> {
        if let Some(grad) = pending.first_reached(id) {
            self.step_chunk(lr, factor, grad, pending);
        }
        pending.take_new_value(id)
    }

    /// Steps one chunk of `pending` and hands its members' new values to `pending`, which
    /// drops their old ones.
    fn step_chunk(
        &mut self,
        lr: f64,
        factor: f64,
        grad: ChunkGrad<P::Host>,
        pending: &mut PendingChunks<B, P::Host>,
    ) {
        let zero = self.zero.clone().expect("a stepping optimizer is bound");
        let store = zero.store().clone();
        let chunk = &store.chunks().chunks()[grad.chunk];
        let values = pending.values();
        let master = Self::chunk_master(&mut self.masters, &store, chunk, values);
        let updated = master.step(
            &self.optim,
            self.one_pass,
            lr,
            grad.grad,
            factor,
            chunk.dtype,
        );
        let mut stepped = ByKey::new();
        if let Some(views) = host_members(&store, chunk, values) {
            // An offloaded chunk's shards go to host memory in one read, not one per member.
            let data = P::into_host_data(cast_to(updated, chunk.dtype), store.counters());
            write_back_host(chunk, &data, views, &mut stepped);
        } else {
            let updated = cast_to(
                P::to_model(updated, store.device(), store.counters()),
                chunk.dtype,
            );
            self.write_back(&store, chunk, updated, values, &mut stepped);
        }
        pending.replace(chunk.members.iter().map(|m| m.key), stepped);
    }

    /// `chunk`'s flat master: kept from the last step, joined from its members' restored
    /// entries, or made from the members' current `values`. At stage 3 the store learns that
    /// the members' values have a master (for `reuse_fp16_shard`).
    fn chunk_master<'m>(
        masters: &'m mut Masters<O, P::Host>,
        store: &ParamStore<B>,
        chunk: &Chunk,
        values: &HashMap<usize, ZeroTensor<B>>,
    ) -> &'m mut Master<O, P::Host> {
        if chunk.kind == ChunkKind::Sharded && store.config().stage == 3 {
            for member in &chunk.members {
                store.hold_master(member.key);
            }
        }
        masters.chunk_or_make(chunk, || {
            let parts: Vec<Tensor<B, 1>> = chunk
                .members
                .iter()
                .map(|m| part_of(store, chunk, values, m.key))
                .collect();
            Master::new(P::to_host(Tensor::cat(parts, 0), store.counters()))
        })
    }

    /// Writes a chunk's `updated` values (on the model's device, in the parameters' dtype)
    /// back into its members: their new shards at stage 3, all-gathered into the replicated
    /// parameters at stages 1 and 2 (one collective for the chunk), or whole when the chunk
    /// is replicated.
    fn write_back(
        &self,
        store: &Arc<ParamStore<B>>,
        chunk: &Chunk,
        updated: Tensor<B, 1>,
        values: &HashMap<usize, ZeroTensor<B>>,
        stepped: &mut ByKey<B>,
    ) {
        let sharded_params = values
            .get(&chunk.members[0].key)
            .is_some_and(|v| matches!(v, ZeroTensor::Sharded(_)));
        match chunk.kind {
            ChunkKind::Sharded if !sharded_params => {
                let full = store
                    .all_gather_chunk(chunk, updated)
                    .unwrap_or_else(|error| {
                        panic!(
                            "burn-zero: rank {} could not gather the updated parameters of chunk \
                             #{}: {error}",
                            store.rank(),
                            chunk.id
                        )
                    });
                for (key, full) in full {
                    stepped.insert(key, ZeroTensor::Local(full));
                }
            }
            ChunkKind::Sharded => {
                // The members' new blocks are ranges of the one updated shard: nothing is cut
                // out now, and the chunk's next gather reads the shard whole.
                let row = SharedRow::new(updated.into_primitive().tensor());
                for member in &chunk.members {
                    let Some(ZeroTensor::Sharded(view)) = values.get(&member.key) else {
                        continue;
                    };
                    let param = view.param().with_shard_part(&row, member.block());
                    let value = ZeroTensor::Sharded(ShardedView::new(Arc::new(param)));
                    stepped.insert(member.key, value);
                }
            }
            ChunkKind::Replicated => {
                for member in &chunk.members {
                    let part = updated
                        .clone()
                        .slice(member.offset..member.offset + member.numel);
                    let shape = values
                        .get(&member.key)
                        .map_or_else(|| Shape::new([member.numel]), |v| v.shape());
                    let value = B::float_reshape(part.into_primitive().tensor(), shape);
                    stepped.insert(member.key, ZeroTensor::Local(value));
                }
            }
        }
    }
}

/// The row the gradient `parts` of `chunk`'s members (in order) are ranges of, when they are
/// exactly the members' ranges of one row of the chunk's shard length: the chunk's reduced row
/// as the reduction delivered it, stepped without joining its parts.
fn whole_row<H: Backend>(chunk: &Chunk, parts: &[Grad<H>]) -> Option<Tensor<H, 1>> {
    let Some(Grad::Part { row, row_id, .. }) = parts.first() else {
        return None;
    };
    let ranges = parts
        .iter()
        .map(|part| match part {
            Grad::Part {
                row_id: id, range, ..
            } if id == row_id => Some(range.clone()),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    chunk
        .is_tiled_by(row.dims()[0], ranges)
        .then(|| row.clone())
}

/// The gradient `parts` of a chunk's members (in order) joined end to end in f32: the pack
/// kernels copy up to 16 parts a launch where Burn's `cat` would launch a copy per part (a
/// replicated chunk's gradients come member by member, each a range of the bucket row it was
/// reduced in, in the order backward produced them).
fn join_parts<H: Backend>(parts: &[Grad<H>]) -> Result<Tensor<H, 1>, KernelError> {
    let tensors: Vec<Tensor<H, 1>> = parts.iter().map(Grad::tensor).collect();
    let device = tensors.first().map(Tensor::device).unwrap_or_default();
    let raw = tensors
        .into_iter()
        .map(|t| t.into_primitive().tensor())
        .collect();
    let joined = join::<H>(raw, DType::F32, &device, PackPath::Auto)?;
    Ok(Tensor::from_primitive(TensorPrimitive::Float(joined)))
}

/// Parameter `key`'s part of `chunk`, flat, as its master starts: its current shard (stage
/// 3), its own block of the replicated parameter (stages 1 and 2) or all of it (replicated
/// chunk).
fn part_of<B: Backend>(
    store: &ParamStore<B>,
    chunk: &Chunk,
    values: &HashMap<usize, ZeroTensor<B>>,
    key: usize,
) -> Tensor<B, 1> {
    match values.get(&key) {
        Some(ZeroTensor::Sharded(view)) => flat(view.param().shard().clone()),
        Some(ZeroTensor::Local(full)) if chunk.kind == ChunkKind::Sharded => {
            store.own_block(flat(full.clone()))
        }
        Some(ZeroTensor::Local(full)) => flat(full.clone()),
        None => panic!(
            "burn-zero: parameter #{key} of chunk #{} has no value",
            chunk.id
        ),
    }
}

/// The members' current sharded values of `chunk`, when it is a sharded chunk whose shards
/// live in host memory (parameter offload) and every member is held sharded.
fn host_members<'a, B: Backend>(
    store: &ParamStore<B>,
    chunk: &Chunk,
    values: &'a HashMap<usize, ZeroTensor<B>>,
) -> Option<Vec<&'a ShardedView<B>>> {
    if chunk.kind != ChunkKind::Sharded || !store.is_on_host(chunk.members[0].key) {
        return None;
    }
    chunk
        .members
        .iter()
        .map(|member| match values.get(&member.key) {
            Some(ZeroTensor::Sharded(view)) => Some(view),
            _ => None,
        })
        .collect()
}

/// Each member of an offloaded `chunk` with its part of the updated shard `data` (the chunk's
/// dtype, in host memory) as its new block, held there.
fn write_back_host<B: Backend>(
    chunk: &Chunk,
    data: &TensorData,
    views: Vec<&ShardedView<B>>,
    stepped: &mut ByKey<B>,
) {
    let ranges = chunk
        .members
        .iter()
        .map(|m| m.offset..m.offset + m.block_len);
    let parts = host_slices(data, ranges);
    for ((member, view), part) in chunk.members.iter().zip(views).zip(parts) {
        let param = view.param().with_host_shard(part);
        let value = ZeroTensor::Sharded(ShardedView::new(Arc::new(param)));
        stepped.insert(member.key, value);
    }
}
