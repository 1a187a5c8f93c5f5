//! Kernel against fallback on `CubeBackend<WgpuRuntime>` (Mesa lavapipe where there is no
//! GPU): buckets and unpacked shards must be bitwise identical.

mod common;

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_zero_kernels::{KernelError, PackPath, Packer, kernel_available, unpack};
use common::{Case, Grad, assert_bitwise, read, reference_unpack};

type B = CubeBackend<WgpuRuntime, f32, i32, u32>;

fn device() -> WgpuDevice {
    WgpuDevice::default()
}

/// Packs `case` on `path`; `strided` as in `grad_for`.
fn pack(case: &Case, path: PackPath, strided: bool) -> burn::tensor::TensorData {
    let device = device();
    let mut packer = Packer::<B>::new(case.spec, &device, path).unwrap();
    assert_eq!(packer.uses_kernel(), path != PackPath::Fallback);
    for (member, grad) in &case.members {
        let grad = grad.as_ref().map(|g| grad_for(g, &device, strided));
        packer.push(member, grad).unwrap();
    }
    read::<B>(packer.finish().unwrap())
}

/// The gradient on the device; `strided` gives 2-D gradients a non-contiguous layout (the
/// transpose of a transposed copy: same logical values, swapped strides).
fn grad_for(
    grad: &Grad,
    device: &WgpuDevice,
    strided: bool,
) -> <B as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive {
    if strided && grad.shape.len() == 2 {
        let [a, b] = [grad.shape[0], grad.shape[1]];
        let mut transposed = grad.clone();
        transposed.shape = vec![b, a];
        transposed.values = (0..a * b)
            .map(|k| grad.values[(k % a) * b + k / a])
            .collect();
        let t = transposed.primitive::<B>(device);
        let t = B::float_swap_dims(t, 0, 1);
        assert_eq!(t.shape(), Shape::from(grad.shape.clone()));
        t
    } else {
        grad.primitive::<B>(device)
    }
}

/// Kernel and fallback agree bit for bit on the bucket and on every unpacked member. Where no
/// division is involved (a device's division need not be correctly rounded), the kernel also
/// matches the host reference, so the layout is checked independently of the fallback.
fn check(case: &Case, strided: bool) {
    let spec = case.spec;
    let what = format!(
        "rows={} dtype={:?} predivide={} strided={strided}",
        spec.rows, spec.dtype, spec.predivide
    );
    leave_dirty_memory(case);
    let kernel = pack(case, PackPath::Kernel, strided);
    let fallback = pack(case, PackPath::Fallback, strided);
    assert_bitwise(&kernel, &fallback, &format!("pack {what}"));
    if spec.predivide == 1.0 {
        assert_bitwise(&kernel, &case.reference(), &format!("pack vs host {what}"));
    }

    let device = device();
    for row in 0..spec.rows {
        let start = row * spec.row_len;
        let values = common::host(&kernel)[start..start + spec.row_len].to_vec();
        let row_data = common::data(spec.dtype, &values, [spec.row_len]);
        let reduced = Grad {
            dtype: spec.dtype,
            shape: vec![spec.row_len],
            values,
        }
        .primitive::<B>(&device);
        for (i, (member, grad)) in case.members.iter().enumerate() {
            for postdivide in [1.0, 2.0, 3.0] {
                let dtype = grad.as_ref().map_or(spec.dtype, |g| g.dtype);
                let run = |path| {
                    read::<B>(
                        unpack::<B>(&reduced, member.offset, member.len, postdivide, dtype, path)
                            .unwrap(),
                    )
                };
                let what = format!("unpack {what} row {row} member {i} postdivide {postdivide}");
                let kernel = run(PackPath::Kernel);
                assert_bitwise(&kernel, &run(PackPath::Fallback), &what);
                if postdivide == 1.0 {
                    let expected =
                        reference_unpack(&row_data, member.offset, member.len, postdivide, dtype);
                    assert_bitwise(&kernel, &expected, &format!("{what} vs host"));
                }
            }
        }
    }
}

/// Packs and drops a bucket of `case`'s size with no zero anywhere, so that the next
/// allocation of that size likely reuses non-zero memory: padding and members without a
/// gradient must then be written, not inherited from a fresh zeroed buffer.
fn leave_dirty_memory(case: &Case) {
    let mut dirty = case.clone();
    for (i, (member, grad)) in dirty.members.iter_mut().enumerate() {
        member.numel = case.spec.rows * member.len;
        let values = vec![1.5; member.numel];
        *grad = Some(Grad {
            dtype: case.spec.dtype,
            shape: vec![member.numel],
            values: values.iter().map(|v| v + i as f64).collect(),
        });
    }
    let bucket = pack(&dirty, PackPath::Kernel, false);
    assert!(common::host(&bucket).iter().all(|&v| v != 0.0));
}

fn supports(dtype: DType) -> bool {
    B::supports_dtype(&device(), dtype)
}

#[test]
fn kernel_is_detected() {
    eprintln!(
        "wgpu adapter: f16 {}, bf16 {}",
        supports(DType::F16),
        supports(DType::BF16)
    );
    assert!(kernel_available::<B>());
    assert!(kernel_available::<
        CubeBackend<WgpuRuntime, half::f16, i32, u32>,
    >());
    assert!(!kernel_available::<burn::backend::Flex>());
    let spec = burn_zero_kernels::BucketSpec {
        rows: 1,
        row_len: 4,
        dtype: DType::F32,
        predivide: 1.0,
    };
    assert!(
        Packer::<B>::new(spec, &device(), PackPath::Auto)
            .unwrap()
            .uses_kernel()
    );
}

#[test]
fn f32_odd_sizes_rows_and_divisors() {
    // Odd sizes (and so odd offsets), a member without a gradient, extra padding columns.
    let numels = [1, 7, 1023, 8, 5];
    let extra = [0, 2, 1, 0, 3];
    let grads = [
        Some(DType::F32),
        Some(DType::F32),
        None,
        Some(DType::F32),
        Some(DType::F32),
    ];
    for rows in 1..=4 {
        for predivide in [1.0, 2.0, 3.0] {
            let case = Case::new(
                rows,
                DType::F32,
                predivide,
                &numels,
                &extra,
                &grads,
                rows as u64,
            );
            check(&case, false);
        }
    }
}

#[test]
fn f32_vectorised_members() {
    // Lengths and offsets that are multiples of 4: the kernels read and write vectors.
    let case = Case::new(
        2,
        DType::F32,
        3.0,
        &[4096, 64, 8],
        &[0, 4, 0],
        &[Some(DType::F32), None, Some(DType::F32)],
        5,
    );
    check(&case, false);
}

#[test]
fn f32_strided_gradients() {
    // 2-D gradients with swapped strides: read element by element through the view.
    let case = Case::new(
        3,
        DType::F32,
        2.0,
        &[6, 35, 1024],
        &[0, 1, 0],
        &[Some(DType::F32), Some(DType::F32), Some(DType::F32)],
        21,
    );
    assert_eq!(case.members[1].1.as_ref().unwrap().shape.len(), 2);
    check(&case, true);
}

#[test]
fn f32_large_member() {
    for rows in [1, 3] {
        let case = Case::new(
            rows,
            DType::F32,
            3.0,
            &[262_147, 7],
            &[0, 1],
            &[Some(DType::F32), None],
            77,
        );
        check(&case, false);
    }
}

#[test]
fn half_precision() {
    if !supports(DType::F16) {
        // Without f16 the kernel path must refuse it rather than pack wrongly.
        let spec = burn_zero_kernels::BucketSpec {
            rows: 1,
            row_len: 4,
            dtype: DType::F16,
            predivide: 1.0,
        };
        let error = Packer::<B>::new(spec, &device(), PackPath::Kernel)
            .err()
            .unwrap();
        assert_eq!(
            error,
            KernelError::UnsupportedDType {
                dtype: DType::F16,
                path: "kernel"
            }
        );
        eprintln!("this wgpu adapter has no f16: checked the refusal only");
        return;
    }
    for (dtype, grad) in [
        (DType::F16, DType::F32),
        (DType::F32, DType::F16),
        (DType::F16, DType::F16),
    ] {
        for rows in [1, 2, 4] {
            for predivide in [1.0, 3.0] {
                let case = Case::new(
                    rows,
                    dtype,
                    predivide,
                    &[7, 1023, 1],
                    &[1, 0, 0],
                    &[Some(grad), None, Some(grad)],
                    rows as u64,
                );
                check(&case, false);
            }
        }
    }
}

#[test]
fn bf16_is_refused_or_matches() {
    if supports(DType::BF16) {
        let case = Case::new(
            2,
            DType::BF16,
            3.0,
            &[7, 33],
            &[0, 1],
            &[Some(DType::F32), None],
            3,
        );
        check(&case, false);
    } else {
        let spec = burn_zero_kernels::BucketSpec {
            rows: 1,
            row_len: 4,
            dtype: DType::BF16,
            predivide: 1.0,
        };
        let error = Packer::<B>::new(spec, &device(), PackPath::Kernel)
            .err()
            .unwrap();
        assert_eq!(
            error,
            KernelError::UnsupportedDType {
                dtype: DType::BF16,
                path: "kernel"
            }
        );
    }
}

#[test]
fn gradient_on_another_device() {
    // lavapipe is also the adapter behind `WgpuDevice::Cpu`: a second device on this machine.
    let other = WgpuDevice::Cpu;
    let spec = burn_zero_kernels::BucketSpec {
        rows: 1,
        row_len: 4,
        dtype: DType::F32,
        predivide: 1.0,
    };
    let member = burn_zero_kernels::MemberSpec {
        numel: 4,
        len: 4,
        offset: 0,
    };
    let grad = Grad::new(DType::F32, 8, 4, 1);
    for path in [PackPath::Kernel, PackPath::Fallback] {
        let mut packer = Packer::<B>::new(spec, &device(), path).unwrap();
        let error = packer
            .push(&member, Some(grad.primitive::<B>(&other)))
            .unwrap_err();
        assert!(
            matches!(error, KernelError::DeviceMismatch { .. }),
            "{error}"
        );
        // The control: the same gradient on the bucket's device is accepted.
        packer
            .push(&member, Some(grad.primitive::<B>(&device())))
            .unwrap();
    }
}
