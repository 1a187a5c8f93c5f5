//! The character-level GPT of burn-zero's `train_gpt` example, its tests and the scaling
//! benchmarks: a decoder-only transformer with a tied output head, a character-level corpus,
//! deterministic batches, and module helpers (materialise, cast, read back). Plain Burn: without
//! its `train` feature it does not depend on burn-zero, so the plain-Burn baseline builds it too.
//! With it, `train` is the example's training run under burn-zero.

use std::ops::Range;

/// The GPT, its text windows and their batcher as burn-train's `Learner` takes them.
#[cfg(feature = "learner")]
pub mod learner;
/// The `train_gpt` example's training run: sharded ranks, checkpoints, the sample.
#[cfg(feature = "train")]
pub mod train;

use burn::config::Config;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};

/// The training text: chapters I to IX of Jules Verne's *Around the World in Eighty Days* in
/// English, as Project Gutenberg publishes it (eBook #103; the file names no translator, it is
/// the 1873 translation usually credited to George Makepeace Towle), without Project
/// Gutenberg's header and licence, carriage returns and repeated blank lines removed. Public
/// domain: published in 1873; Verne died in 1905, Towle in 1893.
pub const TEXT: &str = include_str!("../data/around_the_world_in_80_days.txt");

/// Model sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// About 0.1M parameters: trains in about a minute on two CPU cores.
    Tiny,
    /// About 1.8M parameters.
    Small,
    /// About 10.7M parameters.
    Base,
    /// GPT-2 small's shape: 12 blocks of width 768 with 12 heads. About 85M parameters with
    /// the character vocabulary (GPT-2's 124M less most of its 50,257-token embedding).
    Gpt2,
}

impl Preset {
    /// Every preset, smallest first.
    pub const ALL: [Preset; 4] = [Preset::Tiny, Preset::Small, Preset::Base, Preset::Gpt2];

    /// The preset's name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Base => "base",
            Preset::Gpt2 => "gpt2",
        }
    }

    /// The model of this size for a vocabulary of `vocab` symbols and contexts of up to
    /// `max_seq` of them.
    pub fn config(self, vocab: usize, max_seq: usize) -> GptConfig {
        let (d_model, n_heads, n_layers) = match self {
            Preset::Tiny => (64, 4, 2),
            Preset::Small => (192, 6, 4),
            Preset::Base => (384, 6, 6),
            Preset::Gpt2 => (768, 12, 12),
        };
        GptConfig::new(vocab, max_seq, d_model, n_heads, n_layers, 4 * d_model)
    }
}

impl std::str::FromStr for Preset {
    type Err = String;

    /// A preset by its [`Preset::name`].
    fn from_str(name: &str) -> Result<Self, String> {
        Preset::ALL
            .into_iter()
            .find(|preset| preset.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
                format!("unknown model preset {name:?}: {}", names.join(", "))
            })
    }
}

/// A decoder-only transformer (GPT): pre-norm blocks, no dropout.
#[derive(Config, Debug)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest context (rows of the position embedding).
    pub max_seq: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads per block.
    pub n_heads: usize,
    /// Blocks.
    pub n_layers: usize,
    /// Hidden width of each block's MLP.
    pub d_ff: usize,
}

impl GptConfig {
    /// A freshly initialised model. Embeddings start small (normal, std 0.02) so that the
    /// tied head's first logits are near zero and the first loss is near ln(vocab).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Gpt<B> {
        let small = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        Gpt {
            tokens: EmbeddingConfig::new(self.vocab, self.d_model)
                .with_initializer(small.clone())
                .init(device),
            positions: EmbeddingConfig::new(self.max_seq, self.d_model)
                .with_initializer(small)
                .init(device),
            // Burn's encoder stack with `norm_first` and a causal mask is a GPT decoder stack:
            // x + attn(norm(x)), then x + mlp(norm(x)).
            blocks: TransformerEncoderConfig::new(
                self.d_model,
                self.d_ff,
                self.n_heads,
                self.n_layers,
            )
            .with_norm_first(true)
            .with_dropout(0.0)
            .init(device),
            norm: LayerNormConfig::new(self.d_model).init(device),
            adapters: Vec::new(),
        }
    }
}

/// A low-rank residual adapter, as LoRA adds them for fine-tuning: `x + (x·A)·B` with `A`
/// `[d_model, rank]` and `B` `[rank, d_model]`. `B` starts at zero, so a fresh adapter leaves
/// the model's output as it was, and only `rank · 2 · d_model` parameters train.
#[derive(Module, Debug)]
pub struct Adapter<B: Backend> {
    down: Linear<B>,
    up: Linear<B>,
}

impl<B: Backend> Adapter<B> {
    /// A fresh adapter of `rank` on a residual stream of width `d_model`.
    pub fn new(d_model: usize, rank: usize, device: &B::Device) -> Self {
        Self {
            down: LinearConfig::new(d_model, rank)
                .with_bias(false)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device),
            up: LinearConfig::new(rank, d_model)
                .with_bias(false)
                .with_initializer(Initializer::Zeros)
                .init(device),
        }
    }

    /// `x + (x·A)·B`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let update = self.up.forward(self.down.forward(x.clone()));
        x + update
    }
}

/// Token and position embeddings, the blocks, a final layer norm, and an output head tied to
/// the token embedding (logits = h · Eᵀ); optionally an [`Adapter`] after each block, for
/// fine-tuning a frozen model.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    tokens: Embedding<B>,
    positions: Embedding<B>,
    blocks: TransformerEncoder<B>,
    norm: LayerNorm<B>,
    /// One per block, or none. Last, so that a model without adapters visits its parameters
    /// in the same order (and saves them under the same paths) as one that never had them.
    adapters: Vec<Adapter<B>>,
}

impl<B: Backend> Gpt<B> {
    /// Logits `[batch, seq, vocab]` of the next symbol after each position of `tokens`
    /// (`[batch, seq]`), each seeing only its own position and those before it.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device).reshape([1, seq]);
        let x = self.tokens.forward(tokens) + self.positions.forward(positions);
        let causal = generate_autoregressive_mask::<B>(batch, seq, &device);
        let h = if self.adapters.is_empty() {
            self.blocks
                .forward(TransformerEncoderInput::new(x).mask_attn(causal))
        } else {
            // The encoder stack's own loop, with each block's adapter after it.
            let mut h = x;
            for (block, adapter) in self.blocks.layers.iter().zip(&self.adapters) {
                h = block.forward(h, None, Some(causal.clone()));
                h = adapter.forward(h);
            }
            h
        };
        let h = self.norm.forward(h);
        let head = self.tokens.weight.val().transpose().unsqueeze::<3>();
        h.matmul(head)
    }

    /// Mean cross-entropy of the next-symbol predictions against `targets` (`[batch, seq]`),
    /// computed in f32 whatever the parameters' dtype.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let logits = self.forward(tokens).cast(DType::F32);
        let vocab = logits.dims()[2];
        CrossEntropyLossConfig::new().init(&device).forward(
            logits.reshape([batch * seq, vocab]),
            targets.reshape([batch * seq]),
        )
    }

    /// Number of parameters (elements).
    pub fn parameters(&self) -> usize {
        self.num_params()
    }

    /// Number of parameters (elements) that require a gradient.
    pub fn trainable_parameters(&self) -> usize {
        struct Trainable(usize);
        impl<B: Backend> ModuleVisitor<B> for Trainable {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let value = param.val();
                if value.is_require_grad() {
                    self.0 += value.shape().num_elements();
                }
            }
        }
        let mut count = Trainable(0);
        self.visit(&mut count);
        count.0
    }

    /// This model with a fresh [`Adapter`] of `rank` after each block (replacing any it had).
    pub fn with_adapters(mut self, rank: usize, device: &B::Device) -> Self {
        let d_model = self.norm.gamma.val().dims()[0];
        self.adapters = (0..self.blocks.layers.len())
            .map(|_| Adapter::new(d_model, rank, device))
            .collect();
        self
    }

    /// This model with every parameter but the adapters' frozen (no gradient): what a
    /// LoRA-style fine-tuning run trains.
    pub fn freeze_base(self) -> Self {
        Self {
            tokens: self.tokens.no_grad(),
            positions: self.positions.no_grad(),
            blocks: self.blocks.no_grad(),
            norm: self.norm.no_grad(),
            adapters: self.adapters,
        }
    }
}

/// The symbols of a text and the text as symbol ids.
pub struct Corpus {
    symbols: Vec<char>,
    ids: Vec<usize>,
}

impl Corpus {
    /// The corpus of `text`: its distinct characters, in code-point order, are the vocabulary.
    pub fn new(text: &str) -> Self {
        let mut symbols: Vec<char> = text.chars().collect();
        symbols.sort_unstable();
        symbols.dedup();
        let ids = text
            .chars()
            .map(|c| symbols.binary_search(&c).expect("a symbol of the text"))
            .collect();
        Self { symbols, ids }
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.symbols.len()
    }

    /// Length of the text in symbols.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// The text as symbol ids.
    pub fn ids(&self) -> &[usize] {
        &self.ids
    }

    /// Whether the text is empty.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The ids of `text`'s characters; characters outside the vocabulary are skipped.
    pub fn encode(&self, text: &str) -> Vec<usize> {
        text.chars()
            .filter_map(|c| self.symbols.binary_search(&c).ok())
            .collect()
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[usize]) -> String {
        ids.iter().map(|&i| self.symbols[i]).collect()
    }

    /// Rows `rows` of the global batch of `step`: windows of `seq` symbols at offsets drawn
    /// from `(seed, step, row)`, and the same windows shifted by one symbol (the targets).
    /// Any rank computes any row the same way, so a rank's slice needs no communication.
    pub fn batch<B: Backend>(
        &self,
        seed: u64,
        step: usize,
        rows: Range<usize>,
        seq: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let starts = (self.ids.len() - seq - 1) as u64;
        let n = rows.len();
        let mut inputs = Vec::with_capacity(n * seq);
        let mut targets = Vec::with_capacity(n * seq);
        for row in rows {
            let at = (mix(seed, ((step as u64) << 32) | row as u64) % starts) as usize;
            inputs.extend(self.ids[at..at + seq].iter().map(|&id| id as i64));
            targets.extend(self.ids[at + 1..at + seq + 1].iter().map(|&id| id as i64));
        }
        (
            Tensor::from_data(TensorData::new(inputs, [n, seq]), device),
            Tensor::from_data(TensorData::new(targets, [n, seq]), device),
        )
    }
}

/// A 64-bit hash of `(seed, index)` (splitmix64's finaliser): deterministic, backend-free
/// randomness for batch offsets and sampling.
pub fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_mul(0xD6E8_FEB8_6659_FD93)
        ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Reads every parameter once, so that lazily initialised parameters hold values before the
/// module is cloned or sharded (clones then share them).
pub struct Materialise;

impl<B: Backend> ModuleVisitor<B> for Materialise {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        param.val();
    }
}

/// Converts every parameter to a float dtype (f16, bf16), keeping it a trainable leaf.
pub struct CastParams(pub DType);

impl<B: AutodiffBackend> ModuleMapper<B> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, value, mapper) = param.consume();
        let trainable = value.is_require_grad();
        // Cast the inner (non-autodiff) tensor, so the result is a leaf, not a cast node.
        let cast = Tensor::<B, D>::from_inner(value.inner().cast(self.0));
        Param::from_mapped_value(id, cast.set_require_grad(trainable), mapper)
    }
}

/// Every parameter's values as f32, in module order. Reading a sharded parameter gathers it:
/// every rank must call this at the same point.
pub fn param_values<B: Backend, M: Module<B>>(module: &M) -> Vec<Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl<B: Backend> ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.push(data.to_vec().expect("f32 values"));
        }
    }
    let mut values = Values(Vec::new());
    module.visit(&mut values);
    values.0
}

/// A fingerprint of parameter values, bit for bit: `fnv1a64:` and the 64-bit FNV-1a hash of
/// every value's bits (little-endian), parameter by parameter in order, each parameter's
/// length first. Two runs end with the same parameters exactly when (but for a collision of
/// 2⁻⁶⁴) their digests are equal, so runs on different machines or numbers of processes can
/// be compared by one line of output.
pub fn params_digest(params: &[Vec<f32>]) -> String {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    let mut eat = |bytes: &[u8]| {
        for &byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(PRIME);
        }
    };
    for param in params {
        eat(&(param.len() as u64).to_le_bytes());
        for value in param {
            eat(&value.to_bits().to_le_bytes());
        }
    }
    format!("fnv1a64:{hash:016x}")
}
