//! The step's last phase: each prepared gradient stepped on its master, and the new values
//! written into the module (as shards, gathered, or in host memory); and the mappers that renew
//! the parameters' gradient marks when a step leaves the values as they are.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::SimpleOptimizer;
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};
use burn_zero_comm::RankCounters;
use burn_zero_core::{ShardedView, Zero, ZeroTensor};

use super::collect::{Taken, flat};
use super::pending::PendingChunks;
use super::prepare::Prepared;
use super::{Side, bound};
use crate::master::{Master, cast_to};
use crate::place::Place;

impl<O, B: Backend, P: Place<B>> Side<O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// Last phase: steps every prepared gradient, multiplied by `factor`, and writes the new
    /// values into `module`.
    pub(crate) fn apply<AB, M>(
        &mut self,
        lr: f64,
        factor: f64,
        module: M,
        prepared: Prepared<B, P::Host>,
    ) -> M
    where
        AB: AutodiffBackend<InnerBackend = Zero<B>>,
        M: AutodiffModule<AB>,
    {
        let Prepared {
            taken,
            values,
            ids,
            chunk_grads,
            ..
        } = prepared;
        let chunks = PendingChunks::new(bound(&self.zero).store(), chunk_grads, values, ids);
        let mut apply = Apply {
            optimizer: self,
            lr,
            factor,
            taken,
            chunks,
        };
        let module = module.map(&mut apply);
        debug_assert!(
            apply.chunks.is_done(),
            "every chunk with a gradient has a member in the module it was collected from"
        );
        module
    }

    /// Parameter `key`'s master values on the model's `device` in `dtype`, when this
    /// optimizer holds them (to refill a shard `reuse_fp16_shard` released).
    pub(crate) fn master_on_model(
        &self,
        key: usize,
        device: &B::Device,
        dtype: DType,
    ) -> Option<Tensor<B, 1>> {
        let layout = self.zero.as_ref().map(|zero| zero.store().chunks());
        let master = self.masters.values_of(key, layout)?;
        let counters = bound(&self.zero).store().counters();
        Some(written_back::<B, P>(master, device, dtype, counters))
    }
}

/// Second pass: steps every parameter that has a gradient.
struct Apply<'a, O, B: Backend, P: Place<B>>
where
    O: SimpleOptimizer<P::Host>,
{
    optimizer: &'a mut Side<O, B, P>,
    lr: f64,
    factor: f64,
    taken: HashMap<ParamId, Taken<P::Host>>,
    /// The chunks to step, each when the walk reaches its first member.
    chunks: PendingChunks<B, P::Host>,
}

impl<O, B: Backend, P: Place<B>> Apply<'_, O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// The new value of a parameter (currently `value`) after a step with its gradient.
    fn update(&mut self, taken: Taken<P::Host>, value: ZeroTensor<B>) -> ZeroTensor<B> {
        let Taken { key, grad } = taken;
        let grad = grad.tensor();
        let store = bound(&self.optimizer.zero).store().clone();
        let sharded_grad = store.gradient_is_sharded(key);
        let shape = value.shape();
        let dtype = value.dtype();
        let master = self.optimizer.masters.param_or_make(key, || {
            let values = match &value {
                ZeroTensor::Sharded(view) => flat(view.param().shard().clone()),
                ZeroTensor::Local(full) if sharded_grad => store.own_block(flat(full.clone())),
                ZeroTensor::Local(full) => flat(full.clone()),
            };
            Master::new(P::to_host(values, store.counters()))
        });
        if master.values.dims() != grad.dims() {
            panic!(
                "burn-zero: rank {}: parameter #{key} has a gradient part of {} elements but its \
                 optimizer state holds {}; was the optimizer record saved by another rank or a \
                 group of another size?",
                store.rank(),
                grad.dims()[0],
                master.values.dims()[0]
            );
        }
        if matches!(value, ZeroTensor::Sharded(_)) {
            store.hold_master(key);
        }
        let one_pass = self.optimizer.one_pass;
        let optim = &self.optimizer.optim;
        let updated = master.step(optim, one_pass, self.lr, grad, self.factor, dtype);
        if let ZeroTensor::Sharded(view) = &value
            && store.is_on_host(key)
        {
            // An offloaded shard goes (or stays) in host memory, without a trip to the device.
            let data = P::into_host_data(cast_to(updated, dtype), store.counters());
            let param = view.param().with_host_shard(data);
            return ZeroTensor::Sharded(ShardedView::new(Arc::new(param)));
        }
        let updated = written_back::<B, P>(updated, store.device(), dtype, store.counters());
        match value {
            ZeroTensor::Sharded(view) => {
                let param = view.param().with_shard(updated.into_primitive().tensor());
                ZeroTensor::Sharded(ShardedView::new(Arc::new(param)))
            }
            ZeroTensor::Local(_) if sharded_grad => {
                // Stages 1 and 2: every rank stepped its block; gather the whole parameter.
                let full = store
                    .all_gather_full(updated, &shape)
                    .unwrap_or_else(|error| {
                        panic!(
                            "burn-zero: rank {} could not gather updated parameter #{key}: {error}",
                            store.rank()
                        )
                    });
                ZeroTensor::Local(full)
            }
            ZeroTensor::Local(_) => {
                ZeroTensor::Local(B::float_reshape(updated.into_primitive().tensor(), shape))
            }
        }
    }
}

impl<AB, O, B, P> ModuleMapper<AB> for Apply<'_, O, B, P>
where
    B: Backend,
    P: Place<B>,
    O: SimpleOptimizer<P::Host>,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let stepped = self
            .optimizer
            .take_stepped(self.lr, self.factor, &mut self.chunks, param.id);
        if let Some(value) = stepped {
            let (id, tensor, mapper) = param.consume();
            let tensor = marked_parameter::<AB, B, D>(id, value, tensor.is_require_grad());
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let Some(taken) = self.taken.remove(&param.id) else {
            return <Remark as ModuleMapper<AB>>::map_float(&mut Remark, param);
        };
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let value = tensor.inner().into_primitive().tensor();
        self.chunks.forget(taken.key);
        let updated = self.update(taken, value);
        let tensor = marked_parameter::<AB, B, D>(id, updated, require_grad);
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// A master copy's fp32 values as a parameter's values: on the model's `device`, in `dtype`
/// (an upload counted in `counters` when the master is offloaded).
fn written_back<B: Backend, P: Place<B>>(
    values: Tensor<P::Host, 1>,
    device: &B::Device,
    dtype: DType,
    counters: &RankCounters,
) -> Tensor<B, 1> {
    cast_to(P::to_model(values, device, counters), dtype)
}

/// A parameter tensor holding `value`, marked for the gradient hooks.
fn marked_parameter<AB, B, const D: usize>(
    id: ParamId,
    value: ZeroTensor<B>,
    require_grad: bool,
) -> Tensor<AB, D>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    let inner = Tensor::<Zero<B>, D>::from_primitive(TensorPrimitive::Float(value));
    Tensor::<AB, D>::from_inner(inner)
        .set_require_grad(require_grad)
        .set_distributed(DistributedParamId::from(id.val()))
}

/// A parameter's master values on the model's device in a dtype, by key, when held.
pub(crate) type MasterOnModel<'a, B> =
    dyn Fn(usize, &<B as BackendTypes>::Device, DType) -> Option<Tensor<B, 1>> + 'a;

/// For steps that leave values as they are (a skipped step, a micro-step inside an
/// accumulation window): renews every parameter's gradient-hook mark, and rewrites shards
/// released by `reuse_fp16_shard` from their fp32 masters (found by `master`).
pub(crate) struct Refill<'a, B: Backend> {
    pub master: &'a MasterOnModel<'a, B>,
}

impl<AB, B> ModuleMapper<AB> for Refill<'_, B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let param = <Remark as ModuleMapper<AB>>::map_float(&mut Remark, param);
        let (id, tensor, mapper) = param.consume();
        let tensor = match tensor.clone().inner().into_primitive().tensor() {
            ZeroTensor::Sharded(view) if view.param().is_released() => {
                let shard = view.param();
                let values = (self.master)(shard.key(), shard.device(), shard.dtype())
                    .unwrap_or_else(|| {
                        panic!(
                            "burn-zero: parameter #{} was released but this optimizer has no \
                             master copy of it",
                            shard.key()
                        )
                    });
                let refilled = shard.with_shard(values.into_primitive().tensor());
                let value = ZeroTensor::Sharded(ShardedView::new(Arc::new(refilled)));
                marked_parameter::<AB, B, D>(id, value, tensor.is_require_grad())
            }
            _ => tensor,
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Renews the gradient-hook mark of every parameter of a sharded module (each backward
/// consumes it), leaving values as they are.
struct Remark;

impl<AB: AutodiffBackend> ModuleMapper<AB> for Remark {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        // Only parameters of a sharded module carry a mark to renew.
        let tensor = if tensor.is_distributed() {
            tensor.set_distributed(DistributedParamId::from(id.val()))
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}
