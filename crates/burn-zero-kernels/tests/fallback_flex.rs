//! The fallback path on Flex against the host reference, bit for bit, for f32/f16/bf16
//! buckets fed gradients of every float dtype.

mod common;

use burn::backend::Flex;
use burn::tensor::{DType, Tensor, TensorData};
use burn_zero_kernels::host::{AdamRule, AdamStep};
use burn_zero_kernels::{PackPath, Packer, adam_step_kernel, kernel_available, unpack};
use common::{Case, assert_bitwise, read, reference_unpack};

type B = Flex;

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Packs `case` on Flex and checks the bucket, then unpacks every member of every row.
fn check(case: &Case, path: PackPath) {
    let device = Default::default();
    let spec = case.spec;
    let mut packer = Packer::<B>::new(spec, &device, path).unwrap();
    assert!(!packer.uses_kernel());
    for (member, grad) in &case.members {
        let grad = grad.as_ref().map(|g| g.primitive::<B>(&device));
        packer.push(member, grad).unwrap();
    }
    let bucket = read::<B>(packer.finish().unwrap());
    let what = format!(
        "pack rows={} dtype={:?} predivide={}",
        spec.rows, spec.dtype, spec.predivide
    );
    assert_bitwise(&bucket, &case.reference(), &what);

    // Unpack from each row as if it were this rank's reduced row.
    for row in 0..spec.rows {
        let start = row * spec.row_len;
        let row_data = common::data(
            spec.dtype,
            &common::host(&bucket)[start..start + spec.row_len],
            [spec.row_len],
        );
        let reduced = common::Grad {
            dtype: spec.dtype,
            shape: vec![spec.row_len],
            values: common::host(&row_data),
        }
        .primitive::<B>(&device);
        for (i, (member, grad)) in case.members.iter().enumerate() {
            let dtype = grad.as_ref().map_or(FLOATS[i % 3], |g| g.dtype);
            let postdivide = [1.0, 2.0, 3.0][(row + i) % 3];
            let part =
                unpack::<B>(&reduced, member.offset, member.len, postdivide, dtype, path).unwrap();
            let expected =
                reference_unpack(&row_data, member.offset, member.len, postdivide, dtype);
            assert_bitwise(
                &read::<B>(part),
                &expected,
                &format!(
                    "{what}: unpack row {row} member {i} postdivide {postdivide} to {dtype:?}"
                ),
            );
        }
    }
}

#[test]
fn flex_has_no_kernel() {
    assert!(!kernel_available::<B>());
}

#[test]
fn fallback_matches_host_reference() {
    // Odd sizes, a member without a gradient, extra padding columns, multi-dim gradients.
    let numels = [1, 7, 300, 1023, 5];
    let extra = [0, 2, 0, 1, 0];
    for dtype in FLOATS {
        for rows in 1..=4 {
            for predivide in [1.0, 2.0, 3.0] {
                let grads = [
                    Some(dtype),
                    Some(FLOATS[(rows + 1) % 3]),
                    None,
                    Some(FLOATS[rows % 3]),
                    Some(DType::F32),
                ];
                let case = Case::new(rows, dtype, predivide, &numels, &extra, &grads, rows as u64);
                check(&case, PackPath::Fallback);
            }
        }
    }
}

/// Auto on Flex is the host path (tests/host.rs), with the same results.
#[test]
fn auto_on_flex_matches_the_reference() {
    let case = Case::new(
        3,
        DType::F16,
        3.0,
        &[7, 1],
        &[0, 1],
        &[Some(DType::F32), Some(DType::BF16)],
        11,
    );
    check(&case, PackPath::Auto);
}

#[test]
fn fallback_large_member() {
    for (dtype, rows) in [(DType::F32, 3), (DType::BF16, 4), (DType::F16, 1)] {
        let case = Case::new(
            rows,
            dtype,
            2.0,
            &[262_147, 7],
            &[0, 0],
            &[Some(DType::F32), None],
            99,
        );
        check(&case, PackPath::Fallback);
    }
}

/// Flex has no Adam kernel: the kernel entry point answers `None` (the fused optimizer steps
/// Flex with the host pass instead).
#[test]
fn no_adam_kernel_on_flex() {
    let device = Default::default();
    let flat = |values: Vec<f32>| -> Tensor<B, 1> {
        let n = values.len();
        Tensor::from_data(TensorData::new(values, [n]), &device)
    };
    let step = AdamStep {
        rule: AdamRule::Adam { weight_decay: None },
        lr: 1e-3,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-5,
        time: 1,
        factor: None,
    };
    let p = flat(vec![0.5; 8]).into_primitive().tensor();
    let g = flat(vec![0.25; 8]).into_primitive().tensor();
    assert!(!kernel_available::<B>());
    assert!(adam_step_kernel::<B>(&step, p, g, None).is_none());
}
