//! Tensors as the host bytes MPI moves, and back.
//!
//! On Flex and NdArray MPI reads a tensor's own memory and writes into a buffer of the rank's
//! pool ([`HostPlane`]), which becomes the result without a copy. On any other backend (wgpu,
//! CUDA without NCCL) the tensor is read back to the host (`into_data`), and the result is
//! uploaded to the caller's device; reductions then fold on the device with the same Burn ops
//! `LocalGroup` uses there, so both engines give the same bits on every backend.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_zero_kernels::host::{FloatVisitor, HostFloat, HostTensor, visit};

use crate::call::ReduceOp;
use crate::error::CommError;
use crate::plane::{HostPlane, fold_pieces};

/// A tensor's bytes, which MPI reads.
pub(crate) enum Outgoing {
    /// The host tensor's own memory.
    Host(HostTensor),
    /// A copy read back from the device.
    Bytes(TensorData),
}

impl Outgoing {
    /// `tensor`'s bytes: in place on a host backend, read back elsewhere.
    pub fn of<B: Backend>(
        tensor: &Tensor<B, 1>,
        plane: Option<&HostPlane>,
        rank: usize,
    ) -> Result<Self, CommError> {
        if let Some(view) = plane.and_then(|plane| plane.view(tensor)) {
            return Ok(Outgoing::Host(view));
        }
        let data = tensor
            .clone()
            .try_into_data()
            .map_err(|error| CommError::Device {
                rank,
                reason: format!("reading a tensor back for MPI: {error:?}"),
            })?;
        Ok(Outgoing::Bytes(data))
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Outgoing::Host(tensor) => host_bytes(tensor),
            Outgoing::Bytes(data) => data.as_bytes(),
        }
    }

    /// Where MPI reads the bytes ([`address`]).
    pub fn address(&self) -> *const u8 {
        address(self.bytes())
    }
}

/// Where MPI writes a result: a pooled host buffer or plain bytes.
pub(crate) enum Incoming {
    Host(HostTensor),
    Bytes(Vec<u8>),
}

impl Incoming {
    /// Room for `numel` elements of `dtype`.
    pub fn new(plane: Option<&HostPlane>, dtype: DType, numel: usize) -> Self {
        match plane.and_then(|plane| plane.take(dtype, numel)) {
            Some(buffer) => Incoming::Host(buffer),
            None => Incoming::Bytes(vec![0; numel * dtype.size()]),
        }
    }

    /// The bytes MPI writes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Incoming::Host(tensor) => host_bytes_mut(tensor),
            Incoming::Bytes(bytes) => bytes,
        }
    }

    /// Where MPI writes the bytes ([`address`]).
    pub fn address(&mut self) -> *mut u8 {
        address(self.bytes_mut()).cast_mut()
    }

    /// The received values as a tensor of `dtype` on `device`.
    pub fn into_tensor<B: Backend>(
        self,
        plane: Option<&HostPlane>,
        dtype: DType,
        device: &B::Device,
    ) -> Tensor<B, 1> {
        match self {
            Incoming::Host(buffer) => {
                if let Some(plane) = plane {
                    plane.keep(&buffer);
                }
                HostPlane::tensor(buffer)
            }
            Incoming::Bytes(bytes) => {
                let numel = bytes.len() / dtype.size();
                let data = TensorData::from_bytes_vec(bytes, [numel], dtype);
                Tensor::from_data(data, (device, dtype))
            }
        }
    }

    /// The received blocks (one per rank, end to end, equal in length) reduced element by
    /// element in rank order, as `LocalGroup` reduces the ranks' buffers.
    pub fn reduce<B: Backend>(
        self,
        plane: Option<&HostPlane>,
        parts: usize,
        op: ReduceOp,
        dtype: DType,
        device: &B::Device,
    ) -> Tensor<B, 1> {
        if let (Incoming::Host(buffer), Some(plane)) = (&self, plane)
            && let Some(reduced) = plane.reduce_parts(buffer, parts, op)
        {
            plane.keep(buffer);
            return HostPlane::tensor(reduced);
        }
        fold_pieces(self.into_tensor::<B>(plane, dtype, device), parts, op)
    }
}

/// The address of `bytes` for MPI. An empty slice's address is a dangling placeholder, which
/// for bytes is 1: Open MPI's `MPI_IN_PLACE`, which would turn the call into another. MPI
/// neither reads nor writes a buffer of no bytes, so any real address does; this one is a
/// static's.
fn address(bytes: &[u8]) -> *const u8 {
    static NOTHING: [u8; 16] = [0; 16];
    if bytes.is_empty() {
        NOTHING.as_ptr()
    } else {
        bytes.as_ptr()
    }
}

/// A contiguous host tensor's elements as bytes.
fn host_bytes(tensor: &HostTensor) -> &[u8] {
    struct Bytes<'a>(&'a HostTensor);
    impl<'a> FloatVisitor for Bytes<'a> {
        type Output = &'a [u8];
        fn visit<E: HostFloat>(self) -> &'a [u8] {
            self.0
                .as_slice::<E>()
                .map(bytemuck::cast_slice)
                .unwrap_or_default()
        }
    }
    visit(tensor.dtype(), Bytes(tensor)).unwrap_or_default()
}

/// A pooled host buffer's elements as writable bytes.
fn host_bytes_mut(tensor: &mut HostTensor) -> &mut [u8] {
    struct Bytes<'a>(&'a mut HostTensor);
    impl<'a> FloatVisitor for Bytes<'a> {
        type Output = &'a mut [u8];
        fn visit<E: HostFloat>(self) -> &'a mut [u8] {
            self.0
                .as_mut_slice::<E>()
                .map(bytemuck::cast_slice_mut)
                .unwrap_or_default()
        }
    }
    let dtype = tensor.dtype();
    visit(dtype, Bytes(tensor)).unwrap_or_default()
}
