//! [`ShardPlacement`]: where each parameter shard of one rank lives, and the auto placement
//! that decides it while training runs.
//!
//! With static fractions the answer is fixed once the chunk layout is known: the first
//! `offload_param_frac` of the sharded chunks' bytes live on the host. With the auto placement
//! every shard starts on the host for the warm-up; the readings it takes at each parameter
//! gather and at the end of each pass (`auto_placement`) decide which chunks move to the
//! device for good, and from then on the host shards that stay are kept on the device between
//! uses period by period (`residency`). The parameter store asks this module where a shard
//! lives and tells it when a gather or a pass begins; it never reaches into its state.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_zero_comm::sync::{lock, read, write};
use burn_zero_kernels::{DeviceMemorySampler, device_memory};

use crate::chunk::placement::{
    device_chunks, host_chunks, largest_shard_bytes, member_keys, shard_bytes,
};
use crate::chunk::{Chunk, ChunkKind, ChunkLayout};
use crate::memory::{AutoPlacementReport, KeptShardStats, MemoryKind, MemoryTracker};
use crate::placement::{Capacity, Placement};
use crate::store::auto_placement::{AutoPlacement, CapacityExceeded, SAMPLE_EVERY};
use crate::store::kept_shard::KeptShard;
use crate::store::residency::Residency;

/// Where one rank's parameter shards live: on the device or in host memory, by parameter key.
pub(crate) struct ShardPlacement<B: Backend> {
    /// The share of the sharded chunks' bytes placed on the host (static fractions).
    offload_param_frac: f64,
    /// The parameters whose shards live in host memory; `None` until the chunk layout is set.
    host_keys: RwLock<Option<HashSet<usize>>>,
    /// The auto placement (`Placement::auto`), when configured.
    auto: Option<Mutex<AutoPlacement>>,
    /// The host shards the auto placement keeps on the device between uses, once it decided.
    residency: Mutex<Option<Residency<KeptShard<B>>>>,
    /// The device whose memory the auto placement reads.
    device: B::Device,
    /// The rank, for messages.
    rank: usize,
    /// The rank's memory accounting: kept shards count as parameter shards.
    memory: Arc<MemoryTracker>,
}

impl<B: Backend> ShardPlacement<B> {
    /// The placement of `placement`'s parameter part, on rank `rank`'s `device`. An auto
    /// placement must have its capacity in MiB by now (`shard` reads the device's).
    pub(crate) fn new(
        placement: &Placement,
        device: B::Device,
        rank: usize,
        memory: Arc<MemoryTracker>,
    ) -> Self {
        let auto = match placement.auto {
            Some(Capacity::MiB(capacity)) => Some(Mutex::new(AutoPlacement::new(capacity))),
            Some(Capacity::Device) | None => None,
        };
        Self {
            offload_param_frac: placement.offload_param_frac,
            host_keys: RwLock::new(None),
            auto,
            residency: Mutex::new(None),
            device,
            rank,
            memory,
        }
    }

    /// Whether sharding puts each new parameter shard in host memory at once, before the
    /// chunk layout says where it lives: whenever parameters may be offloaded
    /// (`offload_param_frac` above 0, or the auto placement, whose warm-up starts with every
    /// shard on the host). The device then holds one parameter at a time while a module is
    /// sharded, not the whole model, so that a model larger than the device can be sharded
    /// from lazily initialised parameters; the chunks that stay on the device are uploaded
    /// once the layout is known.
    pub(crate) fn stages_shards_on_host(&self) -> bool {
        self.auto.is_some() || self.offload_param_frac > 0.0
    }

    /// Places the chunks of `chunks`: those `offload_param_frac` puts on the host (all of
    /// them for the auto placement's warm-up) live there from now on.
    pub(crate) fn lay_out(&self, chunks: &ChunkLayout) {
        let frac = match self.auto {
            Some(_) => 1.0,
            None => self.offload_param_frac,
        };
        *write(&self.host_keys) = Some(member_keys(chunks, &host_chunks(chunks, frac)));
    }

    /// Whether parameter `key`'s shard lives in host memory; until the chunk layout is set,
    /// whether shards are staged there.
    pub(crate) fn is_on_host(&self, key: usize) -> bool {
        match &*read(&self.host_keys) {
            Some(keys) => keys.contains(&key),
            None => self.stages_shards_on_host(),
        }
    }

    /// What the auto placement measured and decided (`None` without it, or before its
    /// warm-up has ended).
    pub(crate) fn report(&self) -> Option<AutoPlacementReport> {
        lock(self.auto.as_ref()?).report()
    }

    /// What the host shards kept on the device between uses did (`None` without the auto
    /// placement, or before it decided).
    pub(crate) fn kept_shards(&self) -> Option<KeptShardStats> {
        lock(&self.residency).as_ref().map(Residency::stats)
    }

    /// `bytes` of the device room the auto placement measured now hold something else for
    /// good: the kept shards plan for that much less in every period.
    pub(crate) fn take_device_room(&self, bytes: u64) {
        if let Some(residency) = lock(&self.residency).as_mut() {
            let freed = residency.take(bytes);
            self.memory.sub(MemoryKind::ParameterShards, freed as usize);
        }
    }

    /// The auto placement's part at a gather of parameter `gathered_key` or (`None`) at the end
    /// of a pass: a reading of the device's memory during the warm-up, and at the first gather
    /// after it, the decision, whose chunks `to_device` moves (given their members' keys); from
    /// then on, the kept shards follow the periods.
    ///
    /// # Panics
    /// When a warm-up reading is above the capacity ([`CapacityExceeded`]).
    pub(crate) fn at_gather(
        &self,
        gathered_key: Option<usize>,
        chunks: &ChunkLayout,
        to_device: impl FnOnce(&HashSet<usize>),
    ) {
        let Some(auto) = &self.auto else { return };
        // Periods are told apart by the chunk they gather.
        let gathered =
            gathered_key.map(|key| chunks.place(key).map_or(usize::MAX, |(chunk, _)| chunk.id));
        let mut auto = lock(auto);
        if auto.warming_up() {
            self.read_warmup(&mut auto, gathered);
            let Some(room) = auto.room().filter(|_| gathered.is_some()) else {
                return;
            };
            self.decide(&mut auto, chunks, room, to_device);
        }
        drop(auto);
        if let Some(residency) = lock(&self.residency).as_mut() {
            let freed = match gathered {
                Some(chunk) => residency.gathering(chunk),
                None => residency.end_pass(),
            };
            self.memory.sub(MemoryKind::ParameterShards, freed as usize);
        }
    }

    /// A warm-up reading at a period's boundary: the device's bytes in use now and the most
    /// the sampler saw since the last boundary.
    fn read_warmup(&self, auto: &mut AutoPlacement, gathered: Option<usize>) {
        auto.keep_sampling(|| {
            DeviceMemorySampler::start_unwatched::<B>(&self.device, SAMPLE_EVERY)
        });
        let now = device_memory::<B>(&self.device).map(|now| now.in_use);
        let reading = [now, auto.sampled()].into_iter().flatten().max();
        if let Some(reading) = reading {
            self.refuse_over_capacity(auto.observe(reading));
            auto.boundary(reading, gathered);
        }
        if gathered.is_none() {
            auto.end_pass();
        }
    }

    /// During the auto placement's warm-up, a reading of the device's bytes in use inside the
    /// current period (backward hands over a gradient): on a GPU a period is shorter than the
    /// sampler's interval, and this is where a layer's gradient and activations are alive
    /// together.
    ///
    /// # Panics
    /// When the reading is above the capacity ([`CapacityExceeded`]).
    pub(crate) fn read_within_period(&self) {
        let Some(auto) = &self.auto else { return };
        let mut auto = lock(auto);
        if !auto.warming_up() {
            return;
        }
        if let Some(now) = device_memory::<B>(&self.device) {
            self.refuse_over_capacity(auto.within(now.in_use));
        }
    }

    /// Panics with a warm-up reading above the capacity, naming the rank.
    fn refuse_over_capacity(&self, reading: Result<(), CapacityExceeded>) {
        if let Err(error) = reading {
            panic!("burn-zero: rank {}: {error}", self.rank);
        }
    }

    /// The auto placement's decision once its warm-up is over: the chunks whose shards fit in
    /// `room`, less the largest chunk's shard for the step (see
    /// [`AutoPlacementReport::step_bytes`]), move to the device for good (`to_device`), and
    /// the others' shards are kept between uses by the recorded periods.
    fn decide(
        &self,
        auto: &mut AutoPlacement,
        chunks: &ChunkLayout,
        room: u64,
        to_device: impl FnOnce(&HashSet<usize>),
    ) {
        let step = largest_shard_bytes(chunks) as u64;
        let room = room.saturating_sub(step);
        let ids = device_chunks(chunks, room as usize);
        let keys = member_keys(chunks, &ids);
        if let Some(host) = write(&self.host_keys).as_mut() {
            host.retain(|key| !keys.contains(key));
        }
        to_device(&keys);
        let host = chunks.count(ChunkKind::Sharded) - ids.len();
        let bytes = ids
            .iter()
            .map(|&id| shard_bytes(&chunks.chunks()[id]) as u64)
            .sum();
        let residency = auto
            .recorded()
            .filter(|pass| !pass.order.is_empty() && host > 0)
            .map(|pass| {
                let planned = auto.planned().saturating_sub(step);
                Residency::new(pass.order.clone(), &pass.needs, planned, bytes)
            });
        let periods = residency
            .as_ref()
            .map_or((0, 0), |r| (r.periods(), r.most_room()));
        let report = auto.decide((room, step), (ids.len(), bytes), host, periods);
        *lock(&self.residency) = residency;
        tracing::info!(rank = self.rank, ?report, "parameter shards placed");
    }

    /// The device copy kept of host-resident `chunk`'s shard, when it holds the values of
    /// `versions` and its upload has run. A copy whose upload never ran is forgotten here (see
    /// [`KeptShard`]).
    pub(crate) fn kept(&self, chunk: &Chunk, versions: &[u64]) -> Option<Tensor<B, 1>> {
        let mut residency = lock(&self.residency);
        let (kept, freed) = residency
            .as_mut()?
            .get(chunk.id, versions, KeptShard::values);
        self.memory.sub(MemoryKind::ParameterShards, freed as usize);
        kept.map(|values| Tensor::from_primitive(TensorPrimitive::Float(values)))
    }

    /// Offers the upload about to be made of host-resident `chunk`'s shard (its members at
    /// `versions`) to be kept on the device: the slot the upload fills, when the placement keeps
    /// it. Decided now, on the thread that asks for the gather, so that what is kept follows
    /// that thread's order whichever thread uploads.
    pub(crate) fn offer(&self, chunk: &Chunk, versions: Vec<u64>) -> Option<KeptShard<B>> {
        let mut residency = lock(&self.residency);
        let residency = residency.as_mut()?;
        let bytes = shard_bytes(chunk) as u64;
        let slot = KeptShard::pending();
        let (kept, freed) = residency.offer(chunk.id, versions, slot.clone(), bytes);
        self.memory.sub(MemoryKind::ParameterShards, freed as usize);
        if kept {
            self.memory.add(MemoryKind::ParameterShards, bytes as usize);
        }
        kept.then_some(slot)
    }

    /// Drops the device copy kept of `chunk`'s shard: a member's values changed.
    pub(crate) fn forget_kept(&self, chunk: usize) {
        if let Some(residency) = lock(&self.residency).as_mut() {
            let freed = residency.forget(chunk);
            self.memory.sub(MemoryKind::ParameterShards, freed as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use burn::backend::Flex;
    use burn::tensor::{DType, TensorData};
    use burn_zero_comm::RankCounters;

    use super::*;
    use crate::store::upload::Upload;

    /// A placement that keeps shards, in the first period of a pass gathering chunk 0, then 1,
    /// then 0, with room for one shard of four f32s (16 bytes) in every period.
    fn keeping() -> (ShardPlacement<Flex>, Arc<MemoryTracker>) {
        let memory = Arc::new(MemoryTracker::default());
        let placement =
            ShardPlacement::new(&Placement::device(), Default::default(), 0, memory.clone());
        let mut residency = Residency::new(vec![0, 1, 0], &[0; 4], 16, 0);
        residency.gathering(0);
        *lock(&placement.residency) = Some(residency);
        (placement, memory)
    }

    fn chunk(id: usize) -> Chunk {
        Chunk {
            id,
            kind: ChunkKind::Sharded,
            dtype: DType::F32,
            trainable: true,
            members: Vec::new(),
            shard_len: 4,
        }
    }

    fn shard_bytes_held(memory: &MemoryTracker) -> u64 {
        memory.usage(MemoryKind::ParameterShards).current
    }

    #[test]
    fn a_kept_shard_is_what_its_upload_made_on_another_thread_and_one_never_made_is_forgotten() {
        let (placement, memory) = keeping();
        let counters = Arc::new(RankCounters::default());
        let chunk = chunk(0);
        let values = vec![1.0f32, -2.5, 3.0, 0.125];

        // Kept when offered: its bytes count at once. Its upload never runs (the gather was
        // dropped): the next gather finds nothing to use, and the bytes are freed.
        let never = placement
            .offer(&chunk, vec![7])
            .expect("room for the shard");
        assert_eq!(shard_bytes_held(&memory), 16);
        assert!(placement.kept(&chunk, &[7]).is_none());
        assert_eq!(shard_bytes_held(&memory), 0);
        drop(never);

        // Offered again, and uploaded by another thread (as a prefetch's is, by the issuing
        // thread): the next gather of these versions uses that upload, without another.
        let slot = placement
            .offer(&chunk, vec![7])
            .expect("room for the shard");
        let upload = Upload::<Flex>::new(
            TensorData::new(values.clone(), [4]),
            Default::default(),
            counters.clone(),
            Some(slot),
        );
        let gathered = thread::spawn(move || upload.run().into_data())
            .join()
            .unwrap();
        assert_eq!(gathered.to_vec::<f32>().unwrap(), values);
        let kept = placement
            .kept(&chunk, &[7])
            .expect("the uploaded shard is kept");
        assert_eq!(kept.into_data().to_vec::<f32>().unwrap(), values);
        assert_eq!(counters.snapshot().host_writes, 1);
        assert_eq!(shard_bytes_held(&memory), 16);
        // Newer values than the kept ones: not used.
        assert!(placement.kept(&chunk, &[8]).is_none());
        let stats = placement.kept_shards().expect("the placement keeps shards");
        assert_eq!((stats.kept, stats.kept_uses), (2, 1), "{stats:?}");
    }
}
