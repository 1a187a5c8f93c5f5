//! What can go wrong when packing or unpacking a bucket.

use burn::tensor::DType;

/// A bucket, member or call that pack/unpack cannot honour.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// A bucket needs at least one row and one element per row.
    #[error("empty bucket: {rows} row(s) of {row_len} element(s)")]
    EmptyBucket { rows: usize, row_len: usize },

    /// Divisors must be finite and positive.
    #[error("divisor {divisor} is not a finite positive number")]
    InvalidDivisor { divisor: f64 },

    /// The gradient does not fit in the member's `rows * len` slots.
    #[error("member of {numel} element(s) does not fit in {rows} row(s) of {len}")]
    MemberTooLarge {
        numel: usize,
        rows: usize,
        len: usize,
    },

    /// `[offset, offset + len)` reaches past the end of a row.
    #[error("range {offset}..{} is outside a row of {row_len} element(s)", offset.saturating_add(*len))]
    OutOfRow {
        offset: usize,
        len: usize,
        row_len: usize,
    },

    /// Members must be pushed in offset order, each starting where the previous one ended.
    #[error("member at offset {offset} pushed where offset {expected} was expected")]
    OutOfOrder { offset: usize, expected: usize },

    /// The gradient's element count differs from the member's `numel`.
    #[error("gradient has {actual} element(s), the member expects {expected}")]
    GradientSize { expected: usize, actual: usize },

    /// The gradient lives on another device than the bucket.
    #[error("gradient on device {actual}, the bucket is on {expected}")]
    DeviceMismatch { expected: String, actual: String },

    /// `finish` was called before the members covered the whole row.
    #[error("members cover {covered} of {row_len} element(s) per row")]
    Incomplete { covered: usize, row_len: usize },

    /// An all-gathered chunk does not split into equal rows, one per rank, or a member does
    /// not fit the blocks it has in them.
    #[error(
        "a gathered chunk of {len} element(s) over {ranks} rank(s) cannot hold a member of \
         {numel} element(s) in blocks of {block_len} at offset {offset}"
    )]
    NotGathered {
        len: usize,
        ranks: usize,
        offset: usize,
        block_len: usize,
        numel: usize,
    },

    /// A reduced row passed to `unpack` must be one-dimensional.
    #[error("expected a 1-D reduced row, got rank {rank}")]
    NotFlat { rank: usize },

    /// The dtype is not a float type this path can pack or unpack.
    #[error("dtype {dtype:?} is not supported on the {path} path")]
    UnsupportedDType { dtype: DType, path: &'static str },

    /// `PackPath::Kernel` was requested for a backend without kernels in this build.
    #[error(
        "no pack/unpack kernel for backend {backend} (enable feature `wgpu` or `cuda`, use CubeBackend without Fusion)"
    )]
    KernelUnavailable { backend: String },

    /// `PackPath::Host` was requested for a backend whose tensors are not in host memory.
    #[error(
        "no host pack/unpack for backend {backend} (it runs on Flex and NdArray, with features `flex` and `ndarray`)"
    )]
    HostUnavailable { backend: String },

    /// A received buffer does not split into `parts` pieces of one length.
    #[error("{numel} element(s) do not split into {parts} equal piece(s)")]
    UnevenPieces { numel: usize, parts: usize },

    /// Separately rounded multiply-adds were asked of CUDA's optimizer kernels, which its
    /// compiler contracts into fused ones.
    #[error(
        "CUDA's optimizer kernels cannot round a multiply and an add separately (NVRTC contracts them); they compute MultiplyAdd::Fused"
    )]
    SeparateRoundingUnavailable,
}
