//! A device flag written in stream order: one unit of one launch stores a value into a one-word
//! buffer. Another stream can wait for the value on the device (CUDA's `cuStreamWaitValue32`),
//! which orders it after everything queued before the store on the writing stream, without the
//! host waiting and without either stream's handle being shared.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::CubeDim;
use cubecl::prelude::*;

use crate::KernelError;

/// `flag[0] = value`.
#[cube(launch)]
fn write_flag(flag: &mut Array<u32>, value: u32) {
    if ABSOLUTE_POS == 0 {
        flag[0] = value;
    }
}

/// Stores `value` into `flag` (a one-element `u32` tensor, which the caller keeps alive as long
/// as anything waits on it) after everything queued before it on the calling thread's stream.
/// An error, with nothing launched, for a tensor of another dtype or size.
pub fn signal<R: CubeRuntime>(flag: &CubeTensor<R>, value: u32) -> Result<(), KernelError> {
    if flag.dtype != DType::U32 || flag.meta.shape().num_elements() != 1 {
        return Err(KernelError::UnsupportedDType {
            dtype: flag.dtype,
            path: "device flag (one u32)",
        });
    }
    write_flag::launch::<R>(
        &flag.client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        flag.clone().into_array_arg(),
        value,
    );
    Ok(())
}
