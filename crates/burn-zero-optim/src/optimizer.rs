//! `ZeroOptimizer`: a Burn optimizer step on each rank's shard.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::optim::{GradientsParams, SimpleOptimizer};
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Shape, Slice, Tensor, TensorMetadata, TensorPrimitive};
use burn_zero_core::{ShardedView, Zero, ZeroGroup, ZeroTensor, group_of};

use crate::master::Master;

/// Steps every parameter of a module sharded with `burn_zero_core::shard` using the
/// [`SimpleOptimizer`] `O` (e.g. `AdamConfig::new().build()`), on this rank's part only.
///
/// - The gradient of each parameter is this rank's shard of the mean over ranks (stages 1–3),
///   or the whole mean (stage 0 and replicated parameters).
/// - The optimizer runs on an fp32 master copy of that part, whatever the parameter's dtype;
///   its state covers that part only, so it is 1/N of the usual size.
/// - The result is written back in the parameter's dtype: as the parameter's new shard
///   (stage 3), or all-gathered into the replicated parameter (stages 1 and 2). Every
///   parameter stays marked for the gradient hooks.
///
/// Call [`ZeroOptimizer::step`] on every rank with that rank's gradients.
pub struct ZeroOptimizer<O: SimpleOptimizer<B>, B: Backend> {
    optim: O,
    masters: BTreeMap<usize, Master<O, B>>,
}

impl<O: SimpleOptimizer<B>, B: Backend> ZeroOptimizer<O, B> {
    /// Wraps `optim`.
    pub fn new(optim: O) -> Self {
        Self {
            optim,
            masters: BTreeMap::new(),
        }
    }

    /// One optimizer step with learning rate `lr`: `module` updated with `grads` (from
    /// `GradientsParams::from_grads`). Parameters without a gradient on any rank are left as
    /// they are.
    pub fn step<AB, M>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M
    where
        AB: AutodiffBackend<InnerBackend = Zero<B>>,
        M: AutodiffModule<AB>,
    {
        let mut stepper = Stepper {
            optimizer: self,
            lr,
            grads,
            orphans: Vec::new(),
        };
        module.map(&mut stepper)
    }

    /// Bytes of fp32 master copies this rank holds.
    pub fn master_bytes(&self) -> usize {
        self.masters
            .values()
            .map(|m| m.values.shape().num_elements() * DType::F32.size())
            .sum()
    }
}

struct Stepper<'a, O: SimpleOptimizer<B>, B: Backend> {
    optimizer: &'a mut ZeroOptimizer<O, B>,
    lr: f64,
    grads: GradientsParams,
    /// Orphan gradients taken from each group met so far.
    orphans: Vec<(Arc<ZeroGroup<B>>, Orphans<B>)>,
}

/// Reduced gradients of parameters a rank did not use, by parameter key.
type Orphans<B> = BTreeMap<usize, ZeroTensor<B>>;

/// A 1-D tensor of the inner backend from a primitive.
fn flat<B: Backend>(primitive: B::FloatTensorPrimitive) -> Tensor<B, 1> {
    let numel = primitive.shape().num_elements();
    Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(
        primitive,
        Shape::new([numel]),
    )))
}

impl<O: SimpleOptimizer<B>, B: Backend> Stepper<'_, O, B> {
    fn orphan(&mut self, group: &Arc<ZeroGroup<B>>, key: usize) -> Option<ZeroTensor<B>> {
        let index = match self.orphans.iter().position(|(g, _)| Arc::ptr_eq(g, group)) {
            Some(index) => index,
            None => {
                self.orphans
                    .push((group.clone(), group.take_orphan_gradients()));
                self.orphans.len() - 1
            }
        };
        self.orphans[index].1.remove(&key)
    }

    /// The new value of parameter `key` (currently `value`) after a step with `grad`.
    fn update(
        &mut self,
        group: &Arc<ZeroGroup<B>>,
        key: usize,
        value: ZeroTensor<B>,
        grad: ZeroTensor<B>,
    ) -> ZeroTensor<B> {
        let sharded_grad = group.gradient_is_sharded(key);
        let grad = match grad {
            ZeroTensor::Sharded(view) if sharded_grad => flat(view.param().shard().clone()),
            ZeroTensor::Local(full) if !sharded_grad => flat(full),
            other => panic!(
                "burn-zero: the gradient of parameter #{key} is {} but this stage reduces it {}",
                if other.as_sharded().is_some() {
                    "sharded"
                } else {
                    "whole"
                },
                if sharded_grad { "to shards" } else { "whole" },
            ),
        };
        let shape = value.shape();
        let dtype = value.dtype();
        let master = self.optimizer.masters.entry(key).or_insert_with(|| {
            Master::new(match &value {
                ZeroTensor::Sharded(view) => flat(view.param().shard().clone()),
                ZeroTensor::Local(full) if sharded_grad => group.own_block(flat(full.clone())),
                ZeroTensor::Local(full) => flat(full.clone()),
            })
        });
        let updated = master.step(&self.optimizer.optim, self.lr, grad);
        let updated = if dtype == DType::F32 {
            updated
        } else {
            updated.cast(dtype)
        };
        match value {
            ZeroTensor::Sharded(view) => {
                let param = view.param().with_shard(updated.into_primitive().tensor());
                ZeroTensor::Sharded(ShardedView::new(Arc::new(param)))
            }
            ZeroTensor::Local(_) if sharded_grad => {
                // Stages 1 and 2: every rank stepped its block; gather the whole parameter.
                let full = group.comm().all_gather(updated).unwrap_or_else(|error| {
                    panic!(
                        "burn-zero: rank {} could not gather updated parameter #{key}: {error}",
                        group.rank()
                    )
                });
                let full = full.into_primitive().tensor();
                ZeroTensor::Local(B::float_reshape(
                    B::float_slice(full, &[Slice::from(0..shape.num_elements())]),
                    shape,
                ))
            }
            ZeroTensor::Local(_) => {
                ZeroTensor::Local(B::float_reshape(updated.into_primitive().tensor(), shape))
            }
        }
    }
}

impl<AB, O, B> ModuleMapper<AB> for Stepper<'_, O, B>
where
    B: Backend,
    O: SimpleOptimizer<B>,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let mark = DistributedParamId::from(id.val());
        let Some((group, key)) = group_of::<B>(&mark) else {
            // Not a parameter of a sharded module: not ours to step.
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let grad = self
            .grads
            .remove::<Zero<B>, D>(id)
            .map(|g| g.into_primitive().tensor())
            .or_else(|| self.orphan(&group, key));
        let Some(grad) = grad else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let value = tensor.inner().into_primitive().tensor();
        let updated = self.update(&group, key, value, grad);
        let inner = Tensor::<Zero<B>, D>::from_primitive(TensorPrimitive::Float(updated));
        let tensor = Tensor::<AB, D>::from_inner(inner)
            .set_require_grad(require_grad)
            .set_distributed(mark);
        Param::from_mapped_value(id, tensor, mapper)
    }
}
