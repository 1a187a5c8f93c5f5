//! Pack kernels: one launch writes every bucket element of a batch of members (their
//! `rows * len` elements each), up to 16 contiguous gradients of one dtype and vector width
//! ([`Batches`] says why); a member shifted against the vector grid takes the shifted kernel
//! (`shifted.rs`). A strided gradient and a member without a gradient take a launch each.

use burn::tensor::backend::Backend;
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::AddressType;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use super::batch::{Batches, UnitRanges};
use super::shifted::{Grid, moves_shifted, trimmed};
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

/// [`pack_members`] for members at any offset and of any length: every unit writes one whole
/// vector of the bucket, reading its gradients element by element.
///
/// Member `i` touches `counts[i]` vectors of each row, from vector `firsts[i]` of the row on;
/// unit `pos` is its vector `(pos - starts[i]) % counts[i]` of row `/ counts[i]` (rows of
/// `row_len` elements, a whole number of vectors). A vector inside the member's columns is
/// filled from its gradient alone. A vector at one of its ends also holds elements of the
/// member before or after it: that vector is read, the elements of every member of this
/// launch are replaced, the rest (members of other launches, the bucket's rounding) kept, and
/// it is written back by one unit only, the unit of the first member of the launch found in
/// it, so two units of a launch never write one vector. Launches on one stream run one after
/// another, so what a launch keeps is what an earlier one wrote, or what a later one will
/// write. Each element is cast and divided as [`pack_members`] does.
#[cube(launch_unchecked, address_type = "dynamic")]
fn pack_shifted<I: Float, O: Float, N: Size>(
    grads: &Sequence<LinearView<I>>,
    bucket: &mut LinearView<Vector<O, N>, ReadWrite>,
    divisor: InputScalar,
    starts: Sequence<usize>,
    ends: Sequence<usize>,
    firsts: Sequence<usize>,
    counts: Sequence<usize>,
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
    let width = N::value();
    let by = divisor.get::<O>();
    // A vector at a member's end, left for the loop over every member below.
    let mut end = false;
    // The member of that vector's unit, by its first unit (a runtime value).
    let mut owner = 0usize;
    let mut end_row = 0usize;
    let mut end_column = 0usize;
    #[unroll]
    for i in 0..count {
        let start = starts[i];
        if ABSOLUTE_POS >= start && ABSOLUTE_POS < ends[i] {
            let local = ABSOLUTE_POS - start;
            let mut row = 0;
            let mut step = local;
            if !one_row {
                row = local / counts[i];
                step = local % counts[i];
            }
            // The column of the vector's first element.
            let column = (firsts[i] + step) * width;
            let offset = offsets[i];
            let len = lens[i];
            if column >= offset && column + width <= offset + len {
                let from = row * len + column - offset;
                let mut value = Vector::<O, N>::empty();
                #[unroll]
                for k in 0..width {
                    value[k] = packed::<I, O>(grads.index(i), from + k, numels[i], by, divide);
                }
                bucket[(row * row_len + column) / width] = value;
            } else {
                end = true;
                owner = start;
                end_row = row;
                end_column = column;
            }
        }
    }
    if end {
        let at = (end_row * row_len + end_column) / width;
        let mut value = bucket[at];
        let mut found = false;
        let mut first = 0usize;
        #[unroll]
        for k in 0..width {
            let column = end_column + k;
            #[unroll]
            for j in 0..count {
                let offset = offsets[j];
                if column >= offset && column < offset + lens[j] {
                    if !found {
                        found = true;
                        first = starts[j];
                    }
                    let from = end_row * lens[j] + column - offset;
                    value[k] = packed::<I, O>(grads.index(j), from, numels[j], by, divide);
                }
            }
        }
        if first == owner {
            bucket[at] = value;
        }
    }
}

/// Element `from` of a gradient of `numel` elements as [`pack_members`] packs it: cast to `O`,
/// then divided by `by` where `divide`; zero past the gradient (the member's padding).
#[cube]
fn packed<I: Float, O: Float>(
    grad: &LinearView<I>,
    from: usize,
    numel: usize,
    by: O,
    #[comptime] divide: bool,
) -> O {
    let mut lane = O::from_int(0);
    if from < numel {
        lane = O::cast_from(grad[from]);
        if divide {
            lane /= by;
        }
    }
    lane
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

/// What the members of one pack launch share: the gradients' dtype, the vector width and how
/// they meet the vector grid.
type Key = (StorageType, usize, Grid);

/// A bucket allocated once on a cubecl device, filled by batches of members.
pub(crate) struct CubePacker<R: CubeRuntime> {
    spec: BucketSpec,
    out: StorageType,
    bucket: CubeTensor<R>,
    /// Contiguous gradients waiting for their launch.
    batches: Batches<Key, (MemberSpec, CubeTensor<R>)>,
}

impl<R: CubeRuntime> CubePacker<R> {
    /// Allocates the bucket (uninitialised: the members will cover it), rounded up to whole
    /// vectors of the widest width for the shifted kernel's last vector. Fails when the device
    /// cannot compute in `spec.dtype`.
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
        let rounded = spec
            .numel()
            .next_multiple_of(vector_size(&client, spec.dtype.size(), &[]));
        let bucket = empty_device_dtype(client, device.clone(), Shape::new([rounded]), spec.dtype);
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
        let widths = [member.len, member.offset, self.row_len_width()];
        let vector = vector_size(client, elem, &widths);
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

    /// What the row length asks of a vector width: nothing in a bucket of one row (every
    /// element's column is its place), to divide it otherwise.
    fn row_len_width(&self) -> usize {
        match self.spec.rows {
            1 => 0,
            _ => self.spec.row_len,
        }
    }

    /// Packs `grad` into `member`'s columns: a contiguous gradient joins the batch of its dtype,
    /// vector width and grid (launched once full, or at the finish), any other layout is
    /// launched at once, read element by element through the view's strided indexing.
    fn pack(&mut self, member: &MemberSpec, grad: CubeTensor<R>) -> Result<(), KernelError> {
        let client = self.bucket.client.clone();
        let input = storage_type(&client, grad.dtype)?;
        if !grad.is_contiguous() {
            self.launch((input, 1, Grid::Aligned), vec![(*member, grad)]);
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
        let row = self.row_len_width();
        let aligned = vector_size(
            &client,
            elem,
            &[member.numel, member.len, member.offset, row],
        );
        // The shifted kernel's vectors need only tile the rows.
        let shifted = vector_size(&client, elem, &[row]);
        let key = if moves_shifted(aligned, shifted, member.len) {
            (input, shifted, Grid::Shifted)
        } else {
            (input, aligned, Grid::Aligned)
        };
        if let Some((key, full)) = self.batches.push(key, (*member, flat)) {
            self.launch(key, full);
        }
        Ok(())
    }

    /// Packs `members` in one [`pack_members`] or [`pack_shifted`] launch, `vector` elements
    /// a unit.
    fn launch(&self, (input, vector, grid): Key, members: Vec<(MemberSpec, CubeTensor<R>)>) {
        let mut tensors: Vec<&CubeTensor<R>> = members.iter().map(|(_, grad)| grad).collect();
        tensors.push(&self.bucket);
        let address = address_type(&tensors);
        match grid {
            Grid::Aligned => self.launch_aligned(input, vector, address, members),
            Grid::Shifted => self.launch_shifted(input, vector, address, members),
        }
    }

    fn launch_aligned(
        &self,
        input: StorageType,
        vector: usize,
        address: AddressType,
        members: Vec<(MemberSpec, CubeTensor<R>)>,
    ) {
        let client = &self.bucket.client;
        let spec = &self.spec;
        let ranges = UnitRanges::<R>::new(
            members.iter().map(|(m, _)| (m.offset, spec.rows * m.len)),
            vector,
            Grid::Aligned,
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

    fn launch_shifted(
        &self,
        input: StorageType,
        vector: usize,
        address: AddressType,
        members: Vec<(MemberSpec, CubeTensor<R>)>,
    ) {
        let client = &self.bucket.client;
        let spec = &self.spec;
        let mut grads = SequenceArg::new();
        let [
            mut starts,
            mut ends,
            mut firsts,
            mut counts,
            mut numels,
            mut lens,
            mut offsets,
        ] = std::array::from_fn(|_| SequenceArg::<R, usize>::new());
        let mut units = 0;
        for (member, grad) in members {
            // The vectors of a row the member's columns touch, its ends included.
            let first = member.offset / vector;
            let count = (member.offset + member.len).div_ceil(vector) - first;
            starts.push(units);
            units += spec.rows * count;
            ends.push(units);
            firsts.push(first);
            counts.push(count);
            numels.push(member.numel);
            lens.push(member.len);
            offsets.push(member.offset);
            grads.push(grad.into_linear_view());
        }
        let cube_dim = CubeDim::new(client, units);
        // SAFETY: every unit below `units` falls in one member's range and writes one vector of
        // the bucket touching that member's columns of its row: rows are whole vectors (one
        // row, or a row length the width divides) and the bucket was rounded up to whole
        // vectors. It reads gradients only below their lengths. Two units of the launch never
        // write one vector (see the kernel).
        unsafe {
            pack_shifted::launch_unchecked::<R>(
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
                firsts,
                counts,
                numels,
                lens,
                offsets,
                spec.row_len,
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
        let numel = self.spec.numel();
        from_cube::<B, R>(trimmed(self.bucket, numel))
    }
}
