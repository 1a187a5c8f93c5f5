//! Pack kernels: one launch writes every bucket element of a batch of members (their
//! `rows * len` elements each), up to 16 contiguous gradients of one dtype and vector width
//! ([`Batches`] says why). A strided gradient and a member without a gradient take a launch
//! each.

use burn::tensor::backend::Backend;
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use super::batch::{Batches, UnitRanges};
use super::{
    KernelPacker, address_type, from_cube, into_cube_reading, same_type_ref, storage_type,
    vector_size,
};
use crate::KernelError;
use crate::spec::{BucketSpec, MemberSpec};

/// Copies a batch of members' gradients into their columns of every row, one gradient each.
///
/// Unit `pos` (in vectors) belongs to member `i` when `starts[i] <= pos < ends[i]`, and is
/// element `pos - starts[i]` of that member's zero-padded flat gradient: row `/ len`, column
/// `offset + % len`. It casts to `O`, then divides in `O`. A gradient's view reads a strided
/// layout through its own indexing.
/// The members' ranges tile `0..units`; every unit tests each member's range (the batch is
/// small, and the kernel is bound by memory, not by these comparisons). With `one_row` (a
/// bucket of one rank row) the element's column is its position: no division.
#[cube(launch_unchecked, address_type = "dynamic")]
fn pack_members<I: Float, O: Float, N: Size>(
    grads: &Sequence<LinearView<Vector<I, N>>>,
    bucket: &mut LinearView<Vector<O, N>, ReadWrite>,
    divisor: InputScalar,
    starts: Sequence<usize>,
    ends: Sequence<usize>,
    numels: Sequence<usize>,
    lens: Sequence<usize>,
    offsets: Sequence<usize>,
    row_len: usize,
    units: usize,
    #[comptime] divide: bool,
    #[comptime] one_row: bool,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    if ABSOLUTE_POS >= units {
        terminate!();
    }
    let count = comptime![grads.len()];
    #[unroll]
    for i in 0..count {
        let start = starts[i];
        if ABSOLUTE_POS >= start && ABSOLUTE_POS < ends[i] {
            let local = ABSOLUTE_POS - start;
            let len = lens[i];
            let offset = offsets[i];
            let mut row = 0;
            let mut column = local;
            if !one_row {
                row = local / len;
                column = local % len;
            }
            let mut value = Vector::<O, N>::from_int(0);
            if local < numels[i] {
                value = Vector::cast_from(grads[i][local]);
                if divide {
                    value /= Vector::new(divisor.get::<O>());
                }
            }
            bucket[row * row_len + offset + column] = value;
        }
    }
}

/// Zero-fills a member's columns of every row (a member without a gradient).
#[cube(launch_unchecked, address_type = "dynamic")]
fn zero_member<O: Float, N: Size>(
    bucket: &mut LinearView<Vector<O, N>, ReadWrite>,
    len: usize,
    row_len: usize,
    offset: usize,
    units: usize,
    #[define(O)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= units {
        terminate!();
    }
    let row = ABSOLUTE_POS / len;
    let column = ABSOLUTE_POS % len;
    bucket[row * row_len + offset + column] = Vector::from_int(0);
}

/// What the members of one pack launch share: the gradients' dtype and the vector width.
type Key = (StorageType, usize);

/// A bucket allocated once on a cubecl device, filled by batches of members.
pub(crate) struct CubePacker<R: CubeRuntime> {
    spec: BucketSpec,
    out: StorageType,
    bucket: CubeTensor<R>,
    /// Contiguous gradients waiting for their launch.
    batches: Batches<Key, (MemberSpec, CubeTensor<R>)>,
}

impl<R: CubeRuntime> CubePacker<R> {
    /// Allocates the bucket (uninitialised: the members will cover it). Fails when the
    /// device cannot compute in `spec.dtype`.
    pub(crate) fn new<B: Backend>(
        spec: &BucketSpec,
        device: &B::Device,
    ) -> Result<Self, KernelError> {
        let device: &R::Device =
            same_type_ref(device).expect("the kernel path is only taken when B's device is R's");
        let client = R::client(device);
        let out = storage_type(&client, spec.dtype)?;
        // The bucket and the scalars take a binding each.
        let batches = Batches::new(&client, 2);
        let bucket = empty_device_dtype(
            client,
            device.clone(),
            Shape::new([spec.numel()]),
            spec.dtype,
        );
        Ok(Self {
            spec: *spec,
            out,
            bucket,
            batches,
        })
    }

    fn launch_zero(&self, member: &MemberSpec) {
        let client = &self.bucket.client;
        let spec = &self.spec;
        let elem = spec.dtype.size();
        let vector = vector_size(client, elem, &[member.len, member.offset, spec.row_len]);
        let units = spec.rows * member.len / vector;
        let cube_dim = CubeDim::new(client, units);
        // SAFETY: every unit below `units` writes one vector of the member's columns of a row,
        // inside the bucket (the member's range was checked against the row when it was pushed).
        unsafe {
            zero_member::launch_unchecked::<R>(
                client,
                calculate_cube_count_elemwise(client, units, cube_dim),
                cube_dim,
                address_type(&[&self.bucket]),
                vector,
                self.bucket.clone().into_linear_view(),
                member.len / vector,
                spec.row_len / vector,
                member.offset / vector,
                units,
                self.out,
            )
        };
    }

    /// Packs `grad` into `member`'s columns: a contiguous gradient joins the batch of its dtype
    /// and vector width (launched once full, or at the finish), any other layout is launched
    /// at once, read element by element through the view's strided indexing.
    fn pack(&mut self, member: &MemberSpec, grad: CubeTensor<R>) -> Result<(), KernelError> {
        let client = self.bucket.client.clone();
        let input = storage_type(&client, grad.dtype)?;
        if !grad.is_contiguous() {
            self.launch((input, 1), vec![(*member, grad)]);
            return Ok(());
        }
        let flat = CubeTensor::new_contiguous(
            grad.client.clone(),
            grad.device.clone(),
            Shape::new([member.numel]),
            grad.handle.clone(),
            grad.dtype,
        );
        let elem = grad.dtype.size().max(self.spec.dtype.size());
        let widths = [member.numel, member.len, member.offset, self.spec.row_len];
        let vector = vector_size(&client, elem, &widths);
        if let Some((key, full)) = self.batches.push((input, vector), (*member, flat)) {
            self.launch(key, full);
        }
        Ok(())
    }

    /// Packs `members` in one [`pack_members`] launch, `vector` elements a unit.
    fn launch(&self, (input, vector): Key, members: Vec<(MemberSpec, CubeTensor<R>)>) {
        let client = &self.bucket.client;
        let spec = &self.spec;
        let mut tensors: Vec<&CubeTensor<R>> = members.iter().map(|(_, grad)| grad).collect();
        tensors.push(&self.bucket);
        let address = address_type(&tensors);
        let ranges = UnitRanges::<R>::new(
            members.iter().map(|(m, _)| (m.offset, spec.rows * m.len)),
            vector,
        );
        let mut grads = SequenceArg::new();
        let [mut numels, mut lens] = std::array::from_fn(|_| SequenceArg::<R, usize>::new());
        for (member, grad) in members {
            numels.push(member.numel / vector);
            lens.push(member.len / vector);
            grads.push(grad.into_linear_view());
        }
        let UnitRanges {
            starts,
            ends,
            offsets,
            units,
        } = ranges;
        let cube_dim = CubeDim::new(client, units);
        // SAFETY: every unit below `units` falls in one member's range; it reads its gradient only
        // below that gradient's length and writes inside the member's columns of the bucket, all
        // checked against the bucket when the members were pushed.
        unsafe {
            pack_members::launch_unchecked::<R>(
                client,
                calculate_cube_count_elemwise(client, units, cube_dim),
                cube_dim,
                address,
                vector,
                grads,
                self.bucket.clone().into_linear_view(),
                InputScalar::new(spec.predivide, spec.dtype),
                starts,
                ends,
                numels,
                lens,
                offsets,
                spec.row_len / vector,
                units,
                spec.predivide != 1.0,
                spec.rows == 1,
                [input, self.out],
            )
        };
    }
}

impl<B: Backend, R: CubeRuntime> KernelPacker<B> for CubePacker<R> {
    fn push(
        &mut self,
        member: &MemberSpec,
        grad: Option<B::FloatTensorPrimitive>,
    ) -> Result<(), KernelError> {
        if self.spec.rows * member.len == 0 {
            return Ok(());
        }
        match grad {
            None => {
                self.launch_zero(member);
                Ok(())
            }
            Some(grad) => {
                // A dtype the kernel cannot read is cast by Burn first: cast-then-divide, as
                // the fallback does.
                let grad = if storage_type(&self.bucket.client, grad.dtype()).is_err() {
                    B::float_cast(grad, self.spec.dtype.into())
                } else {
                    grad
                };
                self.pack(member, into_cube_reading::<B, R>(grad))
            }
        }
    }

    fn finish(mut self: Box<Self>) -> B::FloatTensorPrimitive {
        for (key, members) in self.batches.take() {
            self.launch(key, members);
        }
        from_cube::<B, R>(self.bucket)
    }
}
