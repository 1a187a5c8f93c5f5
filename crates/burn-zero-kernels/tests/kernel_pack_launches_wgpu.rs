//! Kernel launches per bucket pack and per reduced row's unpack on wgpu, counted at the backend
//! boundary by [`LaunchLog`] (cubecl's execution log, turned on before any wgpu client exists).
//!
//! Targets: contiguous gradients of one dtype and vector width are packed in batches, so a
//! bucket of M such members takes ⌈M / batch⌉ launches, not M; the batch is 16 members, fewer
//! where the device binds fewer buffers to a kernel (the bucket and the scalars take two).
//! Strided gradients and members without a gradient take a launch each. A reduced row whose
//! parts keep its dtype is divided in one launch (none without a divisor), not one per part.
//! An all-gathered chunk's members are cut out in batches too (⌈M / batch⌉ launches for M
//! members of one vector width), and at one rank a member whose range lies at the device's
//! memory alignment is a view, no launch. Every bucket, part and member is compared bit for bit
//! with the Burn-ops fallback's, and every member with the values put into the gather.
//!
//! Without a wgpu adapter every test says it was skipped, unless `BURN_ZERO_REQUIRE_WGPU=1`
//! (CI) makes that a failure.

mod common;

use std::sync::{Mutex, MutexGuard};

use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_zero_kernels::{
    BucketSpec, GatheredMember, LaunchLog, MemberSpec, PackPath, Packer, RowPart, cut_gathered,
    unpack, unpack_row,
};
use burn_zero_testing::skip;
use cubecl::Runtime;

type Plain = CubeBackend<WgpuRuntime, f32, i32, u32>;
type Primitive = <Plain as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive;

/// The log counts every launch on the device in a window, so the tests take turns: one
/// test's work outside its windows must not fall into another's.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Whether `test` can run (a wgpu adapter), with the launch log turned on first, and the turn
/// to hold while it runs.
fn runs(test: &str) -> Option<MutexGuard<'static, ()>> {
    LaunchLog::install();
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    skip::wgpu_adapter(test).then_some(turn)
}

/// Members of `numels` elements, one after another in rows of `rows` (lengths padded to a
/// multiple of 4, so every member is read and written in vectors of the same width).
fn layout(rows: usize, numels: &[usize]) -> (BucketSpec, Vec<MemberSpec>) {
    let mut offset = 0;
    let members = numels
        .iter()
        .map(|&numel| {
            let len = numel.div_ceil(rows).next_multiple_of(4);
            let member = MemberSpec { numel, len, offset };
            offset += len;
            member
        })
        .collect();
    let spec = BucketSpec {
        rows,
        row_len: offset,
        dtype: DType::F32,
        predivide: 2.0,
    };
    (spec, members)
}

fn values(numel: usize, seed: usize) -> Vec<f32> {
    (0..numel)
        .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) / 25.0)
        .collect()
}

fn flat(numel: usize, seed: usize, device: &WgpuDevice) -> Primitive {
    Tensor::<Plain, 1>::from_data(TensorData::new(values(numel, seed), [numel]), device)
        .into_primitive()
        .tensor()
}

/// Every member of `specs` with a contiguous gradient of its own values.
fn gradients(specs: &[MemberSpec], device: &WgpuDevice) -> Vec<(MemberSpec, Option<Primitive>)> {
    specs
        .iter()
        .enumerate()
        .map(|(i, m)| (*m, Some(flat(m.numel, i, device))))
        .collect()
}

/// A `[a, b]` gradient stored transposed: the same logical values, swapped strides.
fn strided(a: usize, b: usize, seed: usize, device: &WgpuDevice) -> Primitive {
    let stored =
        Tensor::<Plain, 1>::from_data(TensorData::new(values(a * b, seed), [a * b]), device)
            .reshape([b, a]);
    stored.swap_dims(0, 1).into_primitive().tensor()
}

/// Packs on `path` and returns the bucket's bytes and the kernels launched meanwhile.
fn pack(
    spec: BucketSpec,
    members: &[(MemberSpec, Option<Primitive>)],
    path: PackPath,
    device: &WgpuDevice,
) -> (Vec<u8>, Vec<String>) {
    let (bucket, launched) = LaunchLog::install()
        .launches::<WgpuRuntime, _>(device, || {
            let mut packer = Packer::<Plain>::new(spec, device, path).unwrap();
            for (member, grad) in members {
                packer.push(member, grad.clone()).unwrap();
            }
            let bucket = packer.finish().unwrap();
            Plain::sync(device).unwrap();
            bucket
        })
        .expect("the launches are counted");
    let bytes = Tensor::<Plain, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(bucket))
        .into_data()
        .bytes
        .to_vec();
    (bytes, launched)
}

/// How many of `launched` are the kernel named `name` (cubecl logs the kernel's type name).
fn count(launched: &[String], name: &str) -> usize {
    launched
        .iter()
        .filter(|line| {
            line.split(|c: char| !c.is_alphanumeric() && c != '_')
                .any(|word| word == name)
        })
        .count()
}

/// The members one batch launch takes on `device`, from the binding limit the device reports.
fn batch(device: &WgpuDevice) -> usize {
    let bindings = WgpuRuntime::client(device)
        .properties()
        .hardware
        .max_bindings as usize;
    bindings.saturating_sub(2).clamp(1, 16)
}

#[test]
fn contiguous_gradients_are_packed_in_batches() {
    let Some(_turn) = runs("contiguous_gradients_are_packed_in_batches") else {
        return;
    };
    let device = WgpuDevice::default();
    let batch = batch(&device);
    for rows in [1, 4] {
        // 7 members: the benchmark bucket's count; 20: more than one batch on any device.
        for members in [7usize, 20] {
            let numels: Vec<usize> = (0..members)
                .map(|i| if i + 1 == members { 1024 } else { 4096 })
                .collect();
            let (spec, specs) = layout(rows, &numels);
            let grads = gradients(&specs, &device);
            let (kernel, launched) = pack(spec, &grads, PackPath::Kernel, &device);
            let what = format!("{members} members over {rows} rows, batch {batch}");
            let expected = members.div_ceil(batch);
            let batched = count(&launched, "PackMembers");
            assert_eq!(batched, expected, "{what}: {launched:#?}");
            assert_eq!(
                launched.len(),
                expected,
                "{what}: only pack launches: {launched:#?}"
            );
            let (fallback, _) = pack(spec, &grads, PackPath::Fallback, &device);
            assert!(
                kernel == fallback,
                "{what}: the bucket differs from the fallback's"
            );
            println!("{what}: {expected} launch(es): {launched:?}");
        }
    }
}

#[test]
fn shifted_gradients_are_packed_in_batches() {
    let Some(_turn) = runs("shifted_gradients_are_packed_in_batches") else {
        return;
    };
    let device = WgpuDevice::default();
    let batch = batch(&device);
    if widest(&device, 4) == 1 {
        println!(
            "SKIPPED: shifted_gradients_are_packed_in_batches: the device moves no f32 vectors"
        );
        return;
    }
    for rows in [1, 4] {
        for members in [7usize, 20] {
            // Odd lengths, so odd offsets after the first; the last member's padding keeps a
            // row of several a whole number of 8-element vectors.
            let mut offset = 0;
            let mut specs: Vec<MemberSpec> = (0..members)
                .map(|i| {
                    let len = 1001 + 2 * i;
                    let member = MemberSpec {
                        numel: rows * len - i % 2,
                        len,
                        offset,
                    };
                    offset += len;
                    member
                })
                .collect();
            if rows > 1 {
                let last = specs.last_mut().unwrap();
                last.len += offset.next_multiple_of(8) - offset;
                offset = offset.next_multiple_of(8);
            }
            let spec = BucketSpec {
                rows,
                row_len: offset,
                dtype: DType::F32,
                predivide: 2.0,
            };
            let grads = gradients(&specs, &device);
            let (kernel, launched) = pack(spec, &grads, PackPath::Kernel, &device);
            let what = format!("{members} odd members over {rows} rows, batch {batch}");
            // Widths are powers of two: a member moves one element at a time on both sides
            // exactly when one of its sizes is odd (the row's counts from two rows on).
            let row = if rows > 1 { offset } else { 0 };
            let shifted = specs
                .iter()
                .filter(|m| [m.numel, m.len, m.offset, row].iter().any(|n| n % 2 == 1))
                .count();
            assert!(shifted + 1 >= members, "{what}: {shifted} shifted");
            let expected = shifted.div_ceil(batch);
            let aligned = (members - shifted).div_ceil(batch);
            assert_eq!(
                count(&launched, "PackShifted"),
                expected,
                "{what}: {launched:#?}"
            );
            assert_eq!(
                count(&launched, "PackMembers"),
                aligned,
                "{what}: {launched:#?}"
            );
            assert_eq!(launched.len(), expected + aligned, "{what}: {launched:#?}");
            let (fallback, _) = pack(spec, &grads, PackPath::Fallback, &device);
            assert!(
                kernel == fallback,
                "{what}: the bucket differs from the fallback's"
            );
        }
    }
}

#[test]
fn strided_and_missing_gradients_take_a_launch_each() {
    let Some(_turn) = runs("strided_and_missing_gradients_take_a_launch_each") else {
        return;
    };
    let device = WgpuDevice::default();
    if batch(&device) < 2 {
        println!(
            "SKIPPED: strided_and_missing_gradients_take_a_launch_each: the device binds too few buffers to batch"
        );
        return;
    }
    let (spec, specs) = layout(2, &[4096, 1024, 64 * 48, 512, 2048, 256]);
    let grads = vec![
        (specs[0], Some(flat(4096, 0, &device))),
        (specs[1], Some(flat(1024, 1, &device))),
        (specs[2], Some(strided(64, 48, 2, &device))),
        (specs[3], Some(flat(512, 3, &device))),
        (specs[4], None),
        (specs[5], Some(flat(256, 5, &device))),
    ];
    let (kernel, launched) = pack(spec, &grads, PackPath::Kernel, &device);
    // Member 2 (strided) and member 4's zeros at once, a launch each; members 0, 1, 3 and 5
    // (contiguous, one dtype, one width) in one batch at the finish.
    assert_eq!(count(&launched, "PackMembers"), 2, "{launched:#?}");
    assert_eq!(count(&launched, "ZeroMember"), 1, "{launched:#?}");
    assert_eq!(launched.len(), 3, "{launched:#?}");
    let (fallback, _) = pack(spec, &grads, PackPath::Fallback, &device);
    assert!(kernel == fallback, "the bucket differs from the fallback's");
}

fn bytes(tensor: Primitive) -> Vec<u8> {
    Tensor::<Plain, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(tensor))
        .into_data()
        .bytes
        .to_vec()
}

/// Parts of a reduced row (f32, like the row) at odd offsets and of odd lengths.
fn row_parts(lens: &[usize], dtype: DType) -> Vec<RowPart> {
    let mut offset = 0;
    lens.iter()
        .map(|&len| {
            let part = RowPart { offset, len, dtype };
            offset += len;
            part
        })
        .collect()
}

/// Unpacks `parts` of `row` on the kernel path and returns the launches, after checking each
/// part bit for bit against its own unpack on the fallback and kernel paths.
fn unpack_counted(
    row: &Primitive,
    parts: &[RowPart],
    postdivide: f64,
    device: &WgpuDevice,
    what: &str,
) -> Vec<String> {
    let (unpacked, launched) = LaunchLog::install()
        .launches::<WgpuRuntime, _>(device, || {
            let parts = unpack_row::<Plain>(row.clone(), parts, postdivide, PackPath::Kernel, None)
                .unwrap();
            Plain::sync(device).unwrap();
            parts
        })
        .expect("the launches are counted");
    for (i, (part, got)) in parts.iter().zip(unpacked).enumerate() {
        let one = |path| {
            let part = unpack::<Plain>(row, part.offset, part.len, postdivide, part.dtype, path);
            bytes(part.unwrap())
        };
        let got = bytes(got);
        assert!(
            got == one(PackPath::Fallback),
            "{what}: part {i} differs from the fallback's"
        );
        assert!(
            got == one(PackPath::Kernel),
            "{what}: part {i} differs from its own launch's"
        );
    }
    launched
}

/// The widest vector of `bytes`-byte elements the device moves.
fn widest(device: &WgpuDevice, bytes: usize) -> usize {
    WgpuRuntime::client(device)
        .io_optimized_vector_sizes(bytes)
        .next()
        .unwrap_or(1)
}

#[test]
fn a_rows_parts_are_unpacked_in_batches() {
    let Some(_turn) = runs("a_rows_parts_are_unpacked_in_batches") else {
        return;
    };
    let device = WgpuDevice::default();
    let batch = batch(&device);
    for count_parts in [5usize, 20] {
        for postdivide in [2.0, 3.0, 1.0] {
            // Lengths and offsets that are multiples of 4: one width, so ⌈parts / batch⌉
            // launches; without a divisor every part is the row's slice, no unpack launch.
            let lens: Vec<usize> = (0..count_parts).map(|i| 1024 + 8 * i).collect();
            let parts = row_parts(&lens, DType::F32);
            let row = flat(lens.iter().sum(), 9, &device);
            let what = format!("{count_parts} parts, postdivide {postdivide}, batch {batch}");
            let expected = if postdivide == 1.0 {
                0
            } else {
                count_parts.div_ceil(batch)
            };
            let launched = unpack_counted(&row, &parts, postdivide, &device, &what);
            assert_eq!(count(&launched, "UnpackMembers"), expected, "{what}");
            assert_eq!(launched.len(), expected, "{what}: {launched:#?}");

            // Odd lengths: parts of up to three widths (1, 2, 4 elements). A part at an odd
            // offset or of an odd length is shifted against the grid: the shifted kernel
            // moves it in vectors too, a batch of them a launch.
            let lens: Vec<usize> = (0..count_parts).map(|i| 1024 + 7 * i).collect();
            let parts = row_parts(&lens, DType::F32);
            let row_len: usize = lens.iter().sum();
            let row = flat(row_len, 11, &device);
            let what = format!("odd {what}");
            let launched = unpack_counted(&row, &parts, postdivide, &device, &what);
            let shifted = parts
                .iter()
                .filter(|p| [p.offset, p.len, row_len].iter().any(|n| n % 2 == 1))
                .count();
            assert!(shifted > 0 && shifted < count_parts, "{what}: {shifted}");
            let expected = match (postdivide == 1.0, widest(&device, 4) > 1) {
                (true, _) => 0,
                (false, true) => shifted.div_ceil(batch),
                (false, false) => 0,
            };
            assert_eq!(count(&launched, "UnpackShifted"), expected, "{what}");
            let most = if postdivide == 1.0 {
                0
            } else {
                3 * count_parts.div_ceil(batch)
            };
            let unpacks = count(&launched, "UnpackMembers") + count(&launched, "UnpackShifted");
            assert!(
                unpacks <= most,
                "{what}: {unpacks} unpack launches, at most {most}"
            );
        }
    }
}

/// A chunk of members of `numels` elements gathered from `ranks` ranks: each rank's row is
/// the members' blocks end to end (`ceil(numel / ranks)` elements each, padded), member `m`'s
/// element `k` sits in row `k / block` at its offset plus `k % block` and is
/// `values(numel, m)[k]`; padding is NaN, which must never be read. Returns the gathered
/// tensor and the members.
fn gathered_chunk(
    ranks: usize,
    numels: &[usize],
    device: &WgpuDevice,
) -> (Primitive, Vec<GatheredMember>) {
    let (members, row) = common::gathered_members(ranks, numels);
    let mut data = vec![f32::NAN; ranks * row];
    for (m, member) in members.iter().enumerate() {
        for (k, value) in values(member.numel, m).into_iter().enumerate() {
            data[common::gathered_at(member, row, k)] = value;
        }
    }
    let tensor = Tensor::<Plain, 1>::from_data(TensorData::new(data, [ranks * row]), device);
    (tensor.into_primitive().tensor(), members)
}

#[test]
fn a_gathered_chunks_members_are_cut_in_batches() {
    let Some(_turn) = runs("a_gathered_chunks_members_are_cut_in_batches") else {
        return;
    };
    let device = WgpuDevice::default();
    let batch = batch(&device);
    for ranks in [1, 2, 3, 4] {
        for count_members in [5usize, 20] {
            // Odd lengths: every member is shifted against the vector grid, one batch kind
            // (the shifted kernel, where the device has vectors); at one rank, odd offsets are
            // never at the alignment.
            let odd: Vec<usize> = (0..count_members).map(|i| 1001 + 2 * i).collect();
            // Blocks of whole vectors (several ranks: no member is a view).
            let even: Vec<usize> = (0..count_members).map(|i| 4 * ranks * (64 + i)).collect();
            let layouts = if ranks == 1 {
                vec![odd]
            } else {
                vec![odd, even]
            };
            for numels in layouts {
                let (gathered, members) = gathered_chunk(ranks, &numels, &device);
                let what = format!(
                    "{ranks} ranks, {count_members} members of {}.., batch {batch}",
                    numels[0]
                );
                let (cut, launched) = LaunchLog::install()
                    .launches::<WgpuRuntime, _>(&device, || {
                        let cut =
                            cut_gathered::<Plain>(&gathered, ranks, &members, PackPath::Kernel);
                        Plain::sync(&device).unwrap();
                        cut.unwrap()
                    })
                    .expect("the launches are counted");
                let fallback =
                    cut_gathered::<Plain>(&gathered, ranks, &members, PackPath::Fallback).unwrap();
                for (m, (got, reference)) in cut.into_iter().zip(fallback).enumerate() {
                    let got = bytes(got);
                    assert!(
                        got == bytes(reference),
                        "{what}: member {m} differs from the fallback's"
                    );
                    let want: Vec<u8> = values(numels[m], m)
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect();
                    assert!(got == want, "{what}: member {m} is not the values gathered");
                }
                let expected = count_members.div_ceil(batch);
                let shifted = if numels[0] % 2 == 1 && widest(&device, 4) > 1 {
                    expected
                } else {
                    0
                };
                assert_eq!(count(&launched, "CutShifted"), shifted, "{what}");
                assert_eq!(count(&launched, "CutMembers"), expected - shifted, "{what}");
                assert_eq!(launched.len(), expected, "{what}: nothing else launched");
            }
        }
    }
    // One rank, every member at the alignment (whole KiBs of f32 at offsets of whole KiBs):
    // each is a view of the row.
    let numels: Vec<usize> = (0..5).map(|i| 1024 * (i + 1)).collect();
    let (gathered, members) = gathered_chunk(1, &numels, &device);
    let (cut, launched) = LaunchLog::install()
        .launches::<WgpuRuntime, _>(&device, || {
            cut_gathered::<Plain>(&gathered, 1, &members, PackPath::Kernel).unwrap()
        })
        .expect("the launches are counted");
    assert!(
        launched.is_empty(),
        "aligned members at one rank: {launched:?}"
    );
    for (m, got) in cut.into_iter().enumerate() {
        let want: Vec<u8> = values(numels[m], m)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(bytes(got) == want, "aligned member {m}");
    }
}
