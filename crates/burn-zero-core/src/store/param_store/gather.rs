//! `ParamStore`'s gathers: a parameter's full tensor from every rank's block, from the cache,
//! a prefetch issued ahead, or an all-gather now; a parameter of a shared chunk with its whole
//! chunk; offloaded shards uploaded by the thread that gathers them.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Slice, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use burn_zero_comm::CommError;
use burn_zero_comm::sync::lock;
use burn_zero_kernels::{GatheredMember, PackPath, cut_gathered, join};

use super::ParamStore;
use crate::chunk::{Chunk, ChunkKind};
use crate::memory::MemoryKind;
use crate::store::block::Block;
use crate::store::prefetch::{GatherStats, InFlight};
use crate::store::upload::{ShardValues, Upload};

impl<B: Backend> ParamStore<B> {
    /// All-gathers every rank's block of a padded flat tensor and returns the full tensor of
    /// `shape` (padding cut off). A collective.
    pub fn all_gather_full(
        &self,
        block: Tensor<B, 1>,
        shape: &Shape,
    ) -> Result<B::FloatTensorPrimitive, CommError> {
        let full = self.comm().all_gather(block)?.into_primitive().tensor();
        Ok(full_tensor::<B>(full, shape))
    }

    /// The full tensor of `shape` whose block on this rank is `block` (parameter `key`, shard
    /// `version`): from the cache, from a prefetch, or all-gathered now (and cached if it
    /// fits). `parameter`: a module parameter's values, whose gathers follow the recorded
    /// order and may be prefetched (not a gradient, not a tensor outside the module).
    ///
    /// A parameter that shares a sharded chunk with others is gathered with its whole chunk:
    /// one all-gather for every member, each member then cut out of it and cached.
    pub(crate) fn gather(
        &self,
        key: usize,
        version: u64,
        block: &Block<B>,
        shape: &Shape,
        parameter: bool,
    ) -> B::FloatTensorPrimitive {
        if parameter {
            self.place_automatically(Some(key));
        }
        let prefetching = parameter && lock(&self.prefetch).depth() > 0;
        if prefetching {
            let dropped = lock(&self.prefetch).request(key);
            self.memory.sub(MemoryKind::Gathered, dropped);
        }
        let caching = self.config.max_live_gathered_bytes > 0;
        // The cache's lock is released before prefetching (an `if let` scrutinee's
        // temporaries live through its block).
        let hit = if caching {
            lock(&self.cache).get(version)
        } else {
            None
        };
        if let Some(hit) = hit {
            if prefetching {
                self.prefetch_ahead();
            }
            return hit;
        }
        let started = Instant::now();
        let ahead = if prefetching {
            lock(&self.prefetch).take(key, version)
        } else {
            None
        };
        let prefetched = ahead.is_some();
        let chunk = self.gathered_chunk(key, parameter);
        let gathered = match (ahead, chunk) {
            (Some(ahead), _) => {
                self.memory.sub(MemoryKind::Gathered, ahead.bytes);
                let members = ahead.members.clone();
                ahead.pending.wait().map(|raw| (raw, members))
            }
            (None, Some(chunk)) => self
                .chunk_shard(chunk, key, version, block, false)
                .and_then(|(shard, members)| {
                    self.comm()
                        .all_gather(shard.on_device())
                        .map(|raw| (raw, members))
                }),
            (None, None) => {
                let values = self.own_shard(key, version, block, parameter, false);
                self.comm()
                    .all_gather(values.on_device())
                    .map(|raw| (raw, vec![(key, version)]))
            }
        };
        let full = gathered
            .map(|(raw, members)| self.cut_out(raw, &members, key, shape, caching))
            .unwrap_or_else(|error| self.gather_failed(key, error));
        if parameter {
            let mut prefetch = lock(&self.prefetch);
            prefetch.stats.gathers += 1;
            prefetch.stats.prefetched += u64::from(prefetched);
            prefetch.stats.exposed += started.elapsed();
        }
        if prefetching {
            self.prefetch_ahead();
        }
        full
    }

    /// The sharded chunk parameter `key` is gathered with, when it shares one with others.
    fn gathered_chunk(&self, key: usize, parameter: bool) -> Option<&Chunk> {
        let (chunk, _) = self.chunks().place(key)?;
        (parameter && chunk.kind == ChunkKind::Sharded && chunk.members.len() > 1).then_some(chunk)
    }

    /// This rank's shard of `chunk`: its members' current blocks one after the other
    /// (`block` at `version` for member `key`), with each member's key and shard version.
    /// An offloaded chunk's blocks (all in host memory: placement moves whole chunks) are
    /// joined on the host and uploaded as one tensor, one transfer per gather; blocks on the
    /// device are joined there.
    #[allow(clippy::type_complexity)]
    fn chunk_shard(
        &self,
        chunk: &Chunk,
        key: usize,
        version: u64,
        block: &Block<B>,
        defer_upload: bool,
    ) -> Result<(ShardValues<B>, Vec<(usize, u64)>), CommError> {
        let live = lock(&self.live);
        // The other members' blocks (`None` stands for `block`), in chunk order.
        let mut others = Vec::with_capacity(chunk.members.len());
        let mut members = Vec::with_capacity(chunk.members.len());
        for member in &chunk.members {
            if member.key == key {
                members.push((key, version));
                others.push(None);
                continue;
            }
            let current = live.blocks.get(&member.key).and_then(|(block, version)| {
                Some((block.upgrade().filter(|b| !b.is_released())?, *version))
            });
            let Some((other, version)) = current else {
                return Err(CommError::InvalidGroup(format!(
                    "parameter #{} of the chunk being gathered has no values on this rank: \
                     it was released after backward (reuse_fp16_shard) and lives in the \
                     optimizer's fp32 master until the next optimizer step; step before the \
                     next forward",
                    member.key
                )));
            };
            members.push((member.key, version));
            others.push(Some(other));
        }
        let blocks: Vec<&Block<B>> = others
            .iter()
            .map(|o| o.as_deref().unwrap_or(block))
            .collect();
        if let Some(shard) = self.host_shard(chunk, &blocks, &members, defer_upload) {
            return Ok((shard, members));
        }
        if let Some(row) = whole_row(chunk, &blocks) {
            let row = Tensor::from_primitive(TensorPrimitive::Float(row));
            return Ok((ShardValues::Device(row), members));
        }
        // Blocks written apart (by sharding, or by steps of one parameter per call) are joined
        // by the pack kernels, up to 16 a launch.
        let parts = blocks.iter().map(|b| b.values()).collect();
        let shard =
            join::<B>(parts, chunk.dtype, self.device(), PackPath::Auto).unwrap_or_else(|error| {
                panic!(
                    "burn-zero: rank {} could not join chunk #{}'s blocks for its gather: {error}",
                    self.rank(),
                    chunk.id
                )
            });
        let shard = Tensor::from_primitive(TensorPrimitive::Float(shard));
        Ok((ShardValues::Device(shard), members))
    }

    /// A single-member gather's shard: parameter `key`'s `block` (at `version`), from the
    /// kept shards or uploaded when it is in host memory and a module `parameter` (left for
    /// the gathering thread to upload with `defer_upload`, see [`Self::host_shard`]).
    fn own_shard(
        &self,
        key: usize,
        version: u64,
        block: &Block<B>,
        parameter: bool,
        defer_upload: bool,
    ) -> ShardValues<B> {
        let chunk = (parameter && block.is_on_host())
            .then(|| self.chunks().place(key))
            .flatten();
        if let Some((chunk, _)) = chunk
            && let Some(shard) = self.host_shard(chunk, &[block], &[(key, version)], defer_upload)
        {
            return shard;
        }
        ShardValues::Device(Tensor::from_primitive(TensorPrimitive::Float(
            block.values(),
        )))
    }

    /// The shard of `chunk` whose `blocks` (of `members` at their versions) are all in host
    /// memory: the one kept on the device when it holds these versions, or else the joined
    /// host bytes to upload, offered to be kept. With `defer_upload` the upload is left to the
    /// thread that gathers them ([`crate::store::upload`]). `None` when a block is on the device.
    fn host_shard(
        &self,
        chunk: &Chunk,
        blocks: &[&Block<B>],
        members: &[(usize, u64)],
        defer_upload: bool,
    ) -> Option<ShardValues<B>> {
        if !blocks.iter().all(|block| block.is_on_host()) {
            return None;
        }
        let versions: Vec<u64> = members.iter().map(|&(_, version)| version).collect();
        if let Some(kept) = self.placement.kept(chunk, &versions) {
            return Some(ShardValues::Device(kept));
        }
        let data = host_bytes(blocks)?;
        let keep = self.placement.offer(chunk, versions);
        let upload = Upload::new(data, self.device.clone(), self.counters.clone(), keep);
        Some(if defer_upload {
            ShardValues::Host(upload)
        } else {
            ShardValues::Device(upload.run())
        })
    }

    /// Cuts every member out of an all-gather's result `raw` (one member, or a chunk of
    /// `members` at their shard versions), caches those that fit when `caching`, and returns
    /// parameter `key`'s full tensor of `shape`.
    fn cut_out(
        &self,
        raw: Tensor<B, 1>,
        members: &[(usize, u64)],
        key: usize,
        shape: &Shape,
        caching: bool,
    ) -> B::FloatTensorPrimitive {
        let raw = raw.into_primitive().tensor();
        let limit = self.config.max_live_gathered_bytes;
        if let [(_, version)] = members {
            let full = full_tensor::<B>(raw, shape);
            self.cache_gathered(*version, &full, shape, caching && limit > 0);
            return full;
        }
        let chunk = self
            .chunks()
            .place(key)
            .map(|(chunk, _)| chunk)
            .expect("a chunk gather is of a parameter in a chunk");
        let mut wanted = None;
        for ((member_key, full), &(_, version)) in
            self.members_of(chunk, raw).into_iter().zip(members)
        {
            let shape = full.shape();
            self.cache_gathered(version, &full, &shape, caching);
            if member_key == key {
                wanted = Some(full);
            }
        }
        wanted.expect("the requested parameter is a member of its chunk")
    }

    /// Every member of `chunk`, full, cut out of `raw`, the all-gather of the ranks' shards of
    /// it: each rank's shard is its members' blocks end to end, so a member is one block from
    /// each rank's row, its padding cut off. On cubecl backends the copies that joins take
    /// are batched, up to 16 members a launch; at one rank a member is a view of the row where
    /// the device's alignment allows.
    fn members_of(
        &self,
        chunk: &Chunk,
        raw: B::FloatTensorPrimitive,
    ) -> Vec<(usize, B::FloatTensorPrimitive)> {
        let Some(table) = self.table() else {
            return Vec::new();
        };
        let (keys, shapes, members): (Vec<usize>, Vec<Shape>, Vec<GatheredMember>) = chunk
            .members
            .iter()
            .filter_map(|member| {
                let shape = table.get(member.key)?.shape.clone();
                let cut = GatheredMember {
                    offset: member.offset,
                    block_len: member.block_len,
                    numel: shape.num_elements(),
                };
                Some((member.key, shape, cut))
            })
            .collect();
        let flats = cut_gathered::<B>(&raw, self.world_size(), &members, PackPath::Auto)
            .unwrap_or_else(|error| {
                panic!(
                    "burn-zero: rank {} could not cut chunk #{}'s members out of its gather: \
                     {error}",
                    self.rank(),
                    chunk.id
                )
            });
        (keys.into_iter().zip(shapes).zip(flats))
            .map(|((key, shape), flat)| (key, B::float_reshape(flat, shape)))
            .collect()
    }

    /// All-gathers this rank's `shard` of `chunk` (its members' blocks end to end) and returns
    /// every member's full tensor, by key, in member order: how the updated parameters of a
    /// chunk reach every rank at stages 1 and 2 with one collective. A collective.
    pub fn all_gather_chunk(
        &self,
        chunk: &Chunk,
        shard: Tensor<B, 1>,
    ) -> Result<Vec<(usize, B::FloatTensorPrimitive)>, CommError> {
        let raw = self.comm().all_gather(shard)?.into_primitive().tensor();
        Ok(self.members_of(chunk, raw))
    }

    /// Counts a gathered tensor's bytes and keeps it in the cache when caching and it fits.
    fn cache_gathered(
        &self,
        version: u64,
        full: &B::FloatTensorPrimitive,
        shape: &Shape,
        caching: bool,
    ) {
        let bytes = shape.num_elements() * full.dtype().size();
        self.memory.touch(MemoryKind::Gathered, bytes);
        if caching && bytes <= self.config.max_live_gathered_bytes {
            let evicted = lock(&self.cache).insert(version, full.clone(), bytes);
            self.memory.add(MemoryKind::Gathered, bytes);
            self.memory.sub(MemoryKind::Gathered, evicted);
        }
    }

    /// A gather that failed cannot return an error through Burn's op traits: the rank stops,
    /// naming the parameter.
    fn gather_failed(&self, key: usize, error: CommError) -> ! {
        let path = self
            .table()
            .and_then(|table| table.get(key))
            .map(|info| info.path.clone())
            .unwrap_or_default();
        panic!(
            "burn-zero: rank {} could not gather parameter #{key} `{path}`: {error}",
            self.rank(),
        )
    }

    /// Issues the gathers the recorded order asks for next, up to the prefetch depth, while
    /// the gathered and prefetched parameters fit in `max_live_gathered_bytes` (least
    /// recently used gathered parameters make room). A parameter in a shared chunk is
    /// prefetched with its chunk.
    fn prefetch_ahead(&self) {
        let Some(ordered) = &self.ordered else { return };
        let Some(table) = self.table() else { return };
        let limit = self.config.max_live_gathered_bytes;
        let mut prefetch = lock(&self.prefetch);
        let upcoming = {
            let cache = lock(&self.cache);
            let live = lock(&self.live);
            prefetch.upcoming(|key| {
                live.blocks
                    .get(&key)
                    .is_some_and(|(_, version)| cache.contains(*version))
            })
        };
        for key in upcoming {
            if prefetch.in_flight(key) {
                continue;
            }
            let current = lock(&self.live).blocks.get(&key).cloned();
            let (Some(info), Some((block, version))) = (table.get(key), current) else {
                break;
            };
            let Some(block) = block.upgrade().filter(|block| !block.is_released()) else {
                break;
            };
            // Whether it fits is known before its shard is looked up: a lookup uses a kept
            // shard or offers an upload to be kept, which a gather not issued must not do.
            let chunk = self.gathered_chunk(key, true);
            let bytes = match chunk {
                Some(chunk) => chunk.gathered_len(self.world_size()) * info.dtype.size(),
                None => info.shape.num_elements() * info.dtype.size(),
            };
            let inflight = prefetch.inflight_bytes();
            if inflight + bytes > limit {
                break;
            }
            let (values, members) = match chunk {
                Some(chunk) => match self.chunk_shard(chunk, key, version, &block, true) {
                    Ok(shard) => shard,
                    Err(_) => break,
                },
                None => {
                    let values = self.own_shard(key, version, &block, true, true);
                    (values, vec![(key, version)])
                }
            };
            let evicted = lock(&self.cache).shrink_to(limit - inflight - bytes);
            self.memory.sub(MemoryKind::Gathered, evicted);
            // A shard in host memory is uploaded by the issuing thread, on its stream, just
            // before the gather (see `store::upload`).
            let reservation = ordered.reserve();
            let pending = match values {
                ShardValues::Device(values) => reservation.all_gather_later(values),
                ShardValues::Host(upload) => {
                    reservation.all_gather_later_from(move || upload.run())
                }
            }
            .unwrap_or_else(|error| {
                panic!(
                    "burn-zero: rank {} could not prefetch parameter #{key} `{}`: {error}",
                    self.rank(),
                    info.path
                )
            });
            self.memory.add(MemoryKind::Gathered, bytes);
            prefetch.issued(InFlight {
                members,
                bytes,
                pending,
            });
        }
    }

    /// Ends a pass (the end of backward): its gather order is recorded if it is new, and
    /// prefetches it did not use are dropped.
    pub(crate) fn end_pass(&self) {
        self.place_automatically(None);
        let dropped = lock(&self.prefetch).end_pass();
        self.memory.sub(MemoryKind::Gathered, dropped);
    }

    /// Gathers and prefetches since the module was sharded.
    pub fn gather_stats(&self) -> GatherStats {
        lock(&self.prefetch).stats
    }

    /// Drops every cached gathered parameter.
    pub fn clear_gather_cache(&self) {
        let freed = lock(&self.cache).clear();
        self.memory.sub(MemoryKind::Gathered, freed);
    }

    /// Bytes of gathered parameters held in the cache now.
    pub fn gathered_bytes(&self) -> usize {
        lock(&self.cache).bytes()
    }
}

/// The full tensor of `shape` from the concatenated, padded blocks of an all-gather.
fn full_tensor<B: Backend>(
    gathered: B::FloatTensorPrimitive,
    shape: &Shape,
) -> B::FloatTensorPrimitive {
    B::float_reshape(
        B::float_slice(gathered, &[Slice::from(0..shape.num_elements())]),
        shape.clone(),
    )
}

/// `blocks` joined in host memory, when every one of them is there and they share a dtype.
fn host_bytes<B: Backend>(blocks: &[&Block<B>]) -> Option<TensorData> {
    let mut bytes = Vec::new();
    let (mut dtype, mut numel) = (None, 0);
    for block in blocks {
        let (block_dtype, len) = block.append_host_bytes(&mut bytes)?;
        if dtype.is_some_and(|d| d != block_dtype) {
            return None;
        }
        dtype = Some(block_dtype);
        numel += len;
    }
    Some(TensorData::from_bytes_vec(bytes, [numel], dtype?))
}

/// The row `blocks` (the members of `chunk`, in order) are ranges of, when they are exactly
/// its members' ranges of one row of the chunk's shard length: the shard an optimizer step
/// wrote, read whole without joining the blocks.
fn whole_row<B: Backend>(chunk: &Chunk, blocks: &[&Block<B>]) -> Option<B::FloatTensorPrimitive> {
    let parts: Vec<_> = blocks
        .iter()
        .map(|block| block.row_part())
        .collect::<Option<_>>()?;
    let (row, _) = parts.first()?;
    let one_row = parts.iter().all(|(other, _)| Arc::ptr_eq(row, other));
    let ranges = parts.iter().map(|(_, range)| range.clone());
    (one_row && chunk.is_tiled_by(row.len(), ranges)).then(|| row.values())
}
