//! The static layout of a bucket, of its members and of a reduced row's parts, and which
//! implementation to use.

use burn::tensor::DType;

use crate::KernelError;

/// Layout of one bucket: `rows` rank rows of `row_len` elements each, in `dtype` (the reduce
/// dtype). Gradients are divided by `predivide` after the cast.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketSpec {
    pub rows: usize,
    pub row_len: usize,
    pub dtype: DType,
    pub predivide: f64,
}

/// One member: its gradient has `numel` elements (`numel <= rows * len`) and it occupies
/// `[offset, offset + len)` of every row. Element `i` of the gradient, zero-padded to
/// `rows * len`, goes to row `i / len`, column `offset + i % len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberSpec {
    pub numel: usize,
    pub len: usize,
    pub offset: usize,
}

/// Which implementation packs and unpacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PackPath {
    /// The kernel where the backend has one and supports the dtypes, host memory on CPU
    /// backends (Flex, NdArray) for the dtypes they store, Burn ops otherwise.
    #[default]
    Auto,
    /// The cubecl kernel; an error on backends without one.
    Kernel,
    /// Loops over host memory, on Flex and NdArray; an error on other backends.
    Host,
    /// Burn tensor ops, on every backend.
    Fallback,
}

impl BucketSpec {
    /// Elements in the whole bucket (all rows).
    pub fn numel(&self) -> usize {
        self.rows * self.row_len
    }

    /// Checks the sizes, divisor and dtype.
    pub fn validate(&self) -> Result<(), KernelError> {
        if self.rows == 0 || self.row_len == 0 {
            return Err(KernelError::EmptyBucket {
                rows: self.rows,
                row_len: self.row_len,
            });
        }
        check_divisor(self.predivide)?;
        if !is_float(self.dtype) {
            return Err(KernelError::UnsupportedDType {
                dtype: self.dtype,
                path: "any",
            });
        }
        Ok(())
    }

    /// Checks that `member` fits this bucket and starts at `cursor`, the end of the previous
    /// member.
    pub(crate) fn check_member(
        &self,
        member: &MemberSpec,
        cursor: usize,
    ) -> Result<(), KernelError> {
        if member.numel > self.rows * member.len {
            return Err(KernelError::MemberTooLarge {
                numel: member.numel,
                rows: self.rows,
                len: member.len,
            });
        }
        check_range(member.offset, member.len, self.row_len)?;
        if member.offset != cursor {
            return Err(KernelError::OutOfOrder {
                offset: member.offset,
                expected: cursor,
            });
        }
        Ok(())
    }
}

/// Whether `dtype` is a floating-point type.
pub(crate) fn is_float(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F64 | DType::F32 | DType::Flex32 | DType::F16 | DType::BF16
    )
}

pub(crate) fn check_divisor(divisor: f64) -> Result<(), KernelError> {
    if divisor.is_finite() && divisor > 0.0 {
        Ok(())
    } else {
        Err(KernelError::InvalidDivisor { divisor })
    }
}

pub(crate) fn check_range(offset: usize, len: usize, row_len: usize) -> Result<(), KernelError> {
    match offset.checked_add(len) {
        Some(end) if end <= row_len => Ok(()),
        _ => Err(KernelError::OutOfRow {
            offset,
            len,
            row_len,
        }),
    }
}

/// One member's part of a reduced row: where it lies and the dtype it goes back to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowPart {
    /// First element of the part in the row.
    pub offset: usize,
    /// Elements of the part.
    pub len: usize,
    /// The dtype the part is cast back to.
    pub dtype: DType,
}

/// One member of an all-gathered chunk (every rank's shard of it, end to end): a block of
/// `block_len` elements at `offset` in each rank's row, whose first `numel` elements, read rank
/// after rank, are the member's values (the rest is padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatheredMember {
    /// First element of the member's block in each rank's row.
    pub offset: usize,
    /// Elements of its block in each row.
    pub block_len: usize,
    /// Elements of the member.
    pub numel: usize,
}

/// Whether a part of `len` elements, read from a row of dtype `from` into `to`, is the row's
/// plain slice: no divisor, no cast (or nothing to read).
pub(crate) fn is_slice(len: usize, postdivide: f64, from: DType, to: DType) -> bool {
    len == 0 || (postdivide == 1.0 && from == to)
}

/// How the pieces an all-to-all received are combined ([`crate::reduce_pieces`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PieceOp {
    /// Added in rank order, each addition rounded in the dtype.
    Sum,
    /// The sum, divided once by the number of pieces (when there is more than one).
    Mean,
    /// Burn's `max_pair` folded in rank order: a later piece's value replaces the kept one
    /// where the kept one is lower.
    Max,
    /// Burn's `min_pair` folded likewise: where the later value is lower.
    Min,
}
