//! `Block`: this rank's flat block of one sharded tensor, as owned memory, on the device or
//! (parameter offload) in host memory.
//!
//! The block is kept apart from [`crate::store::ShardedParam`] (the handle that knows shape,
//! version and store) so that the store can hold the live blocks of its parameters — to
//! release one for `reuse_fp16_shard`, or move it to the host for `offload_param_frac` —
//! without knowing the handles that point to it.
//!
//! The members of a chunk that an optimizer step has just written hold their blocks as ranges
//! of one [`SharedRow`], the chunk's new shard: the step writes one tensor, the next gather
//! reads it whole, and a member's block is cut out of it only when read alone. A cut costs a
//! copy launch on a cubecl device wherever the range does not start and end at the device's
//! memory alignment (512 bytes on CUDA); a chunk of many members would otherwise pay one
//! launch per member to be cut at the step and one more to be joined at its gather.

use std::ops::Range;
use std::sync::{Arc, RwLock};

use burn_zero_comm::RankCounters;
use burn_zero_comm::sync::{read, write};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use crate::memory::{MemoryKind, MemoryTracker};

/// A flat tensor on the device whose ranges are the blocks of several members: a chunk's
/// shard as an optimizer step wrote it.
#[derive(Debug)]
pub struct SharedRow<B: Backend> {
    values: B::FloatTensorPrimitive,
}

impl<B: Backend> SharedRow<B> {
    /// The row holding `values`, to be shared by the blocks of its ranges.
    pub fn new(values: B::FloatTensorPrimitive) -> Arc<Self> {
        Arc::new(Self { values })
    }

    /// The whole row (a handle clone, no copy).
    pub fn values(&self) -> B::FloatTensorPrimitive {
        self.values.clone()
    }

    /// Its length in elements.
    pub fn len(&self) -> usize {
        self.values.shape().num_elements()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a block's values are.
#[derive(Debug)]
enum Held<B: Backend> {
    /// On the model's device.
    Device(B::FloatTensorPrimitive),
    /// On the model's device: `range` of a row shared with other blocks, `bytes` of it.
    Part {
        row: Arc<SharedRow<B>>,
        range: Range<usize>,
        bytes: usize,
    },
    /// In host memory, uploaded to `device` whenever they are read (an all-gather's input).
    Host {
        data: TensorData,
        device: B::Device,
        /// The bytes counted for it.
        bytes: usize,
    },
}

/// A rank's block of a tensor, counted as `kind` in the rank's memory accounting while held
/// on the device, as its host counterpart ([`MemoryKind::HostParameterShards`],
/// [`MemoryKind::HostGradientShards`]) while held on the host.
#[derive(Debug)]
pub struct Block<B: Backend> {
    /// The parameter's key, for error messages.
    key: usize,
    dtype: DType,
    kind: MemoryKind,
    /// `None` once released for `reuse_fp16_shard` (the optimizer's fp32 master holds the
    /// values until the step writes a new block).
    values: RwLock<Option<Held<B>>>,
    memory: Arc<MemoryTracker>,
    /// The rank's counts: a move to the host is a host read, every upload a host write.
    counters: Arc<RankCounters>,
}

impl<B: Backend> Block<B> {
    /// Holds `values` (of parameter `key`, whose element type is `dtype`) as `kind`, counting
    /// its transfers between device and host in `counters`.
    pub(crate) fn new(
        key: usize,
        dtype: DType,
        kind: MemoryKind,
        values: B::FloatTensorPrimitive,
        memory: Arc<MemoryTracker>,
        counters: Arc<RankCounters>,
    ) -> Self {
        memory.add(kind, primitive_bytes(&values));
        Self {
            key,
            dtype,
            kind,
            values: RwLock::new(Some(Held::Device(values))),
            memory,
            counters,
        }
    }

    /// Holds `range` of `row` (of parameter `key`, whose element type is `dtype`, the row's) as
    /// `kind`, sharing the row with the blocks of its other ranges.
    pub(crate) fn part(
        key: usize,
        kind: MemoryKind,
        row: &Arc<SharedRow<B>>,
        range: Range<usize>,
        memory: Arc<MemoryTracker>,
        counters: Arc<RankCounters>,
    ) -> Self {
        assert!(
            range.end <= row.len(),
            "burn-zero: parameter #{key}: block {range:?} of a row of {} elements",
            row.len()
        );
        let dtype = row.values.dtype();
        let bytes = range.len() * dtype.size();
        memory.add(kind, bytes);
        Self {
            key,
            dtype,
            kind,
            values: RwLock::new(Some(Held::Part {
                row: row.clone(),
                range,
                bytes,
            })),
            memory,
            counters,
        }
    }

    /// Holds `data` (of parameter `key`, whose element type is `dtype`) in host memory, to be
    /// uploaded to `device` whenever it is read; counted as `kind`'s host counterpart.
    pub(crate) fn on_host(
        key: usize,
        dtype: DType,
        kind: MemoryKind,
        data: TensorData,
        device: B::Device,
        memory: Arc<MemoryTracker>,
        counters: Arc<RankCounters>,
    ) -> Self {
        let bytes = data.as_bytes().len();
        memory.add(host_kind(kind), bytes);
        Self {
            key,
            dtype,
            kind,
            values: RwLock::new(Some(Held::Host {
                data,
                device,
                bytes,
            })),
            memory,
            counters,
        }
    }

    /// The element type of the tensor the block belongs to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The block's values, on the device: uploaded from host memory when the block is
    /// offloaded (a new device tensor each time, freed when the caller drops it; counted as a
    /// host write).
    ///
    /// # Panics
    /// When the block was released after backward (`ZeroConfig::reuse_fp16_shard`) and no
    /// optimizer step has written a new one yet.
    pub fn values(&self) -> B::FloatTensorPrimitive {
        match &*read(&self.values) {
            Some(Held::Device(values)) => values.clone(),
            Some(Held::Part { row, range, .. }) => cut(row, range),
            Some(Held::Host { data, device, .. }) => {
                Self::upload(data.clone(), device, &self.counters)
            }
            None => panic!(
                "burn-zero: parameter #{} was released after backward (reuse_fp16_shard): its \
                 values live in the optimizer's fp32 master until the next optimizer step; step \
                 before the next forward",
                self.key
            ),
        }
    }

    /// Whether the block was released.
    pub fn is_released(&self) -> bool {
        read(&self.values).is_none()
    }

    /// Whether the block's values are in host memory (parameter offload).
    pub fn is_on_host(&self) -> bool {
        matches!(&*read(&self.values), Some(Held::Host { .. }))
    }

    /// The row this block is a range of, and the range, when it is one.
    pub fn row_part(&self) -> Option<(Arc<SharedRow<B>>, Range<usize>)> {
        match &*read(&self.values) {
            Some(Held::Part { row, range, .. }) => Some((row.clone(), range.clone())),
            _ => None,
        }
    }

    /// Moves the values to host memory (a device-to-host read, counted), where they stay until
    /// the block is dropped; every later read uploads them. Does nothing to a block already on
    /// the host or released.
    pub(crate) fn move_to_host(&self) {
        let mut held = write(&self.values);
        let values = match held.take() {
            Some(Held::Device(values)) => values,
            Some(Held::Part { row, range, .. }) => cut(&row, &range),
            elsewhere => {
                *held = elsewhere;
                return;
            }
        };
        let bytes = primitive_bytes(&values);
        let device = B::float_device(&values);
        let data = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(values)).into_data();
        self.counters.host_read(data.as_bytes().len());
        self.memory.sub(self.kind, bytes);
        self.memory.add(host_kind(self.kind), bytes);
        *held = Some(Held::Host {
            data,
            device,
            bytes,
        });
    }

    /// The values, when they are in host memory (a copy of the bytes, no device transfer).
    pub fn host_data(&self) -> Option<TensorData> {
        match &*read(&self.values) {
            Some(Held::Host { data, .. }) => Some(data.clone()),
            _ => None,
        }
    }

    /// Appends the values to `bytes` when they are in host memory (no device transfer), and
    /// returns their element type and count; `None`, with `bytes` untouched, when the block is
    /// on the device or released.
    pub(crate) fn append_host_bytes(&self, bytes: &mut Vec<u8>) -> Option<(DType, usize)> {
        match &*read(&self.values) {
            Some(Held::Host { data, .. }) => {
                bytes.extend_from_slice(data.as_bytes());
                Some((data.dtype, data.num_elements()))
            }
            _ => None,
        }
    }

    /// Uploads `data` from host memory to `device`, counting one host write in `counters`:
    /// every upload of host-held values goes through here.
    pub(crate) fn upload(
        data: TensorData,
        device: &B::Device,
        counters: &RankCounters,
    ) -> B::FloatTensorPrimitive {
        counters.host_write(data.as_bytes().len());
        B::float_from_data(data, device)
    }

    /// Moves values held in host memory back to the device (an upload, counted), where they
    /// stay. Does nothing to a block already on the device or released.
    pub(crate) fn move_to_device(&self) {
        let mut held = write(&self.values);
        let (data, device, bytes) = match held.take() {
            Some(Held::Host {
                data,
                device,
                bytes,
            }) => (data, device, bytes),
            elsewhere => {
                *held = elsewhere;
                return;
            }
        };
        self.memory.sub(host_kind(self.kind), bytes);
        self.memory.add(self.kind, bytes);
        *held = Some(Held::Device(Self::upload(data, &device, &self.counters)));
    }

    /// Frees the values: their memory is then the gradient shard's to use.
    pub(crate) fn release(&self) {
        let freed = write(&self.values).take();
        match freed {
            Some(Held::Device(values)) => self.memory.sub(self.kind, primitive_bytes(&values)),
            Some(Held::Part { bytes, .. }) => self.memory.sub(self.kind, bytes),
            Some(Held::Host { bytes, .. }) => self.memory.sub(host_kind(self.kind), bytes),
            None => {}
        }
    }
}

impl<B: Backend> Drop for Block<B> {
    fn drop(&mut self) {
        self.release();
    }
}

/// `range` of `row` as a tensor of its own: a view where the device allows one, else a copy.
fn cut<B: Backend>(row: &SharedRow<B>, range: &Range<usize>) -> B::FloatTensorPrimitive {
    if range.start == 0 && range.end == row.len() {
        return row.values();
    }
    B::float_slice(row.values(), &[burn::tensor::Slice::from(range.clone())])
}

/// How a block of `kind` counts while it is in host memory.
fn host_kind(kind: MemoryKind) -> MemoryKind {
    match kind {
        MemoryKind::GradientShards => MemoryKind::HostGradientShards,
        _ => MemoryKind::HostParameterShards,
    }
}

/// Each of `ranges` (in elements) of `data`, a flat tensor in host memory, as a flat tensor of
/// its own: the members' shards of a chunk's or bucket's shard read back in one transfer.
pub fn host_slices(
    data: &TensorData,
    ranges: impl IntoIterator<Item = std::ops::Range<usize>>,
) -> Vec<TensorData> {
    let (bytes, size) = (data.as_bytes(), data.dtype.size());
    ranges
        .into_iter()
        .map(|r| {
            let part = bytes[r.start * size..r.end * size].to_vec();
            TensorData::from_bytes_vec(part, [r.len()], data.dtype)
        })
        .collect()
}

/// Bytes of a tensor primitive's data.
pub(crate) fn primitive_bytes<P: TensorMetadata>(tensor: &P) -> usize {
    tensor.shape().num_elements() * tensor.dtype().size()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    fn block(values: &[f32]) -> (Block<Flex>, Arc<MemoryTracker>, Arc<RankCounters>) {
        let memory = Arc::new(MemoryTracker::default());
        let counters = Arc::new(RankCounters::default());
        let tensor = Tensor::<Flex, 1>::from_floats(values, &Default::default());
        let primitive = tensor.into_primitive().tensor();
        let kind = MemoryKind::ParameterShards;
        let block = Block::new(
            0,
            DType::F32,
            kind,
            primitive,
            memory.clone(),
            counters.clone(),
        );
        (block, memory, counters)
    }

    fn read(block: &Block<Flex>) -> Vec<f32> {
        let values = Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(block.values()));
        values.into_data().to_vec().unwrap()
    }

    /// Moving a block where it already is keeps its values and counts nothing; each real move
    /// shifts its bytes between the device and host kinds and counts one transfer of them.
    #[test]
    fn moves_keep_the_values_and_repeated_moves_do_nothing() {
        let (block, memory, counters) = block(&[1.0, 2.0, 3.0]);
        block.move_to_device();
        assert_eq!(read(&block), [1.0, 2.0, 3.0]);
        block.move_to_host();
        block.move_to_host();
        assert!(block.is_on_host());
        assert_eq!(memory.usage(MemoryKind::HostParameterShards).current, 12);
        assert_eq!(memory.usage(MemoryKind::ParameterShards).current, 0);
        assert_eq!(read(&block), [1.0, 2.0, 3.0]);
        block.move_to_device();
        block.move_to_device();
        assert!(!block.is_on_host());
        assert_eq!(read(&block), [1.0, 2.0, 3.0]);
        assert_eq!(memory.usage(MemoryKind::ParameterShards).current, 12);
        let counts = counters.snapshot();
        // One read to move it to the host; one upload for the read while there, one to move
        // it back.
        assert_eq!((counts.host_reads, counts.host_writes), (1, 2));
        // Each of them carries the block's 12 bytes.
        assert_eq!((counts.host_read_bytes, counts.host_write_bytes), (12, 24));
    }

    /// Blocks that are ranges of one row read as their ranges, count their own bytes, and let
    /// the row go only when the last of them is released or moved to the host.
    #[test]
    fn parts_of_a_row_read_and_count_their_ranges() {
        let memory = Arc::new(MemoryTracker::default());
        let counters = Arc::new(RankCounters::default());
        let values = Tensor::<Flex, 1>::from_floats([1.0, 2.0, 3.0, 4.0, 5.0], &Default::default());
        let row = SharedRow::<Flex>::new(values.into_primitive().tensor());
        let kind = MemoryKind::ParameterShards;
        let part = |range| Block::part(0, kind, &row, range, memory.clone(), counters.clone());
        let (first, second) = (part(0..2), part(2..5));
        assert_eq!(
            (read(&first), read(&second)),
            (vec![1.0, 2.0], vec![3.0, 4.0, 5.0])
        );
        assert_eq!(memory.usage(kind).current, 20);
        let (shared, range) = second.row_part().expect("a part of the row");
        assert!(Arc::ptr_eq(&shared, &row) && range == (2..5));
        drop(shared);
        assert_eq!(Arc::strong_count(&row), 3);
        first.move_to_host();
        assert!(first.row_part().is_none() && first.is_on_host());
        assert_eq!(read(&first), [1.0, 2.0]);
        assert_eq!(memory.usage(kind).current, 12);
        assert_eq!(counters.snapshot().host_read_bytes, 8);
        second.release();
        assert_eq!(memory.usage(kind).current, 0);
        assert_eq!(Arc::strong_count(&row), 1);
    }
}
