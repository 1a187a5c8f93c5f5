//! Pack and unpack throughput of a 64 MiB f32 bucket (4 rank rows, 16 members of 1 Mi
//! elements, predivide and postdivide 2) against a plain `copy_from_slice` of the same bytes.
//!
//! GB/s counts bytes read plus bytes written (1 GB = 1e9 bytes): a pack reads and writes the
//! 64 MiB bucket once each at best; an unpack of every member of one 16 MiB reduced row reads
//! and writes 16 MiB, as does `unpack_row`, which unpacks every member of the row in one call
//! (what the gradient buckets run). Paths: the host path on Flex and NdArray and the Burn-ops fallback on
//! Flex (CPU), and with feature `wgpu` the kernel and the fallback on
//! `CubeBackend<WgpuRuntime>` (whatever adapter the machine has: Mesa lavapipe on a machine
//! without a GPU). Packing goes through a `BufferPool`, as the gradient buckets do, so every
//! iteration after the first packs into the same memory where the path reuses it. A markdown
//! table of median GB/s goes to stdout.

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::backend::{Flex, NdArray};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_zero_kernels::{
    BucketSpec, BufferPool, MemberSpec, PackPath, Packer, RowPart, unpack, unpack_row,
};
use criterion::Criterion;

const ROWS: usize = 4;
const MEMBERS: usize = 16;
const MEMBER_NUMEL: usize = 1 << 20;
const DIVISOR: f64 = 2.0;

/// Bucket bytes: 16 Mi f32 elements.
const BUCKET_BYTES: usize = MEMBERS * MEMBER_NUMEL * 4;

/// (label, bytes moved per iteration, seconds of each measured iteration).
static TIMES: Mutex<Vec<(String, usize, Vec<f64>)>> = Mutex::new(Vec::new());

fn record(label: &str, bytes: usize, seconds: f64) {
    let mut times = TIMES.lock().unwrap();
    match times.iter_mut().find(|(l, ..)| l == label) {
        Some((.., list)) => list.push(seconds),
        None => times.push((label.to_string(), bytes, vec![seconds])),
    }
}

fn spec() -> BucketSpec {
    BucketSpec {
        rows: ROWS,
        row_len: MEMBERS * MEMBER_NUMEL / ROWS,
        dtype: DType::F32,
        predivide: DIVISOR,
    }
}

fn members() -> Vec<MemberSpec> {
    let len = MEMBER_NUMEL / ROWS;
    (0..MEMBERS)
        .map(|i| MemberSpec {
            numel: MEMBER_NUMEL,
            len,
            offset: i * len,
        })
        .collect()
}

fn tensor<B: Backend>(numel: usize, seed: usize, device: &B::Device) -> B::FloatTensorPrimitive {
    let values: Vec<f32> = (0..numel)
        .map(|i| ((i * 7 + seed * 13) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    Tensor::<B, 1>::from_data(TensorData::new(values, [numel]), device)
        .into_primitive()
        .tensor()
}

/// Times packing the bucket and unpacking one reduced row on `B` with `path`.
fn bench_backend<B: Backend>(c: &mut Criterion, name: &str, path: PackPath, device: &B::Device) {
    let grads: Vec<_> = (0..MEMBERS)
        .map(|i| tensor::<B>(MEMBER_NUMEL, i, device))
        .collect();
    let row = tensor::<B>(spec().row_len, 99, device);
    B::sync(device).unwrap();

    let mut group = c.benchmark_group(name);
    let pack_label = format!("{name} pack");
    let pool = BufferPool::default();
    group.bench_function("pack", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let mut packer = Packer::<B>::with_pool(spec(), device, path, &pool).unwrap();
                for (member, grad) in members().iter().zip(&grads) {
                    packer.push(member, Some(grad.clone())).unwrap();
                }
                let bucket = packer.finish().unwrap();
                B::sync(device).unwrap();
                let elapsed = start.elapsed();
                drop(black_box(bucket));
                record(&pack_label, 2 * BUCKET_BYTES, elapsed.as_secs_f64());
                total += elapsed;
            }
            total
        })
    });
    let unpack_label = format!("{name} unpack");
    group.bench_function("unpack", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let parts: Vec<_> = members()
                    .iter()
                    .map(|m| unpack::<B>(&row, m.offset, m.len, DIVISOR, DType::F32, path).unwrap())
                    .collect();
                B::sync(device).unwrap();
                let elapsed = start.elapsed();
                drop(black_box(parts));
                record(
                    &unpack_label,
                    2 * BUCKET_BYTES / ROWS,
                    elapsed.as_secs_f64(),
                );
                total += elapsed;
            }
            total
        })
    });
    // What the gradient buckets run: every member of the row at once (`unpack_row`) into the
    // bucket's pool, from a row another tensor still holds, as a pooled collective result is.
    let row_label = format!("{name} unpack_row");
    let row_pool = BufferPool::default();
    let parts: Vec<RowPart> = members()
        .iter()
        .map(|m| RowPart {
            offset: m.offset,
            len: m.len,
            dtype: DType::F32,
        })
        .collect();
    group.bench_function("unpack_row", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let owned = row.clone();
                let start = Instant::now();
                let parts = unpack_row::<B>(owned, &parts, DIVISOR, path, Some(&row_pool)).unwrap();
                B::sync(device).unwrap();
                let elapsed = start.elapsed();
                drop(black_box(parts));
                record(&row_label, 2 * BUCKET_BYTES / ROWS, elapsed.as_secs_f64());
                total += elapsed;
            }
            total
        })
    });
    group.finish();
}

fn bench_memcpy(c: &mut Criterion) {
    let src = vec![1u8; BUCKET_BYTES];
    let mut dst = vec![0u8; BUCKET_BYTES];
    c.bench_function("memcpy", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            }
            let elapsed = start.elapsed();
            record(
                "memcpy (copy_from_slice)",
                2 * BUCKET_BYTES,
                elapsed.as_secs_f64() / iters as f64,
            );
            elapsed
        })
    });
}

fn report() {
    let mut out = String::from("| path | bytes moved | median time | GB/s |\n|---|---|---|---|\n");
    for (label, bytes, mut seconds) in TIMES.lock().unwrap().clone() {
        seconds.sort_by(f64::total_cmp);
        let median = seconds[seconds.len() / 2];
        out += &format!(
            "| {label} | {:.1} MB | {:.2} ms | {:.2} |\n",
            bytes as f64 / 1e6,
            median * 1e3,
            bytes as f64 / median / 1e9
        );
    }
    println!("\n{out}");
}

fn main() {
    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    bench_memcpy(&mut c);
    bench_backend::<Flex>(&mut c, "flex host", PackPath::Host, &Default::default());
    bench_backend::<NdArray>(&mut c, "ndarray host", PackPath::Host, &Default::default());
    bench_backend::<Flex>(
        &mut c,
        "flex fallback",
        PackPath::Fallback,
        &Default::default(),
    );
    #[cfg(feature = "wgpu")]
    {
        use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
        type Wgpu = CubeBackend<WgpuRuntime, f32, i32, u32>;
        let device = WgpuDevice::default();
        bench_backend::<Wgpu>(&mut c, "wgpu kernel", PackPath::Kernel, &device);
        bench_backend::<Wgpu>(&mut c, "wgpu fallback", PackPath::Fallback, &device);
    }
    c.final_summary();
    report();
}
