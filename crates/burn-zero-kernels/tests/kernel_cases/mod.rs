//! The kernel-against-fallback cases, generic over the cubecl backend: `kernel_wgpu.rs` and
//! `kernel_cuda.rs` run the same cases through [`kernel_tests!`], each on its own runtime.
//! Buckets and unpacked shards must be bitwise identical on the two paths; the optimizer
//! kernels' steps bitwise the host pass's, with the runtime's rounding of multiply-adds.

#![allow(dead_code)]

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorData, TensorMetadata};
use burn_zero_kernels::{
    BucketSpec, GatheredMember, KernelError, MemberSpec, PackPath, Packer, cut_gathered,
    kernel_available, unpack,
};

use burn_zero_testing::skip;

use crate::common::{self, Case, Grad, assert_bitwise, read, reference_unpack};

/// Packs `case` on `path`; `strided` as in [`grad_for`].
pub fn pack<B: Backend>(
    case: &Case,
    path: PackPath,
    strided: bool,
    device: &B::Device,
) -> TensorData {
    let mut packer = Packer::<B>::new(case.spec, device, path).unwrap();
    assert_eq!(packer.uses_kernel(), path != PackPath::Fallback);
    for (member, grad) in &case.members {
        let grad = grad.as_ref().map(|g| grad_for::<B>(g, device, strided));
        packer.push(member, grad).unwrap();
    }
    read::<B>(packer.finish().unwrap())
}

/// The gradient on the device; `strided` gives 2-D gradients a non-contiguous layout (the
/// transpose of a transposed copy: same logical values, swapped strides).
pub fn grad_for<B: Backend>(
    grad: &Grad,
    device: &B::Device,
    strided: bool,
) -> B::FloatTensorPrimitive {
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
pub fn check<B: Backend>(case: &Case, strided: bool, device: &B::Device) {
    let spec = case.spec;
    let what = format!(
        "rows={} dtype={:?} predivide={} strided={strided}",
        spec.rows, spec.dtype, spec.predivide
    );
    leave_dirty_memory::<B>(case, device);
    let kernel = pack::<B>(case, PackPath::Kernel, strided, device);
    let fallback = pack::<B>(case, PackPath::Fallback, strided, device);
    assert_bitwise(&kernel, &fallback, &format!("pack {what}"));
    if spec.predivide == 1.0 {
        assert_bitwise(&kernel, &case.reference(), &format!("pack vs host {what}"));
    }

    for row in 0..spec.rows {
        let start = row * spec.row_len;
        let values = common::host(&kernel)[start..start + spec.row_len].to_vec();
        let row_data = common::data(spec.dtype, &values, [spec.row_len]);
        let reduced = Grad {
            dtype: spec.dtype,
            shape: vec![spec.row_len],
            values,
        }
        .primitive::<B>(device);
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
fn leave_dirty_memory<B: Backend>(case: &Case, device: &B::Device) {
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
    let bucket = pack::<B>(&dirty, PackPath::Kernel, false, device);
    assert!(common::host(&bucket).iter().all(|&v| v != 0.0));
}

/// A one-member f32 spec, for the detection and refusal checks.
fn small_spec(dtype: DType) -> BucketSpec {
    BucketSpec {
        rows: 1,
        row_len: 4,
        dtype,
        predivide: 1.0,
    }
}

/// `B` takes the kernel path, and a CPU backend does not.
pub fn kernel_is_detected<B: Backend>(device: &B::Device) {
    assert!(kernel_available::<B>());
    assert!(!kernel_available::<Flex>());
    assert!(
        Packer::<B>::new(small_spec(DType::F32), device, PackPath::Auto)
            .unwrap()
            .uses_kernel()
    );
}

/// Odd sizes (and so odd offsets), a member without a gradient, extra padding columns.
pub fn f32_odd_sizes_rows_and_divisors<B: Backend>(device: &B::Device) {
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
            check::<B>(&case, false, device);
        }
    }
}

/// Lengths and offsets that are multiples of 4: the kernels read and write vectors.
pub fn f32_vectorised_members<B: Backend>(device: &B::Device) {
    let case = Case::new(
        2,
        DType::F32,
        3.0,
        &[4096, 64, 8],
        &[0, 4, 0],
        &[Some(DType::F32), None, Some(DType::F32)],
        5,
    );
    check::<B>(&case, false, device);
}

/// 2-D gradients with swapped strides: read element by element through the view.
pub fn f32_strided_gradients<B: Backend>(device: &B::Device) {
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
    check::<B>(&case, true, device);
}

/// A member of a quarter million elements, over one and three rows.
pub fn f32_large_member<B: Backend>(device: &B::Device) {
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
        check::<B>(&case, false, device);
    }
}

/// Long members at odd offsets and of odd lengths, moved by the shifted kernels: neighbours
/// share vectors of the bucket within one launch, across launches (a gradient of the other
/// dtype and a member without one between them) and at the bucket's end, over rows whose
/// length the vectors divide; a member of whole vectors first; and more shifted members than
/// one launch takes. `bucket` is the bucket's dtype and most gradients'; `other` the one
/// gradient of another dtype. With half-precision buckets and gradients, CUDA moves 8 elements
/// a vector where wgpu moves at most 4.
fn shifted_members<B: Backend>(bucket: DType, other: DType, device: &B::Device) {
    let main = Some(bucket);
    let other = Some(other);
    for rows in [1, 2, 4] {
        let numels = [
            64 * rows,
            37 * rows,
            1029 * rows,
            19 * rows,
            2050 * rows,
            515 * rows,
            66 * rows,
        ];
        let grads = [main, main, main, None, other, main, main];
        // The last member's padding makes the row 8-aligned, except at one row.
        let mut extra = [0, 0, 0, 1, 0, 0, 0];
        let row_len: usize = numels.iter().map(|n| n / rows).sum::<usize>() + 1;
        if rows > 1 {
            extra[6] = row_len.next_multiple_of(8) - row_len;
        }
        for predivide in [1.0, 3.0] {
            let case = Case::new(rows, bucket, predivide, &numels, &extra, &grads, 3);
            check::<B>(&case, false, device);
        }
    }
    let numels: Vec<usize> = (0..21).map(|i| 1001 + 2 * i).collect();
    let case = Case::new(1, bucket, 2.0, &numels, &[0; 21], &[main; 21], 8);
    check::<B>(&case, false, device);
}

/// Whether `device` has `dtype`; where it has not, test `test` says it was skipped.
fn has_dtype<B: Backend>(test: &str, dtype: DType, device: &B::Device) -> bool {
    skip::dtype_supported(
        test,
        B::supports_dtype(device, dtype),
        format!("{dtype:?}"),
        "",
    )
}

/// [`shifted_members`] with f32 buckets and gradients (and one f16 gradient).
pub fn f32_shifted_members<B: Backend>(device: &B::Device) {
    shifted_members::<B>(DType::F32, DType::F16, device);
}

/// [`shifted_members`] with f16 buckets and gradients (and one f32 gradient), where the device
/// has f16.
pub fn f16_shifted_members<B: Backend>(device: &B::Device) {
    if has_dtype::<B>("f16_shifted_members", DType::F16, device) {
        shifted_members::<B>(DType::F16, DType::F32, device);
    }
}

/// [`shifted_members`] with bf16 buckets and gradients (and one f32 gradient), where the
/// device has bf16.
pub fn bf16_shifted_members<B: Backend>(device: &B::Device) {
    if has_dtype::<B>("bf16_shifted_members", DType::BF16, device) {
        shifted_members::<B>(DType::BF16, DType::F32, device);
    }
}

/// A chunk of `dtype` gathered from `ranks` ranks: each rank's row holds the members' blocks
/// end to end (`ceil(numel / ranks)` elements each), member `m`'s element `k` in row
/// `k / block` at its offset plus `k % block`; the padding is 7, which no member holds. Returns
/// the gathered tensor, the members and each member's values.
fn gathered_chunk<B: Backend>(
    dtype: DType,
    ranks: usize,
    numels: &[usize],
    device: &B::Device,
) -> (B::FloatTensorPrimitive, Vec<GatheredMember>, Vec<Vec<f64>>) {
    let (members, row) = common::gathered_members(ranks, numels);
    let mut gathered = vec![7.0; ranks * row];
    let mut values = Vec::new();
    for (m, member) in members.iter().enumerate() {
        let member_values: Vec<f64> = common::raw_values(m as u64 + 1, member.numel)
            .into_iter()
            .map(|v| common::round_to(dtype, v))
            .collect();
        for (k, &value) in member_values.iter().enumerate() {
            gathered[common::gathered_at(member, row, k)] = value;
        }
        values.push(member_values);
    }
    let data = common::data(dtype, &gathered, [gathered.len()]);
    let tensor = Tensor::<B, 1>::from_data(data, (device, dtype));
    (tensor.into_primitive().tensor(), members, values)
}

/// A gathered chunk's members cut out by the kernels, bitwise Burn's slices (the fallback) and
/// the values gathered: 1 to 4 ranks; members of odd lengths (shifted against the vector grid,
/// each rank's block at an odd offset) and of whole vectors; 20 members, more than one launch
/// takes.
fn gathered_cuts<B: Backend>(dtype: DType, device: &B::Device) {
    for ranks in 1..=4 {
        let odd: Vec<usize> = (0..20).map(|i| 1001 + 2 * i).collect();
        let whole: Vec<usize> = (0..20).map(|i| 8 * ranks * (64 + i)).collect();
        for numels in [odd, whole] {
            let (gathered, members, values) = gathered_chunk::<B>(dtype, ranks, &numels, device);
            let cut = |path| cut_gathered::<B>(&gathered, ranks, &members, path).unwrap();
            let (kernel, fallback) = (cut(PackPath::Kernel), cut(PackPath::Fallback));
            for (m, (got, reference)) in kernel.into_iter().zip(fallback).enumerate() {
                let what = format!("{dtype:?} cut, {ranks} ranks, member {m} of {}", numels[m]);
                let got = read::<B>(got);
                assert_bitwise(&got, &read::<B>(reference), &what);
                let expected = common::data(dtype, &values[m], [numels[m]]);
                assert_bitwise(&got, &expected, &format!("{what} vs the values gathered"));
            }
        }
    }
}

/// [`gathered_cuts`] of an f32 chunk.
pub fn f32_gathered_cuts<B: Backend>(device: &B::Device) {
    gathered_cuts::<B>(DType::F32, device);
}

/// [`gathered_cuts`] of an f16 chunk, where the device has f16.
pub fn f16_gathered_cuts<B: Backend>(device: &B::Device) {
    if has_dtype::<B>("f16_gathered_cuts", DType::F16, device) {
        gathered_cuts::<B>(DType::F16, device);
    }
}

/// [`gathered_cuts`] of a bf16 chunk, where the device has bf16.
pub fn bf16_gathered_cuts<B: Backend>(device: &B::Device) {
    if has_dtype::<B>("bf16_gathered_cuts", DType::BF16, device) {
        gathered_cuts::<B>(DType::BF16, device);
    }
}

/// A half-precision `dtype` (f16 or bf16) as the bucket dtype, the gradient dtype, or both; where
/// the device lacks it, the kernel path must refuse it rather than pack wrongly.
/// Where the device lacks it, the test (`test`) is reported as skipped: only the refusal ran.
fn half_precision<B: Backend>(test: &str, half: DType, device: &B::Device) {
    let supported = B::supports_dtype(device, half);
    if !supported {
        let error = Packer::<B>::new(small_spec(half), device, PackPath::Kernel)
            .err()
            .unwrap();
        assert_eq!(
            error,
            KernelError::UnsupportedDType {
                dtype: half,
                path: "kernel"
            }
        );
    }
    if !skip::dtype_supported(test, supported, format!("{half:?}"), "the kernel's refusal") {
        return;
    }
    for (dtype, grad) in [(half, DType::F32), (DType::F32, half), (half, half)] {
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
                check::<B>(&case, false, device);
            }
        }
    }
}

/// f16 buckets and gradients (or the refusal where the device has no f16).
pub fn f16<B: Backend>(device: &B::Device) {
    half_precision::<B>("f16", DType::F16, device);
}

/// bf16 buckets and gradients (or the refusal where the device has no bf16).
pub fn bf16<B: Backend>(device: &B::Device) {
    half_precision::<B>("bf16", DType::BF16, device);
}

/// A gradient on `other` (another device of the same backend) is refused on both paths.
pub fn gradient_on_another_device<B: Backend>(device: &B::Device, other: &B::Device) {
    let spec = small_spec(DType::F32);
    let member = MemberSpec {
        numel: 4,
        len: 4,
        offset: 0,
    };
    let grad = Grad::new(DType::F32, 8, 4, 1);
    for path in [PackPath::Kernel, PackPath::Fallback] {
        let mut packer = Packer::<B>::new(spec, device, path).unwrap();
        let error = packer
            .push(&member, Some(grad.primitive::<B>(other)))
            .unwrap_err();
        assert!(
            matches!(error, KernelError::DeviceMismatch { .. }),
            "{error}"
        );
        // The control: the same gradient on the bucket's device is accepted.
        packer
            .push(&member, Some(grad.primitive::<B>(device)))
            .unwrap();
    }
}

/// Values whose sums depend on the order they are added in (magnitudes over many decades),
/// with signed zeros (piece 0 holds `-0.0` where a fold from zero would give `+0.0`), ties and
/// infinities for max and min.
fn piece_values(parts: usize, len: usize, seed: u64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..parts * len)
        .map(|k| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let (part, i) = (k / len, k % len);
            match i % 11 {
                0 => -0.0,
                1 if part > 0 => 0.0,
                2 => 1.5,
                3 if part == parts - 1 => f64::INFINITY,
                _ => {
                    let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
                    let sign = if state & 1 == 0 { 1.0 } else { -1.0 };
                    sign * 10f64.powf(unit * 8.0 - 4.0)
                }
            }
        })
        .collect()
}

/// `reduce_pieces` (one launch) against Burn's ops folded over the pieces on the same device
/// (`+`, `max_pair`, `min_pair`, then `div_scalar` for a mean), bit for bit: 1 to 5 pieces,
/// lengths that take scalar and vector loads, every op, f32 and the half types the device has.
pub fn pieces_reduce_as_burns_fold<B: Backend>(device: &B::Device) {
    use burn::tensor::{Tensor, TensorPrimitive};
    use burn_zero_kernels::{PieceOp, reduce_pieces};
    let ops = [PieceOp::Sum, PieceOp::Mean, PieceOp::Max, PieceOp::Min];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        if !B::supports_dtype(device, dtype) {
            continue;
        }
        for parts in 1..=5 {
            for len in [1, 7, 4096, 4099] {
                let values = piece_values(parts, len, (parts * 7919 + len) as u64);
                let data = common::data(dtype, &values, [parts * len]);
                let all = Tensor::<B, 1>::from_data(data, (device, dtype));
                for op in ops {
                    let what = format!("{op:?}, {parts} piece(s) of {len}, {dtype:?}");
                    let primitive = all.clone().into_primitive().tensor();
                    let kernel = reduce_pieces::<B>(primitive, parts, op)
                        .expect("the backend has kernels")
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let piece = |p: usize| all.clone().slice(p * len..(p + 1) * len);
                    let mut fold = piece(0);
                    for p in 1..parts {
                        fold = match op {
                            PieceOp::Sum | PieceOp::Mean => fold + piece(p),
                            PieceOp::Max => fold.max_pair(piece(p)),
                            PieceOp::Min => fold.min_pair(piece(p)),
                        };
                    }
                    if op == PieceOp::Mean && parts > 1 {
                        fold = fold.div_scalar(parts as f64);
                    }
                    let kernel = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(kernel));
                    assert_bitwise(&kernel.into_data(), &fold.into_data(), &what);
                }
            }
        }
    }
    // A length that does not split is refused by name, nothing launched.
    let all = Tensor::<B, 1>::zeros([10], device)
        .into_primitive()
        .tensor();
    let error = reduce_pieces::<B>(all, 3, PieceOp::Sum)
        .unwrap()
        .unwrap_err();
    assert_eq!(
        error,
        KernelError::UnevenPieces {
            numel: 10,
            parts: 3
        }
    );
}

/// A step's values: [`common::raw_values`] in f32, with exact zeros of both signs.
fn step_values(n: usize, seed: u64) -> Vec<f32> {
    common::raw_values(seed, n)
        .into_iter()
        .enumerate()
        .map(|(i, value)| match i % 97 {
            0 => 0.0,
            1 => -0.0,
            _ => value as f32,
        })
        .collect()
}

/// A half-precision copy the kernel wrote, against Burn's cast of the kernel's new parameter to
/// `dtype` on the same device, bit for bit (the dtype included).
fn assert_copy_is_burns_cast<B: Backend>(
    copy: Option<B::FloatTensorPrimitive>,
    param: &B::FloatTensorPrimitive,
    dtype: Option<DType>,
    what: &str,
) {
    use burn::tensor::TensorPrimitive;
    let Some(dtype) = dtype else {
        assert!(copy.is_none(), "{what}: a copy nobody asked for");
        return;
    };
    let copy = read::<B>(copy.unwrap_or_else(|| panic!("{what}: no copy")));
    let cast = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(param.clone())).cast(dtype);
    assert_bitwise(&copy, &cast.into_data(), &format!("{what}: copy"));
}

/// The optimizer kernels with a gradient multiplier and a half-precision copy, the way
/// `ZeroOptimizer`'s one pass calls them: Adam (with L2), AdamW and SGD (Nesterov momentum
/// with L2, and plain), 30 steps each with the factor on two steps of three, without a copy and
/// with one in each half dtype the device stores. Parameter, moments and velocity equal the
/// host pass with the multiply-adds rounded as `B`'s kernels round them
/// (`kernel_multiply_add`: separately on wgpu, fused on CUDA) bit for bit; the copy equals
/// Burn's cast of the kernel's parameter on the device.
pub fn optimizer_steps_with_factor_and_copy<B: Backend>(device: &B::Device) {
    use burn_zero_kernels::host::{
        AdamRule, AdamStep, SgdMomentum, SgdStep, adam_step_with, sgd_step_with,
    };
    use burn_zero_kernels::{
        adam_step_kernel_copying, kernel_multiply_add, sgd_step_kernel_copying,
    };
    let rounding = kernel_multiply_add::<B>().expect("the backend has kernels");
    let n = 4099;
    let upload = |values: &[f32]| -> B::FloatTensorPrimitive {
        Tensor::<B, 1>::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
            .into_primitive()
            .tensor()
    };
    // The device's values bit for bit the host pass's.
    let same = |device: &B::FloatTensorPrimitive, host: &[f32], what: String| {
        let host = TensorData::new(host.to_vec(), [host.len()]);
        assert_bitwise(&read::<B>(device.clone()), &host, &what);
    };
    let copies = [None, Some(DType::F16), Some(DType::BF16)]
        .into_iter()
        .filter(|copy| copy.is_none_or(|dtype| B::supports_dtype(device, dtype)));
    for copy in copies {
        let rules = [
            AdamRule::Adam {
                weight_decay: Some(0.01),
            },
            AdamRule::AdamW { keep: Some(0.9995) },
        ];
        for rule in rules {
            let (mut hp, mut hm, mut hv) = (step_values(n, 1), vec![0.0f32; n], vec![0.0f32; n]);
            let (mut p, mut moments) = (upload(&hp), None);
            for t in 1..=30 {
                let g = step_values(n, 100 + t as u64);
                let step = AdamStep {
                    rule,
                    lr: 1e-2,
                    beta_1: 0.9,
                    beta_2: 0.999,
                    epsilon: 1e-5,
                    time: t,
                    factor: (t % 3 != 0).then_some(0.37),
                };
                let (np, nm, nv, written) =
                    adam_step_kernel_copying::<B>(&step, p, upload(&g), moments, copy)
                        .expect("the backend has kernels")
                        .unwrap();
                adam_step_with(&step, rounding, &mut hp, &g, &mut hm, &mut hv, 1);
                let what = format!("{rule:?}, copy {copy:?}, step {t}");
                assert_copy_is_burns_cast::<B>(written, &np, copy, &what);
                same(&np, &hp, format!("{what}: parameter"));
                same(&nm, &hm, format!("{what}: m"));
                same(&nv, &hv, format!("{what}: v"));
                (p, moments) = (np, Some((nm, nv)));
            }
        }
        for momentum in [Some(true), None] {
            let (mut hp, mut hv) = (step_values(n, 2), vec![0.0f32; n]);
            let (mut p, mut velocity) = (upload(&hp), None);
            for t in 0..30 {
                let g = step_values(n, 200 + t as u64);
                let step = SgdStep {
                    lr: 1e-2,
                    weight_decay: Some(0.01),
                    momentum: momentum.map(|nesterov| SgdMomentum {
                        momentum: 0.9,
                        keep_grad: 0.9,
                        nesterov,
                        first: t == 0,
                    }),
                    factor: (t % 3 != 2).then_some(0.37),
                };
                let (np, nv, written) =
                    sgd_step_kernel_copying::<B>(&step, p, upload(&g), velocity, copy)
                        .expect("the backend has kernels")
                        .unwrap();
                sgd_step_with(&step, rounding, &mut hp, &g, Some(&mut hv), 1);
                let what = format!("SGD, Nesterov {momentum:?}, copy {copy:?}, step {t}");
                assert_copy_is_burns_cast::<B>(written, &np, copy, &what);
                same(&np, &hp, format!("{what}: parameter"));
                assert_eq!(nv.is_some(), momentum.is_some(), "{what}");
                if let Some(nv) = &nv {
                    same(nv, &hv, format!("{what}: velocity"));
                }
                (p, velocity) = (np, nv);
            }
        }
    }
}

/// One `#[test]` per shared case on backend `$backend`. `$device` is a function of the test's
/// name that returns the device, or `None` after saying why the test is skipped.
#[macro_export]
macro_rules! kernel_tests {
    ($backend:ty, $device:path) => {
        $crate::kernel_tests!(@cases $backend, $device,
            kernel_is_detected,
            f32_odd_sizes_rows_and_divisors,
            f32_vectorised_members,
            f32_strided_gradients,
            f32_large_member,
            f32_shifted_members,
            f16_shifted_members,
            bf16_shifted_members,
            f32_gathered_cuts,
            f16_gathered_cuts,
            bf16_gathered_cuts,
            f16,
            bf16,
            pieces_reduce_as_burns_fold,
            optimizer_steps_with_factor_and_copy,
        );
    };
    (@cases $backend:ty, $device:path, $($case:ident,)*) => {
        $(
            #[test]
            fn $case() {
                let Some(device) = $device(stringify!($case)) else {
                    return;
                };
                $crate::kernel_cases::$case::<$backend>(&device);
            }
        )*
    };
}
