//! Fixtures shared by burn-zero's tests: a transformer block with a tied output head, its
//! micro-batches, and world-size-1 unsharded references (gradients averaged in rank order);
//! [`skip`], how a test that needs absent hardware says so; [`processes`], rank processes
//! (`mpirun`, Open MPI's name server, built programs); [`alloc`], heap bytes counted
//! outside the library; and [`recording`], a communicator that logs the calls it issues.

pub mod alloc;
pub mod engines;
pub mod processes;
pub mod recording;
pub mod skip;

use burn::backend::flex::FlexDevice;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::attention::{
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use burn::tensor::activation::gelu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_zero_core::Zero;

/// The backend every rank computes on.
pub type Inner = Zero<Flex>;
/// The training backend.
pub type Train = Autodiff<Inner>;

/// Vocabulary size.
pub const VOCAB: usize = 13;
const D_MODEL: usize = 10;
const SEQ: usize = 5;
const BATCH: usize = 2;

/// A transformer block with a tied output head: embedding, causal self-attention, layer norms,
/// MLP. Parameter sizes (130, 100, 10, 140, 14, …) mostly do not divide by 4.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    embed: Embedding<B>,
    attn: MultiHeadAttention<B>,
    norm1: LayerNorm<B>,
    fc1: Linear<B>,
    fc2: Linear<B>,
    norm2: LayerNorm<B>,
}

impl<B: Backend> Block<B> {
    pub fn new(device: &B::Device) -> Self {
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

    pub fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
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
pub fn micro_batch<B: Backend>(
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
pub struct Grads<'a> {
    grads: &'a GradientsParams,
    out: Vec<Vec<f32>>,
}

impl ModuleVisitor<Train> for Grads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
        let grad = self
            .grads
            .get::<Inner, D>(param.id)
            .expect("every parameter has a gradient");
        self.out
            .push(grad.into_data().convert::<f32>().to_vec::<f32>().unwrap());
    }
}

/// Forces lazy parameter initialisation.
pub struct Materialise;

impl<B: Backend> ModuleVisitor<B> for Materialise {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let _ = param.val();
    }
}

pub fn loss_and_grads(
    model: &Block<Train>,
    index: usize,
    device: &FlexDevice,
) -> (f32, Vec<Vec<f32>>) {
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
pub fn reference(model: &Block<Train>, world_size: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
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

/// A freshly initialised block with every parameter materialised (clones share the values).
pub fn base_model(device: &FlexDevice) -> Block<Train> {
    base_model_on::<Flex>(device)
}

/// [`base_model`] for ranks that compute on `X`.
pub fn base_model_on<X: Backend>(device: &X::Device) -> Block<Autodiff<Zero<X>>> {
    let model = Block::<Autodiff<Zero<X>>>::new(device);
    model.visit(&mut Materialise);
    model
}

/// Every parameter's values as f32, in visit order. Reading a sharded parameter gathers it: a
/// collective every rank must run in the same order.
pub fn param_values<B: Backend, M: Module<B>>(model: &M) -> Vec<Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl<B: Backend> ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.push(data.to_vec::<f32>().expect("f32 data"));
        }
    }
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    values.0
}

/// The rank-order mean of each parameter's gradient over `grads` (one per micro-batch), as
/// the collectives compute it: added left to right, then divided once.
pub fn average_grads<AB: AutodiffBackend, M: Module<AB>>(
    model: &M,
    grads: &[GradientsParams],
) -> GradientsParams {
    struct Average<'a> {
        grads: &'a [GradientsParams],
        out: GradientsParams,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Average<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let mut parts = self
                .grads
                .iter()
                .filter_map(|g| g.get::<AB::InnerBackend, D>(param.id));
            let Some(first) = parts.next() else { return };
            let sum = parts.fold(first, |acc, g| acc + g);
            let mean = if self.grads.len() > 1 {
                sum.div_scalar(self.grads.len() as f64)
            } else {
                sum
            };
            self.out.register::<AB::InnerBackend, D>(param.id, mean);
        }
    }
    let mut average = Average {
        grads,
        out: GradientsParams::new(),
    };
    model.visit(&mut average);
    average.out
}

/// Casts every parameter of a model to `dtype`.
pub struct CastParams(pub DType);

impl ModuleMapper<Train> for CastParams {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Train, D>>,
    ) -> Param<Tensor<Train, D>> {
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let tensor = Tensor::from_inner(tensor.inner().cast(self.0)).set_require_grad(require_grad);
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Single-rank view of one data-parallel step: the gradients of the `world_size` micro-batches
/// of `step` (indices `step · world_size + rank`), averaged in rank order, and their mean loss.
pub fn step_mean_grads<X: Backend>(
    model: &Block<Autodiff<Zero<X>>>,
    step: usize,
    world_size: usize,
    device: &X::Device,
) -> (GradientsParams, f32) {
    let mut loss_sum = 0.0;
    let grads: Vec<GradientsParams> = (0..world_size)
        .map(|rank| {
            let (tokens, targets) =
                micro_batch::<Autodiff<Zero<X>>>(step * world_size + rank, device);
            let loss = model.loss(tokens, targets);
            loss_sum += loss.clone().into_scalar().elem::<f32>();
            GradientsParams::from_grads(loss.backward(), model)
        })
        .collect();
    (average_grads(model, &grads), loss_sum / world_size as f32)
}

/// Whether two value lists are equal bit for bit (same length, same bits).
pub fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Whether two lists of parameters are equal bit for bit.
pub fn params_bits_equal(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| bits_equal(x, y))
}
