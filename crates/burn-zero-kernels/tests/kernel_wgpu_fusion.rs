//! The kernels under Burn's fusion layer, `Fusion<CubeBackend<WgpuRuntime>>` (what
//! `burn::backend::Wgpu` is with Burn's default features), on Mesa lavapipe where there is no
//! GPU: the kernel path is taken, and its buckets and unpacked members are bitwise those of the
//! fused fallback and of the plain `CubeBackend` kernels. Without a wgpu adapter every test says
//! it was skipped, unless `BURN_ZERO_REQUIRE_WGPU=1` (CI) makes that a failure.

mod common;

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, TensorData};
use burn_fusion::Fusion;
use burn_zero_kernels::{BucketSpec, MemberSpec, PackPath, Packer, kernel_available, unpack};
use burn_zero_testing::skip;
use common::{Case, Grad, assert_bitwise, read, reference_unpack};

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
type Fused = Fusion<Plain>;

fn device() -> WgpuDevice {
    WgpuDevice::default()
}

/// Whether `test` can run: wgpu has an adapter here (checked before any backend call).
fn runs(test: &str) -> bool {
    skip::wgpu_adapter(test)
}

fn pack<B: Backend<Device = WgpuDevice>>(case: &Case, path: PackPath) -> TensorData {
    let device = device();
    let mut packer = Packer::<B>::new(case.spec, &device, path).unwrap();
    assert_eq!(packer.uses_kernel(), path != PackPath::Fallback);
    for (member, grad) in &case.members {
        let grad = grad.as_ref().map(|g| g.primitive::<B>(&device));
        packer.push(member, grad).unwrap();
    }
    read::<B>(packer.finish().unwrap())
}

fn unpacked<B: Backend<Device = WgpuDevice>>(
    row: &Grad,
    member: &MemberSpec,
    postdivide: f64,
    dtype: DType,
    path: PackPath,
) -> TensorData {
    let reduced = row.primitive::<B>(&device());
    read::<B>(unpack::<B>(&reduced, member.offset, member.len, postdivide, dtype, path).unwrap())
}

/// Fused kernel = fused fallback = plain kernel, for the bucket and every member's unpack.
fn check(case: &Case) {
    let spec = case.spec;
    let what = format!(
        "rows={} dtype={:?} predivide={}",
        spec.rows, spec.dtype, spec.predivide
    );
    let fused = pack::<Fused>(case, PackPath::Kernel);
    assert_bitwise(
        &fused,
        &pack::<Fused>(case, PackPath::Fallback),
        &format!("fused kernel vs fused fallback, {what}"),
    );
    assert_bitwise(
        &fused,
        &pack::<Plain>(case, PackPath::Kernel),
        &format!("fused kernel vs plain kernel, {what}"),
    );
    if spec.predivide == 1.0 {
        assert_bitwise(&fused, &case.reference(), &format!("pack vs host, {what}"));
    }

    let values = common::host(&fused)[..spec.row_len].to_vec();
    let row_data = common::data(spec.dtype, &values, [spec.row_len]);
    let row = Grad {
        dtype: spec.dtype,
        shape: vec![spec.row_len],
        values,
    };
    for (i, (member, grad)) in case.members.iter().enumerate() {
        let dtype = grad.as_ref().map_or(spec.dtype, |g| g.dtype);
        for postdivide in [1.0, 3.0] {
            let what = format!("unpack {what} member {i} postdivide {postdivide}");
            let kernel = unpacked::<Fused>(&row, member, postdivide, dtype, PackPath::Kernel);
            assert_bitwise(
                &kernel,
                &unpacked::<Fused>(&row, member, postdivide, dtype, PackPath::Fallback),
                &format!("fused kernel vs fused fallback, {what}"),
            );
            assert_bitwise(
                &kernel,
                &unpacked::<Plain>(&row, member, postdivide, dtype, PackPath::Kernel),
                &format!("fused kernel vs plain kernel, {what}"),
            );
            if postdivide == 1.0 {
                let expected =
                    reference_unpack(&row_data, member.offset, member.len, postdivide, dtype);
                assert_bitwise(&kernel, &expected, &format!("{what} vs host"));
            }
        }
    }
}

#[test]
fn the_fused_backend_takes_the_kernel_path() {
    if !runs("the_fused_backend_takes_the_kernel_path") {
        return;
    }
    assert!(kernel_available::<Fused>());
    assert!(kernel_available::<burn::backend::Wgpu>());
    assert!(kernel_available::<
        Fusion<CubeBackend<WgpuRuntime, half::f16, i32, u32>>,
    >());
    let spec = BucketSpec {
        rows: 1,
        row_len: 4,
        dtype: DType::F32,
        predivide: 1.0,
    };
    assert!(
        Packer::<Fused>::new(spec, &device(), PackPath::Auto)
            .unwrap()
            .uses_kernel()
    );
}

#[test]
fn f32_odd_sizes_rows_and_divisors() {
    if !runs("f32_odd_sizes_rows_and_divisors") {
        return;
    }
    let numels = [1, 7, 1023, 8, 5];
    let extra = [0, 2, 1, 0, 3];
    let grads = [
        Some(DType::F32),
        Some(DType::F32),
        None,
        Some(DType::F32),
        Some(DType::F32),
    ];
    for rows in [1, 2, 3] {
        for predivide in [1.0, 3.0] {
            check(&Case::new(
                rows,
                DType::F32,
                predivide,
                &numels,
                &extra,
                &grads,
                rows as u64,
            ));
        }
    }
}

#[test]
fn f16_buckets_where_the_adapter_has_f16() {
    let test = "f16_buckets_where_the_adapter_has_f16";
    if !runs(test)
        || !skip::dtype_supported(
            test,
            Plain::supports_dtype(&device(), DType::F16),
            "f16",
            "",
        )
    {
        return;
    }
    for (dtype, grad) in [(DType::F16, DType::F32), (DType::F32, DType::F16)] {
        check(&Case::new(
            2,
            dtype,
            3.0,
            &[7, 1023, 1],
            &[1, 0, 0],
            &[Some(grad), None, Some(grad)],
            9,
        ));
    }
}

/// A gradient still pending in the fusion stream (queued operations, not yet executed) is
/// computed before the kernel reads it, and the packed bucket feeds later fused operations.
#[test]
fn pending_fused_work_is_run_first_and_results_flow_on() {
    if !runs("pending_fused_work_is_run_first_and_results_flow_on") {
        return;
    }
    let device = device();
    let spec = BucketSpec {
        rows: 1,
        row_len: 12,
        dtype: DType::F32,
        predivide: 1.0,
    };
    let member = MemberSpec {
        numel: 12,
        len: 12,
        offset: 0,
    };
    let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
    let grad = Fused::float_from_data(TensorData::new(values.clone(), [3, 4]), &device);
    // Queued, not executed: the fusion stream runs them when the tensor is resolved.
    let grad = Fused::float_add_scalar(Fused::float_mul_scalar(grad, 2.0.into()), 1.0.into());
    let mut packer = Packer::<Fused>::new(spec, &device, PackPath::Kernel).unwrap();
    packer.push(&member, Some(grad)).unwrap();
    let bucket = packer.finish().unwrap();
    let next = Fused::float_mul_scalar(bucket, 4.0.into());
    let got: Vec<f32> = read::<Fused>(next).to_vec().unwrap();
    let expected: Vec<f32> = values.iter().map(|v| (v * 2.0 + 1.0) * 4.0).collect();
    assert_eq!(got, expected);
}
