//! Cut kernels: one launch copies a batch of members out of an all-gathered chunk, each into a
//! tensor of its own ([`Batches`] says why batches); a member shifted against the vector grid
//! takes the shifted kernel (`shifted.rs`).

use burn::tensor::backend::Backend;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::std::tensor::layout::linear::LinearView;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

use crate::KernelError;
use crate::spec::GatheredMember;

use super::batch::{Batches, UnitRanges};
use super::shifted::{Grid, moves_shifted, rounded_up, trimmed};
use super::{address_type, from_cube, into_cube_reading, storage_type, vector_size};

/// `output[k] = gathered[(k / block) * row + offset + k % block]` for a batch of members, each
/// into an output of its own. Unit `pos` (in vectors) belongs to member `i` when
/// `starts[i] <= pos < ends[i]`, and is element `pos - starts[i]` of its output.
#[cube(launch_unchecked, address_type = "dynamic")]
fn cut_members<E: Numeric, N: Size>(
    gathered: &LinearView<Vector<E, N>>,
    outputs: &mut Sequence<LinearView<Vector<E, N>, ReadWrite>>,
    starts: Sequence<usize>,
    ends: Sequence<usize>,
    offsets: Sequence<usize>,
    blocks: Sequence<usize>,
    row: usize,
    units: usize,
    #[define(E)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= units {
        terminate!();
    }
    let count = comptime![outputs.len()];
    #[unroll]
    for i in 0..count {
        let start = starts[i];
        if ABSOLUTE_POS >= start && ABSOLUTE_POS < ends[i] {
            let local = ABSOLUTE_POS - start;
            let block = blocks[i];
            let at = (local / block) * row + offsets[i] + local % block;
            let output = outputs.index_mut(i);
            output[local] = gathered[at];
        }
    }
}

/// [`cut_members`] for members at any offset and of any block length: unit `pos` copies the
/// `N` elements `(pos - starts[i]) * N + k` of member `i` (those below `numels[i]`) one by one
/// from its blocks (`offsets` and `blocks` in elements, rows of `row` elements) and writes them
/// as one vector of its output, which holds whole vectors (`shifted.rs`).
#[cube(launch_unchecked, address_type = "dynamic")]
fn cut_shifted<E: Numeric, N: Size>(
    gathered: &LinearView<E>,
    outputs: &mut Sequence<LinearView<Vector<E, N>, ReadWrite>>,
    starts: Sequence<usize>,
    ends: Sequence<usize>,
    offsets: Sequence<usize>,
    blocks: Sequence<usize>,
    numels: Sequence<usize>,
    row: usize,
    units: usize,
    #[define(E)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= units {
        terminate!();
    }
    let count = comptime![outputs.len()];
    let width = N::value();
    #[unroll]
    for i in 0..count {
        let start = starts[i];
        if ABSOLUTE_POS >= start && ABSOLUTE_POS < ends[i] {
            let local = ABSOLUTE_POS - start;
            let first = local * width;
            let block = blocks[i];
            let offset = offsets[i];
            let numel = numels[i];
            let mut value = Vector::<E, N>::empty();
            #[unroll]
            for k in 0..width {
                let element = first + k;
                let mut lane = E::from_int(0);
                if element < numel {
                    lane = gathered[(element / block) * row + offset + element % block];
                }
                value[k] = lane;
            }
            let output = outputs.index_mut(i);
            output[local] = value;
        }
    }
}

/// What the members of one cut launch share: the vector width and how they meet the grid.
type Key = (usize, Grid);

/// A member waiting for its launch: its index, where it lies, and its output.
type Waiting<R> = (usize, GatheredMember, CubeTensor<R>);

/// Cuts every member of `gathered` on runtime `R`: at one rank, a member whose range starts
/// and ends at the device's memory alignment is a view of the row; every other member is
/// copied by batched launches (up to 16 members of one vector width each).
pub(super) fn cut<B: Backend, R: CubeRuntime>(
    gathered: &B::FloatTensorPrimitive,
    ranks: usize,
    members: &[GatheredMember],
) -> Result<Vec<B::FloatTensorPrimitive>, KernelError> {
    let tensor: CubeTensor<R> = into_cube_reading::<B, R>(gathered.clone());
    let client = tensor.client.clone();
    let dtype = storage_type(&client, tensor.dtype)?;
    let size = tensor.dtype.size();
    let len = tensor.meta.shape()[0];
    let row = len / ranks;
    let alignment = client.properties().memory.alignment as usize;
    let contiguous = tensor.is_contiguous();
    // The gathered row and the scalars take a binding each.
    let mut batches: Batches<Key, Waiting<R>> = Batches::new(&client, 2);
    // The widest vector the client likes (no length to divide).
    let widest = vector_size(&client, size, &[]);
    let mut cut: Vec<Option<B::FloatTensorPrimitive>> = members.iter().map(|_| None).collect();
    let mut copies: Vec<Option<CubeTensor<R>>> = members.iter().map(|_| None).collect();
    for (index, member) in members.iter().enumerate() {
        let (start, end) = (
            member.offset * size,
            (len - member.offset - member.numel) * size,
        );
        let view = ranks == 1 && start % alignment == 0 && end % alignment == 0;
        if view || member.numel == 0 {
            cut[index] = Some(crate::fallback::cut_member::<B>(
                gathered.clone(),
                ranks,
                member,
            ));
            continue;
        }
        let widths: &[usize] = if contiguous {
            &[member.offset, member.block_len, member.numel, row]
        } else {
            &[1]
        };
        let aligned = vector_size(&client, size, widths);
        let key = if contiguous && moves_shifted(aligned, widest, member.numel) {
            (widest, Grid::Shifted)
        } else {
            (aligned, Grid::Aligned)
        };
        let output = rounded_up(&client, &tensor.device, member.numel, key.0, tensor.dtype);
        if let Some((key, full)) = batches.push(key, (index, *member, output)) {
            launch(&tensor, dtype, row, key, full, &mut copies);
        }
    }
    for (key, waiting) in batches.take() {
        launch(&tensor, dtype, row, key, waiting, &mut copies);
    }
    Ok(cut
        .into_iter()
        .zip(copies)
        .map(|(view, copy)| {
            view.or_else(|| copy.map(from_cube::<B, R>))
                .expect("every member is a view or a copy")
        })
        .collect())
}

/// Copies `members` out of `gathered` (rows of `row` elements) in one [`cut_members`] or
/// [`cut_shifted`] launch, `vector` elements a unit, and puts each output in its member's place
/// of `copies`.
fn launch<R: CubeRuntime>(
    gathered: &CubeTensor<R>,
    dtype: StorageType,
    row: usize,
    (vector, grid): Key,
    members: Vec<Waiting<R>>,
    copies: &mut [Option<CubeTensor<R>>],
) {
    let client = &gathered.client;
    let mut tensors: Vec<&CubeTensor<R>> = members.iter().map(|(.., output)| output).collect();
    tensors.push(gathered);
    let address = address_type(&tensors);
    let places = members.iter().map(|(_, m, _)| (m.offset, m.numel));
    let UnitRanges {
        starts,
        ends,
        offsets,
        units,
    } = UnitRanges::<R>::new(places, vector, grid);
    // The outputs' views, collected into the sequence type of the kernel they go to.
    let outputs = || {
        members
            .iter()
            .map(|(.., output)| output.clone().into_linear_view())
    };
    let mut blocks = SequenceArg::<R, usize>::new();
    let mut numels = SequenceArg::<R, usize>::new();
    for (_, member, _) in &members {
        match grid {
            Grid::Aligned => blocks.push(member.block_len / vector),
            Grid::Shifted => blocks.push(member.block_len),
        }
        numels.push(member.numel);
    }
    let cube_dim = CubeDim::new(client, units);
    let cube_count = calculate_cube_count_elemwise(client, units, cube_dim);
    match grid {
        // SAFETY: every unit below `units` falls in one member's range; it reads inside that
        // member's blocks of the gathered rows and writes below the member's length, both
        // checked before the launch.
        Grid::Aligned => unsafe {
            cut_members::launch_unchecked::<R>(
                client,
                cube_count,
                cube_dim,
                address,
                vector,
                gathered.clone().into_linear_view(),
                outputs().collect(),
                starts,
                ends,
                offsets,
                blocks,
                row / vector,
                units,
                dtype,
            )
        },
        // SAFETY: as above; a unit reads only the member's elements below its length, and
        // writes one vector of its output, which was rounded up to whole vectors.
        Grid::Shifted => unsafe {
            cut_shifted::launch_unchecked::<R>(
                client,
                cube_count,
                cube_dim,
                address,
                vector,
                gathered.clone().into_linear_view(),
                outputs().collect(),
                starts,
                ends,
                offsets,
                blocks,
                numels,
                row,
                units,
                dtype,
            )
        },
    };
    for (index, member, output) in members {
        copies[index] = Some(trimmed(output, member.numel));
    }
}
