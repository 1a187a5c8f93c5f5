//! `cut_gathered`: every member of an all-gathered chunk as a flat tensor of its own.
//!
//! A chunk's shard on each rank is its members' blocks end to end, so after the all-gather a
//! member's values are one block from each rank's row. With more than one rank they are not
//! contiguous and each member needs a copy; the kernel path copies up to 16 members a launch
//! instead of one, as the pack and unpack kernels do. At one rank each member is a range of
//! the row: a view where the device's memory alignment allows, so no launch at all.

use burn::tensor::TensorMetadata;
use burn::tensor::backend::Backend;

use crate::KernelError;
use crate::fallback::cut_member;
use crate::spec::{GatheredMember, PackPath, is_float};

/// Every member of `gathered` (1-D: `ranks` equal rows, each a rank's shard of the chunk), flat,
/// `numel` elements each, in the order given, bit for bit the gathered values.
///
/// `PackPath::Kernel` asks for the kernels and fails without them; `Auto` takes them on a
/// cubecl backend and Burn's slices elsewhere; `Fallback` and `Host` take Burn's slices.
pub fn cut_gathered<B: Backend>(
    gathered: &B::FloatTensorPrimitive,
    ranks: usize,
    members: &[GatheredMember],
    path: PackPath,
) -> Result<Vec<B::FloatTensorPrimitive>, KernelError> {
    let shape = gathered.shape();
    if shape.num_dims() != 1 {
        return Err(KernelError::NotFlat {
            rank: shape.num_dims(),
        });
    }
    let dtype = gathered.dtype();
    if !is_float(dtype) {
        return Err(KernelError::UnsupportedDType { dtype, path: "any" });
    }
    let len = shape[0];
    for member in members {
        let fits = ranks > 0
            && len.is_multiple_of(ranks)
            && member.offset.saturating_add(member.block_len) <= len / ranks
            && member.numel <= ranks.saturating_mul(member.block_len);
        if !fits {
            return Err(KernelError::NotGathered {
                len,
                ranks,
                offset: member.offset,
                block_len: member.block_len,
                numel: member.numel,
            });
        }
    }
    if matches!(path, PackPath::Auto | PackPath::Kernel) {
        match kernel_cut::<B>(gathered, ranks, members) {
            Some(result) if path == PackPath::Kernel || result.is_ok() => return result,
            None if path == PackPath::Kernel => {
                return Err(KernelError::KernelUnavailable {
                    backend: B::name(&B::float_device(gathered)),
                });
            }
            _ => {}
        }
    }
    Ok(members
        .iter()
        .map(|member| cut_member::<B>(gathered.clone(), ranks, member))
        .collect())
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_cut<B: Backend>(
    gathered: &B::FloatTensorPrimitive,
    ranks: usize,
    members: &[GatheredMember],
) -> Option<Result<Vec<B::FloatTensorPrimitive>, KernelError>> {
    crate::kernel::cut_gathered::<B>(gathered, ranks, members)
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn kernel_cut<B: Backend>(
    _gathered: &B::FloatTensorPrimitive,
    _ranks: usize,
    _members: &[GatheredMember],
) -> Option<Result<Vec<B::FloatTensorPrimitive>, KernelError>> {
    None
}
