//! Pack, unpack and gathered-cut bandwidth on a CUDA device (feature `cuda`) against a
//! device-to-device copy of the same bytes, for the GPU check (`scripts/gpu-check.sh`).
//!
//! Buckets of 1, 25 and 100 MiB (of the bucket's dtype), of 7 members (six equal ones and a
//! quarter-size one, which gives it an odd length) and of 48 (equal, each of an odd length), as
//! 1 rank row and as 8; at 25 MiB also of 48 members whose lengths, offsets and rows all divide
//! by the widest vector, as every member of the GPT models' chunks does at 2 ranks. An odd member
//! shifts every member after it against the vector grid; those take the shifted kernels, which
//! read the shifted side element by element and write whole vectors, so the two shapes at 25 MiB
//! tell what the shift still costs. f32 gradients into an f32 bucket, and into a bf16 one (the
//! cast of `reduce_dtype`), each with a predivide factor. Unpack reads every member of a row back with a
//! divisor (the gradient buckets' call, `unpack_row`); the gathered cut takes every member out of
//! an all-gathered chunk of 8 rank rows (`cut_gathered`, stage 3's gathers). The copy is Burn's
//! own device copy kernel (`CubeTensor::copy`, vectorised) of a tensor as large as the bucket.
//! GB/s counts bytes read plus bytes written (1 GB = 1e9 bytes), so the ratio to the copy is the
//! fraction of the copy's bandwidth reached (the goal is at least 0.8).
//!
//! The kernels take up to 16 members in a launch: 7 members are one launch, 48 are three. Each
//! bucket comes from cubecl's memory pool, as in training, where a bucket of the same size was
//! dropped the step before.
//!
//! Time: cubecl 0.10 profiles CUDA work by synchronising before and after, so each sample times
//! a batch of calls with one device synchronisation at the end, long enough (a gigabyte of traffic,
//! about half a millisecond on an H100) that the synchronisation is a small part of it; that is the device time per call. Beside
//! it, the host's time per call: what enqueueing one call costs the calling thread, timed without
//! a synchronisation. Prints a table; `PACK_CUDA_REPORT=path` also writes JSON there. Without a
//! CUDA device it says it was skipped (and writes `{"skipped": ...}`).

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_zero_kernels::{
    BucketSpec, GatheredMember, MemberSpec, PackPath, Packer, RowPart, cut_gathered, unpack_row,
};
use criterion::Criterion;
use cubecl::cuda::{CudaDevice, CudaRuntime};

type B = CubeBackend<CudaRuntime, f32, i32, u8>;

const MIB: usize = 1 << 20;
/// Bucket sizes in MiB of the bucket's dtype.
const BUCKETS_MIB: [usize; 3] = [1, 25, 100];
/// Members per bucket, of odd lengths.
const MEMBERS: [usize; 2] = [7, 48];
/// The bucket size (MiB) also measured with members that all divide by the widest vector.
const ALIGNED_MIB: usize = 25;

/// How a bucket is cut into members: `count` of them, odd (see [`member_numels`]) or aligned.
#[derive(Clone, Copy)]
struct Members {
    count: usize,
    aligned: bool,
}

impl Members {
    /// The shapes measured at a bucket of `mib` MiB.
    fn at(mib: usize) -> Vec<Members> {
        let mut shapes: Vec<Members> = MEMBERS
            .iter()
            .map(|&count| Members {
                count,
                aligned: false,
            })
            .collect();
        if mib == ALIGNED_MIB {
            shapes.push(Members {
                count: 48,
                aligned: true,
            });
        }
        shapes
    }

    /// Member sizes (elements) in a bucket of `numel` elements.
    fn numels(self, numel: usize) -> Vec<usize> {
        if self.aligned {
            // A multiple of 8 rows of 8-element vectors.
            vec![(numel / self.count) / 64 * 64; self.count]
        } else {
            member_numels(numel, self.count)
        }
    }

    fn label(self) -> String {
        match self.aligned {
            true => format!("{} aligned members", self.count),
            false => format!("{} members", self.count),
        }
    }
}
/// Rank rows.
const ROWS: [usize; 2] = [1, 8];
/// Device work per sample: enough that one synchronisation is a small part of it.
const SAMPLE_BYTES: usize = 1 << 30;

/// One measured path: label, bytes moved per call, (calls, elapsed) per sample, and the host's
/// time to enqueue one call.
struct Measured {
    label: String,
    bytes: usize,
    samples: Vec<(u64, Duration)>,
    enqueue: Vec<f64>,
}

static TIMES: Mutex<Vec<Measured>> = Mutex::new(Vec::new());

fn record(label: &str, bytes: usize, iters: u64, elapsed: Duration, enqueue: f64) {
    let mut times = TIMES.lock().unwrap();
    match times.iter_mut().find(|m| m.label == label) {
        Some(m) => {
            m.samples.push((iters, elapsed));
            m.enqueue.push(enqueue);
        }
        None => times.push(Measured {
            label: label.to_string(),
            bytes,
            samples: vec![(iters, elapsed)],
            enqueue: vec![enqueue],
        }),
    }
}

/// Member sizes (elements) of a bucket of `numel` elements with `count` members: equal odd
/// lengths, and with 7 members a quarter-size last one.
fn member_numels(numel: usize, count: usize) -> Vec<usize> {
    if count == 7 {
        let unit = (numel * 4 / 25) | 1;
        let mut sizes = vec![unit; 6];
        sizes.push(numel.saturating_sub(6 * unit).max(1));
        sizes
    } else {
        vec![(numel / count) | 1; count]
    }
}

/// The bucket of `rows` rank rows in `dtype`; members padded to a multiple of `rows`.
fn layout(
    numels: &[usize],
    rows: usize,
    dtype: DType,
    predivide: f64,
) -> (BucketSpec, Vec<MemberSpec>) {
    let mut offset = 0;
    let members: Vec<MemberSpec> = numels
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
        dtype,
        predivide,
    };
    (spec, members)
}

fn tensor(numel: usize, seed: usize, dtype: DType, device: &CudaDevice) -> Tensor<B, 1> {
    let values: Vec<f32> = (0..numel)
        .map(|i| ((i * 7 + seed * 13) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    let data = TensorData::new(values, [numel]).convert_dtype(dtype);
    Tensor::<B, 1>::from_data(data, (device, dtype))
}

/// Times `call` in batches of about `SAMPLE_BYTES` of traffic with one synchronisation per
/// batch, and the host's enqueueing time per call without one.
fn bench(c: &mut Criterion, label: &str, bytes: usize, device: &CudaDevice, call: impl Fn()) {
    let batch = (SAMPLE_BYTES / bytes.max(1)).clamp(4, 2000) as u64;
    c.bench_function(label, |b| {
        b.iter_custom(|wanted| {
            // At least a batch per sample; criterion is told the time of the calls it asked for.
            let iters = wanted.max(batch);
            B::sync(device).unwrap();
            let start = Instant::now();
            for _ in 0..iters {
                call();
            }
            let enqueued = start.elapsed();
            B::sync(device).unwrap();
            let elapsed = start.elapsed();
            let enqueue = enqueued.as_secs_f64() / iters as f64;
            record(label, bytes, iters, elapsed, enqueue);
            elapsed.mul_f64(wanted as f64 / iters as f64)
        })
    });
}

fn run(c: &mut Criterion, device: &CudaDevice) {
    for mib in BUCKETS_MIB {
        let source = tensor(mib * MIB / 4, 1, DType::F32, device)
            .into_primitive()
            .tensor();
        bench(
            c,
            &format!("copy {mib} MiB f32"),
            2 * mib * MIB,
            device,
            || {
                black_box(source.copy());
            },
        );
        for dtype in [DType::F32, DType::BF16] {
            let numel = mib * MIB / dtype.size();
            for members in Members::at(mib) {
                let numels = members.numels(numel);
                let shape = members.label();
                let grads: Vec<_> = numels
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| tensor(n, i, DType::F32, device).into_primitive().tensor())
                    .collect();
                let elements: usize = numels.iter().sum();
                // Read f32 gradients, write the bucket's dtype.
                let moved = elements * (4 + dtype.size());
                for rows in ROWS {
                    let (spec, members) = layout(&numels, rows, dtype, 2.0);
                    let name = format!("{mib} MiB f32->{dtype:?}, {shape}, {rows} row(s)");
                    bench(c, &format!("pack {name}"), moved, device, || {
                        let mut packer = Packer::<B>::new(spec, device, PackPath::Kernel).unwrap();
                        for (member, grad) in members.iter().zip(&grads) {
                            packer.push(member, Some(grad.clone())).unwrap();
                        }
                        black_box(packer.finish().unwrap());
                    });
                }
                // Unpack of one reduced row, back to f32 with the divisor.
                let (spec, members) = layout(&numels, 1, dtype, 2.0);
                let row = tensor(spec.row_len, 99, dtype, device)
                    .into_primitive()
                    .tensor();
                let parts: Vec<RowPart> = members
                    .iter()
                    .map(|m| RowPart {
                        offset: m.offset,
                        len: m.len,
                        dtype: DType::F32,
                    })
                    .collect();
                let label = format!("unpack {mib} MiB {dtype:?}->f32, {shape}, /2");
                bench(c, &label, moved, device, || {
                    let unpacked =
                        unpack_row::<B>(row.clone(), &parts, 2.0, PackPath::Kernel, None);
                    black_box(unpacked.unwrap());
                });
            }
        }
        // The gathered cut: a chunk of 8 rank rows of f32, every member taken out.
        for members in Members::at(mib) {
            let ranks = 8;
            let numels = members.numels(mib * MIB / 4);
            let shape = members.label();
            let (spec, members) = layout(&numels, ranks, DType::F32, 1.0);
            let gathered = tensor(spec.row_len * ranks, 5, DType::F32, device)
                .into_primitive()
                .tensor();
            let cut: Vec<GatheredMember> = members
                .iter()
                .map(|m| GatheredMember {
                    offset: m.offset,
                    block_len: m.len,
                    numel: m.numel,
                })
                .collect();
            let moved = 2 * 4 * numels.iter().sum::<usize>();
            let label = format!("gathered cut {mib} MiB f32, {shape}, 8 ranks");
            bench(c, &label, moved, device, || {
                let members = cut_gathered::<B>(&gathered, ranks, &cut, PackPath::Kernel);
                black_box(members.unwrap());
            });
        }
    }
}

/// Median of `values`.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Median seconds per call over the samples.
fn per_call(samples: &[(u64, Duration)]) -> f64 {
    median(
        samples
            .iter()
            .map(|(iters, elapsed)| elapsed.as_secs_f64() / *iters as f64)
            .collect(),
    )
}

fn report() -> serde_json::Value {
    let times = TIMES.lock().unwrap();
    // The copy of each bucket size, in GB/s.
    let copy_of = |label: &str| {
        let mib = label.split_whitespace().nth(1)?;
        let copy = times
            .iter()
            .find(|m| m.label == format!("copy {mib} MiB f32"))?;
        Some(copy.bytes as f64 / per_call(&copy.samples) / 1e9)
    };
    let mut table = String::from(
        "| path | bytes moved | device time per call | GB/s | of copy | host time per call |\n\
         |---|---|---|---|---|---|\n",
    );
    let mut rows = Vec::new();
    for m in times.iter() {
        let seconds = per_call(&m.samples);
        let host = median(m.enqueue.clone());
        let gbps = m.bytes as f64 / seconds / 1e9;
        let copy = copy_of(&m.label);
        let ratio = copy.map(|c| gbps / c);
        table += &format!(
            "| {} | {:.1} MB | {:.1} µs | {gbps:.0} | {} | {:.1} µs |\n",
            m.label,
            m.bytes as f64 / 1e6,
            seconds * 1e6,
            ratio.map_or("-".into(), |r| format!("{:.0}%", r * 100.0)),
            host * 1e6,
        );
        rows.push(serde_json::json!({
            "path": m.label,
            "bytes_moved": m.bytes,
            "median_s": seconds,
            "host_s_per_call": host,
            "gb_per_s": gbps,
            "copy_gb_per_s": copy,
            "fraction_of_copy": ratio,
        }));
    }
    println!("\n{table}");
    serde_json::json!({
        "buckets_mib": BUCKETS_MIB,
        "members": MEMBERS,
        "aligned_members_at_mib": ALIGNED_MIB,
        "rows": ROWS,
        "results": rows,
        "goal_fraction_of_copy": 0.8,
    })
}

fn main() {
    // Says `SKIPPED: pack_cuda: ...` without a device.
    let value = if burn_zero_testing::skip::cuda_devices("pack_cuda", 1).is_some() {
        let mut c = Criterion::default()
            .configure_from_args()
            .sample_size(10)
            .warm_up_time(Duration::from_millis(100))
            .measurement_time(Duration::from_millis(500));
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
