//! Pack and unpack bandwidth on a CUDA device (feature `cuda`) against a device-to-device copy
//! of the same bytes, for the GPU check (`scripts/gpu-check.sh`).
//!
//! The bucket is what the 50M-parameter benchmark model fills: 25 MiB of f32 with members of
//! 4 MiB (six of them, and one of 1 MiB to fill it), packed as 1 rank row (world size 1) and as
//! 8 rows, with and without a predivide factor. The copy is Burn's own device copy kernel
//! (`CubeTensor::copy`, vectorised) of a 25 MiB tensor. GB/s counts bytes read plus bytes
//! written (1 GB = 1e9 bytes): every path reads and writes the bucket once, so the ratio to the
//! copy is the fraction of copy bandwidth reached (the goal is at least 0.8).
//!
//! The pack is one `Packer` filled member by member, the unpack one `unpack_row` over the row's
//! members, as the gradient buckets run them: the kernels take up to 16 members in a launch,
//! so each is one launch here.
//!
//! A GPU runs the 25 MiB in tens of microseconds, so each sample times a batch of calls with
//! one device synchronisation at the end. Prints a table; `PACK_CUDA_REPORT=path` also writes
//! JSON there. Without a CUDA device it says it was skipped (and writes `{"skipped": ...}`).

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_zero_kernels::{BucketSpec, MemberSpec, PackPath, Packer, RowPart, unpack_row};
use criterion::Criterion;
use cubecl::cuda::{CudaDevice, CudaRuntime};

type B = CubeBackend<CudaRuntime, f32, i32, u8>;

const MIB: usize = 1 << 20;
/// Bucket bytes: 25 MiB of f32.
const BUCKET_BYTES: usize = 25 * MIB;
/// Member sizes in elements: six of 4 MiB and one of 1 MiB.
const MEMBER_NUMELS: [usize; 7] = [MIB, MIB, MIB, MIB, MIB, MIB, MIB / 4];

/// (label, bytes moved per call, calls and elapsed time of each sample).
type Samples = Vec<(String, usize, Vec<(u64, Duration)>)>;
static TIMES: Mutex<Samples> = Mutex::new(Vec::new());

fn record(label: &str, bytes: usize, iters: u64, elapsed: Duration) {
    let mut times = TIMES.lock().unwrap();
    match times.iter_mut().find(|(l, ..)| l == label) {
        Some((.., list)) => list.push((iters, elapsed)),
        None => times.push((label.to_string(), bytes, vec![(iters, elapsed)])),
    }
}

/// The bucket of `rows` rank rows; members padded to a multiple of `rows`.
fn layout(rows: usize, predivide: f64) -> (BucketSpec, Vec<MemberSpec>) {
    let mut offset = 0;
    let members: Vec<MemberSpec> = MEMBER_NUMELS
        .iter()
        .map(|&numel| {
            let len = numel.div_ceil(rows);
            let member = MemberSpec { numel, len, offset };
            offset += len;
            member
        })
        .collect();
    let spec = BucketSpec {
        rows,
        row_len: offset,
        dtype: DType::F32,
        predivide,
    };
    (spec, members)
}

fn tensor(numel: usize, seed: usize, device: &CudaDevice) -> Tensor<B, 1> {
    let values: Vec<f32> = (0..numel)
        .map(|i| ((i * 7 + seed * 13) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    Tensor::<B, 1>::from_data(TensorData::new(values, [numel]), device)
}

/// Times `call` in batches with one synchronisation per batch.
fn bench(c: &mut Criterion, label: &str, bytes: usize, device: &CudaDevice, call: impl Fn()) {
    c.bench_function(label, |b| {
        b.iter_custom(|iters| {
            B::sync(device).unwrap();
            let start = Instant::now();
            for _ in 0..iters {
                call();
            }
            B::sync(device).unwrap();
            let elapsed = start.elapsed();
            record(label, bytes, iters, elapsed);
            elapsed
        })
    });
}

fn run(c: &mut Criterion, device: &CudaDevice) {
    let source = tensor(BUCKET_BYTES / 4, 1, device)
        .into_primitive()
        .tensor();
    bench(
        c,
        "copy (CubeTensor::copy)",
        2 * BUCKET_BYTES,
        device,
        || {
            black_box(source.copy());
        },
    );
    for rows in [1, 8] {
        for predivide in [1.0, 2.0] {
            let (spec, members) = layout(rows, predivide);
            let grads: Vec<_> = members
                .iter()
                .enumerate()
                .map(|(i, m)| tensor(m.numel, i, device).into_primitive().tensor())
                .collect();
            let moved = 2 * MEMBER_NUMELS.iter().sum::<usize>() * 4;
            let label = format!("pack rows={rows} predivide={predivide}");
            bench(c, &label, moved, device, || {
                let mut packer = Packer::<B>::new(spec, device, PackPath::Kernel).unwrap();
                for (member, grad) in members.iter().zip(&grads) {
                    packer.push(member, Some(grad.clone())).unwrap();
                }
                black_box(packer.finish().unwrap());
            });
            if rows == 1 {
                let row = tensor(spec.row_len, 99, device).into_primitive().tensor();
                let label = format!("unpack rows={rows} postdivide={predivide}");
                let parts: Vec<RowPart> = members
                    .iter()
                    .map(|m| RowPart {
                        offset: m.offset,
                        len: m.len,
                        dtype: DType::F32,
                    })
                    .collect();
                // What the gradient buckets run: every member of the row in one call.
                bench(c, &label, moved, device, || {
                    let unpacked =
                        unpack_row::<B>(row.clone(), &parts, predivide, PackPath::Kernel, None);
                    black_box(unpacked.unwrap());
                });
            }
        }
    }
}

/// Median seconds per call over the samples.
fn per_call(samples: &[(u64, Duration)]) -> f64 {
    let mut values: Vec<f64> = samples
        .iter()
        .map(|(iters, elapsed)| elapsed.as_secs_f64() / *iters as f64)
        .collect();
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn report() -> serde_json::Value {
    let times = TIMES.lock().unwrap().clone();
    let copy = times
        .iter()
        .find(|(label, ..)| label.starts_with("copy"))
        .map(|(_, bytes, samples)| *bytes as f64 / per_call(samples) / 1e9);
    let mut table = String::from(
        "| path | bytes moved | median time | GB/s | of copy |\n|---|---|---|---|---|\n",
    );
    let mut rows = Vec::new();
    for (label, bytes, samples) in &times {
        let seconds = per_call(samples);
        let gbps = *bytes as f64 / seconds / 1e9;
        let ratio = copy.map(|c| gbps / c);
        table += &format!(
            "| {label} | {:.1} MB | {:.1} µs | {gbps:.0} | {} |\n",
            *bytes as f64 / 1e6,
            seconds * 1e6,
            ratio.map_or("-".into(), |r| format!("{:.0}%", r * 100.0))
        );
        rows.push(serde_json::json!({
            "path": label,
            "bytes_moved": bytes,
            "median_s": seconds,
            "gb_per_s": gbps,
            "fraction_of_copy": ratio,
        }));
    }
    println!("\n{table}");
    serde_json::json!({
        "bucket_bytes": BUCKET_BYTES,
        "member_numels": MEMBER_NUMELS,
        "dtype": "f32",
        "copy_gb_per_s": copy,
        "results": rows,
        "goal_fraction_of_copy": 0.8,
    })
}

fn main() {
    // Says `SKIPPED: pack_cuda: ...` without a device.
    let value = if burn_zero_testing::skip::cuda_devices("pack_cuda", 1).is_some() {
        let mut c = Criterion::default()
            .configure_from_args()
            .sample_size(20)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        run(&mut c, &CudaDevice::new(0));
        c.final_summary();
        report()
    } else {
        serde_json::json!({ "skipped": "no CUDA device visible" })
    };
    if let Ok(path) = std::env::var("PACK_CUDA_REPORT") {
        let text = serde_json::to_string_pretty(&value).expect("json");
        if let Err(error) = std::fs::write(&path, text + "\n") {
            eprintln!("could not write {path}: {error}");
            std::process::exit(1);
        }
    }
}
