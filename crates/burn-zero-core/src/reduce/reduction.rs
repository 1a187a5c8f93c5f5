//! One bucket's reduction: pack, collective (and, with hybrid sharding, the sum across
//! replica groups), unpack, or read the shards back to host memory for an optimizer that
//! steps there. The layout it reduces by is `bucket`'s.
//!
//! Packing casts to the reduce dtype and divides by `gradient_predivide_factor` before the
//! collective; unpacking divides by the rest of the number of ranks and casts back. With
//! hybrid sharding the collective runs inside the shard group and its result is all-reduced
//! across the replica group before unpacking, so the division by the number of ranks happens
//! once, after both sums. Both run in `burn-zero-kernels` (cubecl kernels on cubecl backends,
//! loops over host memory on CPU backends, Burn ops elsewhere). Each bucket keeps a buffer
//! pool, so on CPU backends every step packs into the memory of the step before.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_zero_comm::{CommError, Communicator, DataOp, Issued, RankCounters, ReduceOp};
use burn_zero_kernels::{
    BucketSpec, BufferPool, KernelError, MemberSpec, PackPath, Packer, RowPart, peaks_watched,
    unpack_row,
};

use crate::memory::{MemoryKind, MemoryTracker};
use crate::reduce::bucket::{Bucket, Member, Mode};
use crate::store::host_gradients::HostGradients;
use crate::store::host_slices;

/// What reducing a bucket needs: the communicators and device of the thread that reduces, the
/// predivide factor and the rank's memory accounting.
pub(crate) struct Reduction<'a, B: Backend> {
    /// The shard group: the bucket's collective.
    pub comm: &'a dyn Communicator<B>,
    /// With hybrid sharding, the replica group: the shard group's result is all-reduced across
    /// it, so that the sum covers every rank of the job.
    pub replicas: Option<&'a dyn Communicator<B>>,
    pub device: &'a B::Device,
    pub predivide: f64,
    pub memory: &'a MemoryTracker,
    /// Which of this rank's gradient shards go to host memory as they are reduced (an
    /// optimizer that steps there asked for them), and the counts that transfer is counted in.
    pub to_host: &'a HostGradients,
    pub counters: &'a RankCounters,
    /// Called once the collective has returned, while the gradients the bucket was packed from
    /// are still held: the most device memory the reduction holds at once. The training
    /// thread's reductions read the device here during the auto placement's warm-up.
    pub at_peak: Option<&'a dyn Fn()>,
}

/// A reduced bucket's gradients: each member's flat gradient on the device, or (shards for an
/// optimizer that steps on the host) each member's shard in host memory, read back in one
/// transfer for the whole bucket.
pub(crate) enum Values<B: Backend> {
    Device(Vec<B::FloatTensorPrimitive>),
    /// A sharded chunk's reduced row, divided and cast as a whole: each member's shard is its
    /// range of it (the chunk's layout), so the optimizer steps the chunk's row as it is.
    Row(B::FloatTensorPrimitive),
    Host(Vec<TensorData>),
}

/// Why a bucket could not be reduced.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ReduceError {
    /// The collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Packing or unpacking failed (a layout or dtype the pack path cannot handle).
    #[error("gradient bucket pack/unpack: {0}")]
    Kernel(#[from] KernelError),
}

/// Reduces one bucket: `grads[i]` is member `i`'s full gradient on this rank (`None`: this
/// rank has none; zeros stand in). Returns each member's reduced gradient, flat: this rank's
/// block (reduce-scatter) or the whole mean (all-reduce); with `ctx.to_host`, a reduce-scatter
/// bucket whose members share a dtype is read back to host memory in one transfer, here, on
/// the thread that reduces (during backward with overlap).
///
/// Packing and unpacking go through `burn-zero-kernels`: cubecl kernels on cubecl backends
/// built in (a launch per batch of up to 16 members of one dtype and vector width, each way),
/// one loop over host memory per member on CPU backends, Burn ops elsewhere, with the same
/// arithmetic either way.
pub(crate) fn reduce<B: Backend>(
    ctx: &Reduction<'_, B>,
    bucket: &Bucket,
    grads: Vec<Option<B::FloatTensorPrimitive>>,
) -> Result<Values<B>, ReduceError> {
    let (issued, held) = issue(ctx, bucket, grads)?;
    complete(ctx, bucket, issued.wait()?, held)
}

/// The gradients a bucket was packed from, held while its collective may still read the
/// packed bucket ([`issue`] says why).
pub(crate) struct Held<B: Backend> {
    _grads: Vec<B::FloatTensorPrimitive>,
}

/// Packs `grads` into `bucket` (see [`reduce`]) and issues its collective on the shard group
/// without waiting for it: the collective, perhaps still running on the device, with the
/// gradients to hold until it has finished. [`complete`] takes the result once it has.
pub(crate) fn issue<B: Backend>(
    ctx: &Reduction<'_, B>,
    bucket: &Bucket,
    grads: Vec<Option<B::FloatTensorPrimitive>>,
) -> Result<(Issued<B>, Held<B>), ReduceError> {
    // The gradients stay held until the collective has read the packed bucket. With overlap
    // they were written on the training thread and are packed here, on the issuing thread:
    // on cubecl backends that is another stream, and a buffer of the training thread's stream
    // dropped here while the pack kernels still wait in this stream's queue goes back to its
    // pool at once, where the training thread's next tensor can take it and be written before
    // the pack has read it (measured: wrong gradients in about one run in six at 4 ranks on
    // wgpu). The collective runs after the pack kernels have finished, so once it has finished
    // the gradients have been read. A handle clone, no copy.
    let held = Held {
        _grads: grads.iter().flatten().cloned().collect(),
    };
    let packed = pack(ctx, bucket, grads)?;
    if ctx.comm.world_size() == 1 && ctx.replicas.is_none() && peaks_watched() {
        finish_alone(ctx)?;
    }
    let op = match bucket.mode {
        Mode::ReduceScatter => DataOp::ReduceScatter(ReduceOp::Sum),
        Mode::AllReduce => DataOp::AllReduce(ReduceOp::Sum),
    };
    Ok((ctx.comm.issue(op, packed)?, held))
}

/// The rest of a bucket's reduction once its collective has finished with `reduced`: with
/// hybrid sharding the sum across the replica groups, then the unpack (or the read-back to
/// host memory).
pub(crate) fn complete<B: Backend>(
    ctx: &Reduction<'_, B>,
    bucket: &Bucket,
    reduced: Tensor<B, 1>,
    held: Held<B>,
) -> Result<Values<B>, ReduceError> {
    if let Some(at_peak) = ctx.at_peak {
        at_peak();
    }
    drop(held);
    let world_size = ctx.comm.world_size();
    // Hybrid sharding: each shard group has summed its own ranks; the groups' sums of this
    // rank's block are added across the groups, in group order.
    let (reduced, ranks) = match ctx.replicas {
        Some(replicas) => (
            replicas.all_reduce(reduced, ReduceOp::Sum)?,
            world_size * replicas.world_size(),
        ),
        None => (reduced, world_size),
    };
    // The rest of the mean over all `ranks`:
    // sum / ranks = (sum of grad / predivide) / (ranks / predivide).
    let postdivide = ranks as f64 / ctx.predivide;
    unpack(ctx, bucket, reduced.into_primitive().tensor(), postdivide)
}

/// `grads` packed into `bucket`'s layout in the reduce dtype, divided by the predivide factor
/// (zeros where a member has no gradient), counted in the memory accounting.
fn pack<B: Backend>(
    ctx: &Reduction<'_, B>,
    bucket: &Bucket,
    grads: Vec<Option<B::FloatTensorPrimitive>>,
) -> Result<Tensor<B, 1>, ReduceError> {
    let world_size = ctx.comm.world_size();
    let rows = match bucket.mode {
        Mode::ReduceScatter => world_size,
        Mode::AllReduce => 1,
    };
    let spec = BucketSpec {
        rows,
        row_len: bucket.len,
        dtype: bucket.reduce_dtype,
        predivide: ctx.predivide,
    };
    let mut packer = Packer::<B>::with_pool(spec, ctx.device, PackPath::Auto, &bucket.pool)?;
    for (member, grad) in bucket.members.iter().zip(grads) {
        let slot = MemberSpec {
            numel: member.shape.num_elements(),
            len: member.len,
            offset: member.offset,
        };
        packer.push(&slot, grad)?;
    }
    let packed = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(packer.finish()?));
    ctx.memory
        .touch(MemoryKind::Buckets, bucket.bytes(world_size));
    Ok(packed)
}

/// A rank alone, while a sampler watches the device's memory ([`peaks_watched`]): the
/// collective is answered in place, with no synchronisation of its own, and the packed bucket
/// is finished on the device here so that a reading of the device's memory from another
/// thread sees the reduction's peak. cubecl counts a buffer in use from the call that
/// allocates it until its handle drops, whether or not the device has run anything, so
/// without a wait the packed bucket and the gradients it was packed from are both counted
/// only for the instant between the pack's submission and the gradients' release: a sampler
/// every few milliseconds missed it in most runs on lavapipe (32 MiB read for 48 in
/// `param_offload_wgpu`). Without a sampler nobody reads that instant from another thread:
/// the auto placement's warm-up reads it on this thread (`at_peak`, while the gradients are
/// still held), so training waits for the device here only while it is measured.
fn finish_alone<B: Backend>(ctx: &Reduction<'_, B>) -> Result<(), ReduceError> {
    B::sync(ctx.device).map_err(|error| {
        ReduceError::Comm(CommError::Device {
            rank: 0,
            reason: format!("could not finish a gradient bucket: {error}"),
        })
    })?;
    ctx.counters.sync();
    Ok(())
}

/// This rank's `reduced` row of `bucket`, divided by `postdivide` and cast back: read to host
/// memory in one transfer (shards an optimizer steps on the host), one row for a sharded
/// chunk, or member by member.
fn unpack<B: Backend>(
    ctx: &Reduction<'_, B>,
    bucket: &Bucket,
    reduced: B::FloatTensorPrimitive,
    postdivide: f64,
) -> Result<Values<B>, ReduceError> {
    if let Some(dtype) = host_read_dtype(ctx.to_host, bucket) {
        let shards = read_to_host::<B>(ctx, bucket, reduced, postdivide, dtype)?;
        return Ok(Values::Host(shards));
    }
    // A sharded chunk's row is unpacked as one part, with the same arithmetic element by
    // element: one launch at most, where its members would take one per batch of parts
    // here and a copy each to be joined again for the step.
    if bucket.mode == Mode::ReduceScatter
        && bucket.regroup.is_none()
        && let Some(dtype) = shared_dtype(&bucket.members)
    {
        let row = unpack_whole::<B>(bucket, reduced, postdivide, dtype, Some(&bucket.pool))?;
        return Ok(Values::Row(row));
    }
    let parts: Vec<RowPart> = bucket
        .members
        .iter()
        .map(|member| RowPart {
            offset: member.offset,
            len: member.len,
            dtype: member.dtype,
        })
        .collect();
    Ok(Values::Device(unpack_row::<B>(
        reduced,
        &parts,
        postdivide,
        PackPath::Auto,
        Some(&bucket.pool),
    )?))
}

/// The dtype `bucket`'s reduced row is read back to host memory in where it is unpacked (every
/// member's shard goes to an optimizer that steps on the host, and all share one dtype), or
/// `None` when it is handed over on the device.
pub(crate) fn host_read_dtype(to_host: &HostGradients, bucket: &Bucket) -> Option<DType> {
    if bucket.mode == Mode::ReduceScatter && to_host.of_all(bucket.members.iter().map(|m| m.key)) {
        shared_dtype(&bucket.members)
    } else {
        None
    }
}

/// The dtype every member has, if they share one.
fn shared_dtype(members: &[Member]) -> Option<DType> {
    let dtype = members.first()?.dtype;
    members.iter().all(|m| m.dtype == dtype).then_some(dtype)
}

/// This rank's reduced row of `bucket` as one part: divided by `postdivide` and cast to
/// `dtype` with the arithmetic each member's part would get, element by element (into a buffer
/// of `pool` where the host path can).
fn unpack_whole<B: Backend>(
    bucket: &Bucket,
    reduced: B::FloatTensorPrimitive,
    postdivide: f64,
    dtype: DType,
    pool: Option<&BufferPool>,
) -> Result<B::FloatTensorPrimitive, ReduceError> {
    let whole = RowPart {
        offset: 0,
        len: bucket.len,
        dtype,
    };
    let mut row = unpack_row::<B>(reduced, &[whole], postdivide, PackPath::Auto, pool)?;
    Ok(row.pop().expect("one part asked for"))
}

/// This rank's reduced row, unpacked as one part (the same division and cast, element by
/// element, as member by member), read back to host memory once and cut into the members'
/// shards there.
fn read_to_host<B: Backend>(
    ctx: &Reduction<'_, B>,
    bucket: &Bucket,
    reduced: B::FloatTensorPrimitive,
    postdivide: f64,
    dtype: DType,
) -> Result<Vec<TensorData>, ReduceError> {
    let row = unpack_whole::<B>(bucket, reduced, postdivide, dtype, None)?;
    let data = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(row)).into_data();
    ctx.counters.host_read(data.as_bytes().len());
    let ranges = bucket.members.iter().map(|m| m.offset..m.offset + m.len);
    Ok(host_slices(&data, ranges))
}
