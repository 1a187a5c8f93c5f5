//! Passes of the test block without an optimizer, and their single-rank references: a pass is
//! one forward (or two, added up) and one backward on a micro-batch, and what it gives is the
//! loss and every parameter's reduced gradient (gathered: a collective every rank runs in the
//! same order). A backward pass uses up the parameters' marks for the gradient hooks, which
//! an optimizer step renews; without one, [`remark`] renews them before the next pass. The
//! references compute each micro-batch's gradients unsharded and add them up here on the host,
//! in f32, in the order the collectives are expected to use.

#![allow(dead_code)]

use burn::backend::Flex;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::distributed::DistributedParamId;
use burn_zero_core::ZeroState;
use burn_zero_testing::{Block, Inner, Train, bits_equal, micro_batch};

/// Every parameter's values (or gradient) as f32, in visit order.
pub type Values = Vec<Vec<f32>>;

/// Every parameter's gradient in `grads` as f32 values, in visit order. A sharded gradient is
/// gathered (a collective, not a parameter gather: the prefetcher does not see it).
pub fn grad_values(model: &Block<Train>, grads: &GradientsParams) -> Values {
    struct Read<'a> {
        grads: &'a GradientsParams,
        out: Values,
    }
    impl ModuleVisitor<Train> for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
            let grad = self
                .grads
                .get::<Inner, D>(param.id)
                .expect("every parameter has a gradient");
            let data = grad.into_data().convert::<f32>();
            self.out.push(data.to_vec::<f32>().expect("f32 data"));
        }
    }
    let mut read = Read {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut read);
    read.out
}

/// The module with every sharded parameter marked again for the gradient hooks (what
/// `ZeroOptimizer::step` does after each backward): without it, the next backward is not
/// reduced. Values are left as they are.
pub fn remark<M: Module<Train>>(model: M) -> M {
    struct Remark;
    impl<AB: AutodiffBackend> ModuleMapper<AB> for Remark {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<AB, D>>,
        ) -> Param<Tensor<AB, D>> {
            let (id, tensor, mapper) = param.consume();
            let tensor = if tensor.is_distributed() {
                tensor.set_distributed(DistributedParamId::from(id.val()))
            } else {
                tensor
            };
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    model.map(&mut Remark)
}

/// One pass on micro-batch `index`: the loss (of two forward passes added up when `twice`: a
/// second gather order), and the gradients after backward (reduced across the ranks when the
/// model is sharded).
pub fn pass(model: &Block<Train>, index: usize, twice: bool) -> (f32, Values) {
    let (loss, grads) = backward(model, index, twice);
    (loss, grad_values(model, &grads))
}

/// `count` passes of the sharded `model` on rank `rank` of `world` (pass `p` on micro-batch
/// `p · world + rank`, forward twice where `twice(p, rank)`), each followed by emptying the
/// gather cache (reading the gradients gathered them into it, after backward had emptied it)
/// and renewing the gradient-hook marks ([`remark`]), as an optimizer step leaves them.
/// Returns the model after them, and each pass's loss and reduced gradients.
pub fn passes(
    mut model: Block<Train>,
    zero: &ZeroState<Flex>,
    count: usize,
    (rank, world): (usize, usize),
    twice: impl Fn(usize, usize) -> bool,
) -> (Block<Train>, Vec<(f32, Values)>) {
    let mut done = Vec::with_capacity(count);
    for index in 0..count {
        done.push(pass(&model, index * world + rank, twice(index, rank)));
        zero.clear_gather_cache();
        model = remark(model);
    }
    (model, done)
}

/// [`pass`] up to the end of backward: the loss, and the gradients not read yet.
pub fn backward(model: &Block<Train>, index: usize, twice: bool) -> (f32, GradientsParams) {
    let device = Default::default();
    let (tokens, targets) = micro_batch::<Train>(index, &device);
    let mut loss = model.loss(tokens.clone(), targets.clone());
    if twice {
        loss = loss + model.loss(tokens, targets);
    }
    let value = loss.clone().into_scalar();
    (value, GradientsParams::from_grads(loss.backward(), model))
}

/// The mean of `per_rank` (each rank's gradients, in rank order) as hybrid sharding adds it
/// up: rank order within each group of `group` consecutive ranks, then the groups' sums in
/// group order, divided once by the number of ranks. `group` = the number of ranks is plain
/// rank order.
pub fn mean_in_groups(per_rank: &[Values], group: usize) -> Values {
    let world = per_rank.len();
    let add = |a: Values, b: &Values| -> Values {
        a.into_iter()
            .zip(b)
            .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p + q).collect())
            .collect()
    };
    let sum_in_order = |parts: Vec<Values>| {
        let mut parts = parts.into_iter();
        let first = parts.next().expect("one part at least");
        parts.fold(first, |acc, part| add(acc, &part))
    };
    let groups: Vec<Values> = per_rank
        .chunks(group)
        .map(|ranks| sum_in_order(ranks.to_vec()))
        .collect();
    let total = sum_in_order(groups);
    if world == 1 {
        return total;
    }
    let n = world as f32;
    total
        .into_iter()
        .map(|g| g.into_iter().map(|x| x / n).collect())
        .collect()
}

/// The single-rank reference of pass `pass` over `world` ranks (rank `r` on micro-batch
/// `pass · world + r`, twice when `twice(pass, r)`): each micro-batch's loss, and their
/// gradients' mean added up in groups of `group` ([`mean_in_groups`]), all computed on the
/// unsharded `base`.
pub fn reference_pass(
    base: &Block<Train>,
    pass_index: usize,
    world: usize,
    group: usize,
    twice: impl Fn(usize, usize) -> bool,
) -> (Vec<f32>, Values) {
    let (losses, grads): (Vec<f32>, Vec<Values>) = (0..world)
        .map(|rank| pass(base, pass_index * world + rank, twice(pass_index, rank)))
        .unzip();
    (losses, mean_in_groups(&grads, group))
}

/// Whether two lists of values are equal bit for bit.
pub fn values_bits_equal(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| bits_equal(x, y))
}

/// Asserts that every rank's passes (loss, reduced gradients) equal the references (one per
/// pass: each rank's micro-batch loss, and the mean gradients) bit for bit.
pub fn assert_passes_equal(got: &[Vec<(f32, Values)>], want: &[(Vec<f32>, Values)], what: &str) {
    for (rank, passes) in got.iter().enumerate() {
        assert_eq!(passes.len(), want.len(), "{what}, rank {rank}: passes");
        for (index, ((loss, grads), (losses, mean))) in passes.iter().zip(want).enumerate() {
            assert_eq!(
                loss.to_bits(),
                losses[rank].to_bits(),
                "{what}, rank {rank}, pass {index}: loss {loss} against {}",
                losses[rank]
            );
            assert!(
                values_bits_equal(grads, mean),
                "{what}, rank {rank}, pass {index}: reduced gradients differ from the \
                 single-rank reference"
            );
        }
    }
}
