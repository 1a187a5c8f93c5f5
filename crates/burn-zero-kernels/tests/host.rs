//! The host path on Flex and NdArray: bit for bit against the host reference and against the
//! Burn-ops path, at odd sizes and offsets, with special values, strided gradients and reduced
//! rows that are views; and the buffer pool's reuse (never of memory a tensor still reads).

mod common;

use burn::backend::{Flex, NdArray};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_zero_kernels::host::{HostBackend, HostTensor};
use burn_zero_kernels::{
    BucketSpec, BufferPool, KernelError, MemberSpec, PackPath, Packer, RowPart, unpack, unpack_row,
};
use common::{Case, Grad, assert_bitwise, read, reference_unpack};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Packs `case` on `B` with `path` (from `pool` when given) and returns the bucket's data.
fn pack<B: Backend>(case: &Case, path: PackPath, pool: Option<&BufferPool>) -> TensorData {
    let device = Default::default();
    let mut packer = match pool {
        Some(pool) => Packer::<B>::with_pool(case.spec, &device, path, pool),
        None => Packer::<B>::new(case.spec, &device, path),
    }
    .unwrap();
    assert_eq!(packer.path(), path, "the packer took another path");
    for (member, grad) in &case.members {
        let grad = grad.as_ref().map(|g| g.primitive::<B>(&device));
        packer.push(member, grad).unwrap();
    }
    read::<B>(packer.finish().unwrap())
}

/// Host pack of `case` against the host reference and the fallback; then host unpack of
/// every member of every row against the reference and the fallback.
fn check<B: Backend>(case: &Case, dtypes: &[DType]) {
    let spec = case.spec;
    let what = format!(
        "{} rows={} dtype={:?} predivide={}",
        B::name(&Default::default()),
        spec.rows,
        spec.dtype,
        spec.predivide
    );
    let bucket = pack::<B>(case, PackPath::Host, None);
    assert_bitwise(&bucket, &case.reference(), &format!("host pack, {what}"));
    assert_bitwise(
        &bucket,
        &pack::<B>(case, PackPath::Fallback, None),
        &format!("host pack against the fallback, {what}"),
    );

    let device = Default::default();
    let values = common::host(&bucket);
    for row in 0..spec.rows {
        let start = row * spec.row_len;
        let row_data = common::data(
            spec.dtype,
            &values[start..start + spec.row_len],
            [spec.row_len],
        );
        let reduced = Grad {
            dtype: spec.dtype,
            shape: vec![spec.row_len],
            values: values[start..start + spec.row_len].to_vec(),
        }
        .primitive::<B>(&device);
        for (i, (member, grad)) in case.members.iter().enumerate() {
            let dtype = grad.as_ref().map_or(dtypes[i % dtypes.len()], |g| g.dtype);
            let postdivide = [1.0, 2.0, 3.0, 0.75][(row + i) % 4];
            let unpacked = |path| {
                read::<B>(
                    unpack::<B>(&reduced, member.offset, member.len, postdivide, dtype, path)
                        .unwrap(),
                )
            };
            let what = format!("{what}: unpack row {row} member {i} / {postdivide} to {dtype:?}");
            let host = unpacked(PackPath::Host);
            assert_bitwise(
                &host,
                &reference_unpack(&row_data, member.offset, member.len, postdivide, dtype),
                &what,
            );
            assert_bitwise(&host, &unpacked(PackPath::Fallback), &what);
        }
        check_row::<B>(
            &reduced,
            &row_data,
            case,
            dtypes,
            &format!("{what}: row {row}"),
        );
    }
}

/// `unpack_row` of every member of one reduced row, against the host reference: with every
/// part in the row's dtype (the row divided once, then sliced) and with mixed dtypes, from a
/// row nothing else holds (divided in place) and from one that another tensor still reads
/// (which must keep its values).
fn check_row<B: Backend>(
    reduced: &B::FloatTensorPrimitive,
    row_data: &TensorData,
    case: &Case,
    dtypes: &[DType],
    what: &str,
) {
    let row_dtype = row_data.dtype;
    for postdivide in [1.0, 2.0, 3.0, 0.75] {
        for mixed in [false, true] {
            let parts: Vec<RowPart> = case
                .members
                .iter()
                .enumerate()
                .map(|(i, (member, _))| RowPart {
                    offset: member.offset,
                    len: member.len,
                    dtype: if mixed {
                        dtypes[i % dtypes.len()]
                    } else {
                        row_dtype
                    },
                })
                .collect();
            // Unique; shared without a pool; shared with a pool, twice (the second call
            // reuses the buffer the first one's parts gave back).
            let pool = BufferPool::default();
            for (shared, pool) in [
                (false, None),
                (true, None),
                (true, Some(&pool)),
                (true, Some(&pool)),
            ] {
                // A fresh copy of the row: only `kept` (when shared) holds it besides the call.
                let row = B::float_from_data(read::<B>(reduced.clone()), &Default::default());
                let kept = shared.then(|| row.clone());
                let out = unpack_row::<B>(row, &parts, postdivide, PackPath::Auto, pool).unwrap();
                let what = format!(
                    "{what}: unpack_row / {postdivide}, mixed {mixed}, shared {shared}, pool {}",
                    pool.is_some()
                );
                for (i, (part, values)) in parts.iter().zip(out).enumerate() {
                    assert_bitwise(
                        &read::<B>(values),
                        &reference_unpack(row_data, part.offset, part.len, postdivide, part.dtype),
                        &format!("{what}, part {i}"),
                    );
                }
                if let Some(kept) = kept {
                    assert_bitwise(
                        &read::<B>(kept),
                        row_data,
                        &format!("{what}: the shared row changed"),
                    );
                }
            }
        }
    }
}

/// Odd sizes, odd offsets (padding columns), members without a gradient, gradients of every
/// float dtype, 1 to 4 rows, divisors that round in every dtype.
fn sweep<B: Backend>(dtypes: &[DType]) {
    let numels = [1, 7, 300, 1023, 5, 33];
    let extra = [0, 3, 0, 1, 2, 0];
    for &dtype in dtypes {
        for rows in 1..=4 {
            for predivide in [1.0, 2.0, 3.0, 0.3] {
                let grads = [
                    Some(dtype),
                    Some(dtypes[(rows + 1) % dtypes.len()]),
                    None,
                    Some(dtypes[rows % dtypes.len()]),
                    Some(DType::F32),
                    Some(dtype),
                ];
                let case = Case::new(rows, dtype, predivide, &numels, &extra, &grads, rows as u64);
                check::<B>(&case, dtypes);
            }
        }
    }
}

#[test]
fn flex_matches_reference_and_fallback() {
    sweep::<Flex>(&FLOATS);
}

#[test]
fn ndarray_matches_reference_and_fallback() {
    sweep::<NdArray>(&[DType::F32]);
}

#[test]
fn auto_takes_the_host_path_on_cpu_backends() {
    let spec = BucketSpec {
        rows: 2,
        row_len: 4,
        dtype: DType::F32,
        predivide: 1.0,
    };
    let device = Default::default();
    assert_eq!(
        Packer::<Flex>::new(spec, &device, PackPath::Auto)
            .unwrap()
            .path(),
        PackPath::Host
    );
    assert_eq!(
        Packer::<NdArray>::new(spec, &Default::default(), PackPath::Auto)
            .unwrap()
            .path(),
        PackPath::Host
    );
    assert_eq!(HostBackend::of::<Flex>(), Some(HostBackend::Flex));
    assert_eq!(HostBackend::of::<NdArray>(), Some(HostBackend::NdArray));
    // NdArray stores no f16: Auto keeps today's Burn-ops path, Host says why it cannot.
    let half = BucketSpec {
        dtype: DType::F16,
        ..spec
    };
    assert_eq!(
        Packer::<NdArray>::new(half, &Default::default(), PackPath::Auto)
            .unwrap()
            .path(),
        PackPath::Fallback
    );
    match Packer::<NdArray>::new(half, &Default::default(), PackPath::Host) {
        Err(error) => assert_eq!(
            error,
            KernelError::UnsupportedDType {
                dtype: DType::F16,
                path: "host"
            }
        ),
        Ok(_) => panic!("NdArray packed f16 on the host path"),
    }
}

/// A value of every kind: zeros of both signs, subnormals of each dtype, values that overflow
/// or underflow f16 and bf16, infinities and NaN.
fn special_values() -> Vec<f64> {
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        65504.0,
        65520.0,
        1e6,
        -3e38,
        3.4e38,
        6e-8,
        3e-8,
        1e-40,
        -1e-45,
        1.0 + f64::EPSILON,
        0.1,
        1.0 / 3.0,
        1e-5,
    ];
    values.extend(common::raw_values(5, 37).into_iter().map(|v| v * 1e3));
    values
}

/// Packs and unpacks special values of every dtype into buckets of every dtype; the host path
/// must give the fallback's bits, NaN included.
#[test]
fn flex_special_values_match_the_fallback() {
    let device = Default::default();
    let raw = special_values();
    for bucket_dtype in FLOATS {
        for grad_dtype in FLOATS {
            for predivide in [1.0, 3.0, 1e-3] {
                let values: Vec<f64> = raw
                    .iter()
                    .map(|&v| common::round_to(grad_dtype, v))
                    .collect();
                let n = values.len();
                let rows = 3;
                let len = n.div_ceil(rows) + 1;
                let spec = BucketSpec {
                    rows,
                    row_len: len + 2,
                    dtype: bucket_dtype,
                    predivide,
                };
                let members = [
                    MemberSpec {
                        numel: n,
                        len,
                        offset: 0,
                    },
                    MemberSpec {
                        numel: 5,
                        len: 2,
                        offset: len,
                    },
                ];
                let grads = [
                    Grad {
                        dtype: grad_dtype,
                        shape: vec![n],
                        values: values.clone(),
                    },
                    Grad {
                        dtype: grad_dtype,
                        shape: vec![5],
                        values: values[..5].to_vec(),
                    },
                ];
                let bucket = |path| {
                    let mut packer = Packer::<Flex>::new(spec, &device, path).unwrap();
                    for (member, grad) in members.iter().zip(&grads) {
                        packer
                            .push(member, Some(grad.primitive::<Flex>(&device)))
                            .unwrap();
                    }
                    packer.finish().unwrap()
                };
                let what = format!("{grad_dtype:?} into {bucket_dtype:?} / {predivide}");
                let host = bucket(PackPath::Host);
                let fallback = bucket(PackPath::Fallback);
                assert_bytes(&read::<Flex>(host.clone()), &read::<Flex>(fallback), &what);
                for dtype in FLOATS {
                    for postdivide in [1.0, 3.0, 1e-3] {
                        let part = |path| {
                            read::<Flex>(
                                unpack::<Flex>(&host, 3, 2 * len + 1, postdivide, dtype, path)
                                    .unwrap(),
                            )
                        };
                        assert_bytes(
                            &part(PackPath::Host),
                            &part(PackPath::Fallback),
                            &format!("{what}: unpack / {postdivide} to {dtype:?}"),
                        );
                    }
                }
            }
        }
    }
}

/// Byte equality (NaN-safe, unlike comparing values).
fn assert_bytes(actual: &TensorData, expected: &TensorData, what: &str) {
    assert_eq!(actual.dtype, expected.dtype, "{what}: dtype");
    assert_eq!(actual.shape, expected.shape, "{what}: shape");
    assert!(
        actual.as_bytes() == expected.as_bytes(),
        "{what}: bytes differ:\n{:?}\n{:?}",
        common::host(actual),
        common::host(expected)
    );
}

/// Strided gradients (a transposed view) and a reduced row that is a view at an odd offset
/// of a larger tensor read the same values as the fallback.
#[test]
fn views_match_the_fallback() {
    fn run<B: Backend>() {
        let device = Default::default();
        let grad = Grad::new(DType::F32, 3, 35, 2); // [5, 7]
        let transposed = B::float_swap_dims(grad.primitive::<B>(&device), 0, 1);
        let spec = BucketSpec {
            rows: 2,
            row_len: 19,
            dtype: DType::F32,
            predivide: 3.0,
        };
        let member = MemberSpec {
            numel: 35,
            len: 18,
            offset: 0,
        };
        let pad = MemberSpec {
            numel: 0,
            len: 1,
            offset: 18,
        };
        let bucket = |path| {
            let mut packer = Packer::<B>::new(spec, &device, path).unwrap();
            packer.push(&member, Some(transposed.clone())).unwrap();
            packer.push(&pad, None).unwrap();
            read::<B>(packer.finish().unwrap())
        };
        assert_bitwise(
            &bucket(PackPath::Host),
            &bucket(PackPath::Fallback),
            "transposed gradient",
        );

        let whole = Grad::new(DType::F32, 4, 101, 1).primitive::<B>(&device);
        let row = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(whole))
            .slice(13..90)
            .into_primitive()
            .tensor();
        for (offset, len) in [(0, 77), (5, 31), (76, 1)] {
            let part =
                |path| read::<B>(unpack::<B>(&row, offset, len, 3.0, DType::F32, path).unwrap());
            assert_bitwise(
                &part(PackPath::Host),
                &part(PackPath::Fallback),
                &format!("row view at 13, unpack {offset}..+{len}"),
            );
        }
    }
    run::<Flex>();
    run::<NdArray>();
}

/// The pool hands a bucket's memory to the next bucket once the first is dropped, and never
/// while a tensor still reads it.
#[test]
fn pool_reuses_only_released_buckets() {
    fn run<B: Backend>() {
        let device = Default::default();
        let pool = BufferPool::default();
        let first = Case::new(
            2,
            DType::F32,
            2.0,
            &[9, 4],
            &[1, 0],
            &[Some(DType::F32); 2],
            1,
        );
        let second = Case::new(
            2,
            DType::F32,
            2.0,
            &[9, 4],
            &[1, 0],
            &[Some(DType::F32); 2],
            2,
        );
        let bytes = first.spec.numel() * 4;
        let packed = |case: &Case| {
            let mut packer =
                Packer::<B>::with_pool(case.spec, &device, PackPath::Auto, &pool).unwrap();
            for (member, grad) in &case.members {
                packer
                    .push(member, grad.as_ref().map(|g| g.primitive::<B>(&device)))
                    .unwrap();
            }
            packer.finish().unwrap()
        };

        // Held: the second bucket gets other memory, the first keeps its values.
        let held = packed(&first);
        assert_eq!(pool.idle_bytes(), 0);
        let other = packed(&second);
        assert_bitwise(&read::<B>(held.clone()), &first.reference(), "held bucket");
        assert_bitwise(&read::<B>(other), &second.reference(), "second bucket");
        assert_eq!(
            pool.idle_bytes(),
            bytes,
            "the dropped second bucket is idle"
        );

        // Released: its buffer is packed again, and holds the new values.
        drop(held);
        assert_eq!(pool.idle_bytes(), 2 * bytes);
        let again = packed(&second);
        assert_eq!(pool.idle_bytes(), bytes, "one idle buffer was taken");
        assert_bitwise(&read::<B>(again), &second.reference(), "reused bucket");
    }
    run::<Flex>();
    run::<NdArray>();
}

/// Idle buffers beyond the pool's limit are released, oldest first; a kept buffer comes back
/// once idle, and is writable only while nothing else holds it.
#[test]
fn pool_keeps_at_most_its_idle_limit() {
    let pool = BufferPool::new(10 * 4);
    let backend = HostBackend::Flex;
    let mut last = std::ptr::null();
    for numel in [4, 5, 6] {
        let buffer = pool.take::<f32>(backend, numel);
        last = buffer.as_slice::<f32>().unwrap().as_ptr();
        pool.keep(&buffer);
    }
    // 4 + 5 + 6 idle elements are over the limit of 10: the next call trims the two oldest.
    assert_eq!(pool.idle_bytes(), 15 * 4);
    let small = pool.take::<f32>(backend, 3);
    assert_eq!(pool.idle_bytes(), 6 * 4);
    assert_eq!(
        small.as_slice::<f32>(),
        Some(&[0.0; 3][..]),
        "a new buffer is zeroed"
    );
    let mut reused = pool.take::<f32>(backend, 6);
    assert_eq!(pool.idle_bytes(), 0);
    assert_eq!(
        reused.as_slice::<f32>().unwrap().as_ptr(),
        last,
        "the idle buffer came back"
    );
    assert!(
        reused.as_mut_slice::<f32>().is_some(),
        "a taken buffer is writable"
    );
    let shared = reused.clone();
    assert!(
        reused.as_mut_slice::<f32>().is_none(),
        "a shared buffer is not"
    );
    drop(shared);
    let values = HostTensor::from_vec(backend, vec![1.0f32, 2.0]);
    assert_eq!(values.as_slice::<f32>(), Some(&[1.0, 2.0][..]));
    assert_eq!(values.as_slice::<f64>(), None);
}

#[test]
fn only_flex_and_ndarray_are_host_backends() {
    type Wgpu = burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    assert_eq!(HostBackend::of::<Wgpu>(), None);
    assert_eq!(HostBackend::of::<burn::backend::Wgpu>(), None);
    assert!(!HostBackend::NdArray.supports(DType::F16));
    assert!(HostBackend::Flex.supports(DType::BF16));
    assert!(!HostBackend::Flex.supports(DType::Flex32));
}
