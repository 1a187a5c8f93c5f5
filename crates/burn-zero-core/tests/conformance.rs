//! Op conformance: a broad set of tensor and module ops run through `Zero<NdArray>` — with
//! sharded operands wherever an op can take a parameter, including lazily viewed ones — and
//! through `NdArray` directly must give identical results.

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::module::{attention, avg_pool2d, conv2d, embedding, max_pool2d};
use burn::tensor::ops::{AttentionModuleOptions, ConvOptions};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData, activation};
use burn_zero_comm::{CommError, launch};
use burn_zero_core::{Zero, ZeroConfig, ZeroState};

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let z = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9))
            .wrapping_mul(0x94D0_49BB_1331_11EB);
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Operands of the op suite: `params` may be sharded, `inputs` are always local.
struct Operands<B: Backend> {
    w: Tensor<B, 2>,      // [6, 5] weight
    bias: Tensor<B, 1>,   // [3]
    kernel: Tensor<B, 4>, // [3, 2, 3, 3]
    table: Tensor<B, 2>,  // [7, 4] embedding table
    x: Tensor<B, 2>,      // [4, 5] input
    img: Tensor<B, 4>,    // [1, 2, 5, 5]
}

fn full<B: Backend, const D: usize>(
    seed: u64,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(seed, n), shape), device)
}

/// One op's name and result.
type Case = (&'static str, TensorData);

/// Runs every op and returns each result's data.
fn suite<B: Backend>(o: Operands<B>) -> Vec<Case> {
    let w = o.w.clone();
    let mut results = arithmetic(&w, &o.x);
    results.extend(reductions_and_activations(&w));
    results.extend(shapes_and_indexing(&w, &o.x));
    results.extend(casts_and_comparisons(&w));
    results.extend(module_ops(&o));
    results
}

/// Element-wise arithmetic and matrix products, with a local operand and without.
fn arithmetic<B: Backend>(w: &Tensor<B, 2>, x: &Tensor<B, 2>) -> Vec<Case> {
    vec![
        (
            "add",
            (x.clone() + w.clone().slice([1..5, 0..5])).into_data(),
        ),
        ("sub_scalar", (w.clone() - 0.25).into_data()),
        ("mul", (w.clone() * w.clone()).into_data()),
        (
            "div",
            (x.clone() / (w.clone().slice([0..4, 0..5]).abs() + 1.0)).into_data(),
        ),
        (
            "matmul_transposed",
            x.clone().matmul(w.clone().transpose()).into_data(),
        ),
        (
            "matmul_swapped",
            w.clone().swap_dims(0, 1).matmul(w.clone()).into_data(),
        ),
    ]
}

/// Reductions, unary maths and activations (a layer norm written out among them).
fn reductions_and_activations<B: Backend>(w: &Tensor<B, 2>) -> Vec<Case> {
    vec![
        ("sum", w.clone().sum().into_data()),
        ("mean_dim", w.clone().mean_dim(1).into_data()),
        ("max_dim", w.clone().max_dim(0).into_data()),
        ("argmax", w.clone().argmax(1).into_data()),
        ("exp", w.clone().exp().into_data()),
        ("log", (w.clone().abs() + 1.0).log().into_data()),
        ("powf", w.clone().powf_scalar(3.0).into_data()),
        ("sqrt", w.clone().abs().sqrt().into_data()),
        ("tanh", w.clone().tanh().into_data()),
        ("softmax", activation::softmax(w.clone(), 1).into_data()),
        ("gelu", activation::gelu(w.clone()).into_data()),
        ("relu", activation::relu(w.clone()).into_data()),
        ("layer_norm", {
            let mean = w.clone().mean_dim(1);
            let var = w.clone().var(1);
            ((w.clone() - mean) / (var + 1e-5).sqrt()).into_data()
        }),
    ]
}

/// Shape ops, and gathers, scatters and selects by index.
fn shapes_and_indexing<B: Backend>(w: &Tensor<B, 2>, x: &Tensor<B, 2>) -> Vec<Case> {
    let device = w.device();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![4i64, 0, 2], [3]), &device);
    let idx2 = Tensor::<B, 2, Int>::from_data(
        TensorData::new(
            (0..30).map(|i| (i * 3 % 5) as i64).collect::<Vec<_>>(),
            [6, 5],
        ),
        &device,
    );
    vec![
        ("reshape", w.clone().reshape([5, 6]).into_data()),
        ("permute", w.clone().permute([1, 0]).into_data()),
        (
            "expand",
            w.clone().unsqueeze::<3>().expand([2, 6, 5]).into_data(),
        ),
        ("flip", w.clone().flip([0]).into_data()),
        (
            "cat",
            Tensor::cat(vec![w.clone(), x.clone()], 0).into_data(),
        ),
        ("gather", w.clone().gather(1, idx2.clone()).into_data()),
        (
            "scatter",
            w.zeros_like()
                .scatter(1, idx2, w.clone(), IndexingUpdateOp::Add)
                .into_data(),
        ),
        ("select", w.clone().select(0, idx).into_data()),
    ]
}

/// Masks, clamps, casts, and int and bool ops.
fn casts_and_comparisons<B: Backend>(w: &Tensor<B, 2>) -> Vec<Case> {
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![4i64, 0, 2], [3]), &w.device());
    vec![
        (
            "mask_fill",
            w.clone()
                .mask_fill(w.clone().greater_elem(0.0), 1.5)
                .into_data(),
        ),
        ("clamp", w.clone().clamp(-0.5, 0.5).into_data()),
        ("cast_f64", w.clone().cast(DType::F64).into_data()),
        ("into_int", (w.clone() * 10.0).int().into_data()),
        (
            "int_ops",
            ((idx.clone() + 2) * idx.clone()).sum().into_data(),
        ),
        (
            "bool_ops",
            w.clone().greater_elem(0.0).bool_not().into_data(),
        ),
    ]
}

/// Module ops (embedding, convolution, pooling, attention), and dims read without a gather.
fn module_ops<B: Backend>(o: &Operands<B>) -> Vec<Case> {
    let tokens = Tensor::<B, 2, Int>::from_data(
        TensorData::new(vec![1i64, 6, 3, 0, 2, 6], [2, 3]),
        &o.x.device(),
    );
    let q = o.w.clone().reshape([1, 2, 3, 5]);
    let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
    let conv = conv2d(
        o.img.clone(),
        o.kernel.clone(),
        Some(o.bias.clone()),
        options,
    );
    let attended = attention(
        q.clone(),
        q.clone(),
        q,
        None,
        None,
        AttentionModuleOptions::default(),
    );
    vec![
        ("embedding", embedding(o.table.clone(), tokens).into_data()),
        ("conv2d", conv.into_data()),
        (
            "max_pool2d",
            max_pool2d(o.img.clone(), [2, 2], [1, 1], [0, 0], [1, 1], false).into_data(),
        ),
        (
            "avg_pool2d",
            avg_pool2d(o.img.clone(), [2, 2], [2, 2], [0, 0], true, false).into_data(),
        ),
        ("attention", attended.into_data()),
        ("dims_without_gather", {
            let dims = o.w.clone().transpose().dims();
            TensorData::new(dims.iter().map(|&d| d as i64).collect::<Vec<_>>(), [2])
        }),
    ]
}

fn operands<B: Backend>(device: &B::Device) -> Operands<B> {
    Operands {
        w: full(1, [6, 5], device),
        bias: full(2, [3], device),
        kernel: full(3, [3, 2, 3, 3], device),
        table: full(4, [7, 4], device),
        x: full(5, [4, 5], device),
        img: full(6, [1, 2, 5, 5], device),
    }
}

#[test]
fn zero_ops_match_the_inner_backend_with_sharded_operands() {
    let expected = suite::<NdArray>(operands(&Default::default()));
    for world_size in [1, 2, 3] {
        let per_rank =
            launch::<NdArray, _, _, CommError>(world_size, &[Default::default()], |ctx| {
                let zero = ZeroState::create(&ctx, ZeroConfig::new()).expect("one group");
                let plain = operands::<NdArray>(ctx.device());
                let local = |t: Tensor<NdArray, 2>| {
                    Tensor::<Zero<NdArray>, 2>::from_data(t.into_data(), ctx.device())
                };
                let img =
                    Tensor::<Zero<NdArray>, 4>::from_data(plain.img.into_data(), ctx.device());
                let results = suite::<Zero<NdArray>>(Operands {
                    w: zero.shard_tensor(plain.w),
                    bias: zero.shard_tensor(plain.bias),
                    kernel: zero.shard_tensor(plain.kernel),
                    table: zero.shard_tensor(plain.table),
                    x: local(plain.x),
                    img,
                });
                Ok(results)
            })
            .unwrap();
        for results in per_rank {
            assert_eq!(results.len(), expected.len());
            for ((name, got), (_, want)) in results.iter().zip(&expected) {
                assert_eq!(got, want, "{name} at world size {world_size}");
            }
        }
    }
}
