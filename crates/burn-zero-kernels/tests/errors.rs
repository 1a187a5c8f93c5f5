//! Every error of the API, on Flex.

mod common;

use burn::backend::Flex;
use burn::tensor::DType;
use burn_zero_kernels::{BucketSpec, KernelError, MemberSpec, PackPath, Packer, unpack};
use common::Grad;

type B = Flex;

fn spec(rows: usize, row_len: usize) -> BucketSpec {
    BucketSpec {
        rows,
        row_len,
        dtype: DType::F32,
        predivide: 1.0,
    }
}

fn packer(spec: BucketSpec) -> Packer<B> {
    Packer::<B>::new(spec, &Default::default(), PackPath::Fallback).unwrap()
}

fn grad(numel: usize) -> Option<<B as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive> {
    Some(Grad::new(DType::F32, 1, numel, 2).primitive::<B>(&Default::default()))
}

fn new_error(spec: BucketSpec, path: PackPath) -> KernelError {
    match Packer::<B>::new(spec, &Default::default(), path) {
        Ok(_) => panic!("{spec:?} on {path:?} was accepted"),
        Err(error) => error,
    }
}

#[test]
fn bad_specs() {
    assert_eq!(
        new_error(spec(0, 4), PackPath::Auto),
        KernelError::EmptyBucket {
            rows: 0,
            row_len: 4
        }
    );
    assert_eq!(
        new_error(spec(2, 0), PackPath::Fallback),
        KernelError::EmptyBucket {
            rows: 2,
            row_len: 0
        }
    );
    for divisor in [0.0, -2.0, f64::NAN, f64::INFINITY] {
        let error = new_error(
            BucketSpec {
                predivide: divisor,
                ..spec(1, 4)
            },
            PackPath::Auto,
        );
        assert!(
            matches!(error, KernelError::InvalidDivisor { .. }),
            "{error}"
        );
    }
    let error = new_error(
        BucketSpec {
            dtype: DType::I32,
            ..spec(1, 4)
        },
        PackPath::Auto,
    );
    assert_eq!(
        error,
        KernelError::UnsupportedDType {
            dtype: DType::I32,
            path: "any"
        }
    );
}

#[test]
fn kernel_path_without_kernel() {
    let error = new_error(spec(2, 4), PackPath::Kernel);
    assert!(
        matches!(error, KernelError::KernelUnavailable { .. }),
        "{error}"
    );
    let row = Grad::new(DType::F32, 2, 8, 1).primitive::<B>(&Default::default());
    let error = unpack::<B>(&row, 0, 4, 2.0, DType::F16, PackPath::Kernel).unwrap_err();
    assert!(
        matches!(error, KernelError::KernelUnavailable { .. }),
        "{error}"
    );
}

#[test]
fn member_too_large() {
    let mut p = packer(spec(2, 4));
    let member = MemberSpec {
        numel: 9,
        len: 4,
        offset: 0,
    };
    assert_eq!(
        p.push(&member, None).unwrap_err(),
        KernelError::MemberTooLarge {
            numel: 9,
            rows: 2,
            len: 4
        }
    );
}

#[test]
fn member_out_of_row() {
    let mut p = packer(spec(2, 4));
    p.push(
        &MemberSpec {
            numel: 4,
            len: 2,
            offset: 0,
        },
        grad(4),
    )
    .unwrap();
    let member = MemberSpec {
        numel: 6,
        len: 3,
        offset: 2,
    };
    assert_eq!(
        p.push(&member, grad(6)).unwrap_err(),
        KernelError::OutOfRow {
            offset: 2,
            len: 3,
            row_len: 4
        }
    );
    let member = MemberSpec {
        numel: 0,
        len: 1,
        offset: usize::MAX,
    };
    assert!(matches!(
        p.push(&member, None),
        Err(KernelError::OutOfRow { .. })
    ));
}

#[test]
fn members_out_of_order() {
    let mut p = packer(spec(1, 6));
    // A gap.
    assert_eq!(
        p.push(
            &MemberSpec {
                numel: 2,
                len: 2,
                offset: 1
            },
            None
        )
        .unwrap_err(),
        KernelError::OutOfOrder {
            offset: 1,
            expected: 0
        }
    );
    p.push(
        &MemberSpec {
            numel: 3,
            len: 3,
            offset: 0,
        },
        grad(3),
    )
    .unwrap();
    // An overlap.
    assert_eq!(
        p.push(
            &MemberSpec {
                numel: 2,
                len: 2,
                offset: 2
            },
            None
        )
        .unwrap_err(),
        KernelError::OutOfOrder {
            offset: 2,
            expected: 3
        }
    );
}

#[test]
fn gradient_size_mismatch() {
    let mut p = packer(spec(2, 4));
    let member = MemberSpec {
        numel: 7,
        len: 4,
        offset: 0,
    };
    assert_eq!(
        p.push(&member, grad(8)).unwrap_err(),
        KernelError::GradientSize {
            expected: 7,
            actual: 8
        }
    );
}

#[test]
fn incomplete_bucket() {
    let mut p = packer(spec(2, 6));
    p.push(
        &MemberSpec {
            numel: 7,
            len: 4,
            offset: 0,
        },
        grad(7),
    )
    .unwrap();
    assert_eq!(
        p.finish().unwrap_err(),
        KernelError::Incomplete {
            covered: 4,
            row_len: 6
        }
    );
    assert_eq!(
        packer(spec(1, 3)).finish().unwrap_err(),
        KernelError::Incomplete {
            covered: 0,
            row_len: 3
        }
    );
}

#[test]
fn complete_bucket_finishes() {
    // The control for the error tests above: the same calls, done right, succeed.
    let mut p = packer(spec(2, 6));
    p.push(
        &MemberSpec {
            numel: 7,
            len: 4,
            offset: 0,
        },
        grad(7),
    )
    .unwrap();
    p.push(
        &MemberSpec {
            numel: 3,
            len: 2,
            offset: 4,
        },
        None,
    )
    .unwrap();
    let bucket = common::read::<B>(p.finish().unwrap());
    assert_eq!(bucket.shape.to_vec(), vec![12]);
}

#[test]
fn unpack_errors() {
    let device = Default::default();
    let row = Grad::new(DType::F32, 3, 8, 1).primitive::<B>(&device);
    assert_eq!(
        unpack::<B>(&row, 5, 4, 1.0, DType::F32, PackPath::Auto).unwrap_err(),
        KernelError::OutOfRow {
            offset: 5,
            len: 4,
            row_len: 8
        }
    );
    let error = unpack::<B>(&row, 0, 4, 0.0, DType::F32, PackPath::Auto).unwrap_err();
    assert!(
        matches!(error, KernelError::InvalidDivisor { .. }),
        "{error}"
    );
    assert_eq!(
        unpack::<B>(&row, 0, 4, 1.0, DType::I64, PackPath::Fallback).unwrap_err(),
        KernelError::UnsupportedDType {
            dtype: DType::I64,
            path: "any"
        }
    );
    let square = Grad::new(DType::F32, 3, 16, 2).primitive::<B>(&device);
    assert_eq!(
        unpack::<B>(&square, 0, 4, 1.0, DType::F32, PackPath::Auto).unwrap_err(),
        KernelError::NotFlat { rank: 2 }
    );
    // The control: in bounds, it works.
    assert!(unpack::<B>(&row, 4, 4, 2.0, DType::F16, PackPath::Auto).is_ok());
}

/// A gathered chunk that does not split into one row per rank, or a member that does not fit
/// its blocks, is refused by name; on Flex the kernel path is refused as unavailable; a
/// well-formed one cuts out each member's values.
#[test]
fn gathered_chunks_that_do_not_fit() {
    use burn::tensor::{Tensor, TensorData};
    use burn_zero_kernels::{GatheredMember, cut_gathered};
    let device = Default::default();
    // Two ranks' rows of 5: member a (7 elements, blocks of 4) then member b (2, blocks of 1).
    let data: Vec<f32> = vec![0., 1., 2., 3., 7., 4., 5., 6., f32::NAN, 8.];
    let gathered = Tensor::<B, 1>::from_data(TensorData::new(data, [10]), &device)
        .into_primitive()
        .tensor();
    let a = GatheredMember {
        offset: 0,
        block_len: 4,
        numel: 7,
    };
    let b = GatheredMember {
        offset: 4,
        block_len: 1,
        numel: 2,
    };
    let cut = cut_gathered::<B>(&gathered, 2, &[a, b], PackPath::Auto).unwrap();
    let values: Vec<Vec<f32>> = cut
        .into_iter()
        .map(|t| Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(t)))
        .map(|t| t.into_data().to_vec().unwrap())
        .collect();
    assert_eq!(values, [vec![0., 1., 2., 3., 4., 5., 6.], vec![7., 8.]]);

    let refused = |ranks, member: GatheredMember| {
        cut_gathered::<B>(&gathered, ranks, &[member], PackPath::Auto).unwrap_err()
    };
    let not_gathered = |ranks, member: GatheredMember| KernelError::NotGathered {
        len: 10,
        ranks,
        offset: member.offset,
        block_len: member.block_len,
        numel: member.numel,
    };
    // Ten elements do not make three equal rows, nor zero rows.
    assert_eq!(refused(3, a), not_gathered(3, a));
    assert_eq!(refused(0, a), not_gathered(0, a));
    // Past the end of a row, and more elements than the blocks hold.
    let past = GatheredMember { offset: 4, ..a };
    assert_eq!(refused(2, past), not_gathered(2, past));
    let overfull = GatheredMember { numel: 9, ..a };
    assert_eq!(refused(2, overfull), not_gathered(2, overfull));
    assert!(matches!(
        cut_gathered::<B>(&gathered, 2, &[a], PackPath::Kernel),
        Err(KernelError::KernelUnavailable { .. })
    ));
}
