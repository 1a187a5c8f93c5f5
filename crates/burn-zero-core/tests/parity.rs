//! Autodiff parity: `Autodiff<Zero<Flex>>` with the model sharded across 1, 2 and 4 ranks
//! gives, bit for bit, the loss of each rank's micro-batch and the mean of the micro-batch
//! gradients that world size 1 computes without sharding (averaged in the same rank order).

use burn::backend::flex::FlexDevice;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::attention::{
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero_comm::{CommError, launch};
use burn_zero_core::{Zero, ZeroConfig, ZeroError, shard};

type Inner = Zero<Flex>;
type Train = Autodiff<Inner>;

const VOCAB: usize = 13;
const D_MODEL: usize = 10;
const SEQ: usize = 5;
const BATCH: usize = 2;

/// A transformer block with a tied output head: embedding, causal self-attention, layer norms,
/// MLP. Parameter sizes (130, 100, 10, 140, 14, …) mostly do not divide by 4.
#[derive(Module, Debug)]
struct Block<B: Backend> {
    embed: Embedding<B>,
    attn: MultiHeadAttention<B>,
    norm1: LayerNorm<B>,
    fc1: Linear<B>,
    fc2: Linear<B>,
    norm2: LayerNorm<B>,
}

impl<B: Backend> Block<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            embed: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            attn: MultiHeadAttentionConfig::new(D_MODEL, 2)
                .with_dropout(0.0)
                .init(device),
            norm1: LayerNormConfig::new(D_MODEL).init(device),
            fc1: LinearConfig::new(D_MODEL, 14).init(device),
            fc2: LinearConfig::new(14, D_MODEL).init(device),
            norm2: LayerNormConfig::new(D_MODEL).init(device),
        }
    }

    fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let device = tokens.device();
        let x = self.embed.forward(tokens);
        let mask = generate_autoregressive_mask::<B>(BATCH, SEQ, &device);
        let attn = self
            .attn
            .forward(MhaInput::self_attn(x.clone()).mask_attn(mask))
            .context;
        let x = self.norm1.forward(x + attn);
        let h = self.fc2.forward(gelu(self.fc1.forward(x.clone())));
        let x = self.norm2.forward(x + h);
        // Output head tied to the embedding.
        let head = self.embed.weight.val().transpose().unsqueeze::<3>();
        let logits = x.matmul(head).reshape([BATCH * SEQ, VOCAB]);
        CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, targets)
    }
}

/// Micro-batch `index`: tokens and next-token targets of a fixed pseudo-random sequence.
fn micro_batch<B: Backend>(
    index: usize,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 1, Int>) {
    let token = |i: usize| ((i * 7 + index * 11 + (i * i) % 5) % VOCAB) as i64;
    let tokens: Vec<i64> = (0..BATCH * SEQ).map(|i| token(i + index * 3)).collect();
    let targets: Vec<i64> = (0..BATCH * SEQ).map(|i| token(i + index * 3 + 1)).collect();
    (
        Tensor::from_data(TensorData::new(tokens, [BATCH, SEQ]), device),
        Tensor::from_data(TensorData::new(targets, [BATCH * SEQ]), device),
    )
}

/// Every parameter's gradient as f32 values, in visit order (gathers sharded ones).
struct Grads<'a> {
    grads: &'a GradientsParams,
    out: Vec<Vec<f32>>,
}

impl ModuleVisitor<Train> for Grads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
        let grad = self
            .grads
            .get::<Inner, D>(param.id)
            .expect("every parameter has a gradient");
        self.out.push(grad.into_data().to_vec::<f32>().unwrap());
    }
}

/// Forces lazy parameter initialisation.
struct Materialise;

impl ModuleVisitor<Train> for Materialise {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
        let _ = param.val();
    }
}

fn loss_and_grads(model: &Block<Train>, index: usize, device: &FlexDevice) -> (f32, Vec<Vec<f32>>) {
    let (tokens, targets) = micro_batch::<Train>(index, device);
    let loss = model.loss(tokens, targets);
    let value = loss.clone().into_scalar();
    let grads = GradientsParams::from_grads(loss.backward(), model);
    let mut visitor = Grads {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut visitor);
    (value, visitor.out)
}

/// World size 1, no sharding: each micro-batch's loss, and the rank-order mean of their grads.
fn reference(model: &Block<Train>, world_size: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let mut losses = Vec::new();
    let mut sum: Option<Vec<Vec<f32>>> = None;
    for index in 0..world_size {
        let (loss, grads) = loss_and_grads(model, index, &device);
        losses.push(loss);
        sum = Some(match sum {
            None => grads,
            Some(acc) => acc
                .into_iter()
                .zip(grads)
                .map(|(a, g)| a.iter().zip(&g).map(|(x, y)| x + y).collect())
                .collect(),
        });
    }
    let n = world_size as f32;
    let mean = sum
        .unwrap()
        .into_iter()
        .map(|g| {
            g.into_iter()
                .map(|x| if world_size > 1 { x / n } else { x })
                .collect()
        })
        .collect();
    (losses, mean)
}

fn check_parity(world_size: usize, config: &ZeroConfig) {
    let device = Default::default();
    // Materialise the lazily initialised parameters once, so every clone holds these values.
    let base = Block::<Train>::new(&device);
    base.visit(&mut Materialise);
    let (ref_losses, ref_grads) = reference(&base.clone(), world_size);

    let per_rank = launch::<Flex, _, _, ZeroError>(world_size, &[device], |ctx| {
        let model = base.clone();
        let model = shard(model, &ctx, config)?;
        Ok(loss_and_grads(&model, ctx.rank(), ctx.device()))
    })
    .unwrap_or_else(|e| panic!("world {world_size}: {e}"));

    for (rank, (loss, grads)) in per_rank.into_iter().enumerate() {
        assert_eq!(
            loss.to_bits(),
            ref_losses[rank].to_bits(),
            "loss, world {world_size}, rank {rank}"
        );
        assert_eq!(grads.len(), ref_grads.len());
        for (i, (got, want)) in grads.iter().zip(&ref_grads).enumerate() {
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "gradient of parameter #{i}, world {world_size}, rank {rank}:\n{got:?}\n{want:?}"
            );
        }
    }
}

#[test]
fn sharded_gradients_equal_the_unsharded_mean_bitwise() {
    let all_sharded = ZeroConfig::new().with_persist_below_numel(0);
    for world_size in [1, 2, 4] {
        check_parity(world_size, &all_sharded);
    }
}

#[test]
fn persistent_small_parameters_take_the_all_reduce_path() {
    // Biases and norms (≤ 14 elements) stay replicated; matrices are sharded.
    let config = ZeroConfig::new().with_persist_below_numel(20);
    check_parity(2, &config);
}

#[test]
fn no_cache_gathers_at_every_use_with_the_same_result() {
    let config = ZeroConfig::new()
        .with_persist_below_numel(0)
        .with_max_live_gathered_bytes(0);
    check_parity(2, &config);
}

#[allow(dead_code)]
fn _assert_comm_error_converts(e: CommError) -> ZeroError {
    e.into()
}
