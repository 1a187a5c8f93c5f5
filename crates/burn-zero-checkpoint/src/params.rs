//! The parameters of a sharded module, as a checkpoint sees them: module path, key, the state
//! of the `shard` call that sharded them and this rank's value (a shard, or the whole tensor).

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData, TensorMetadata};
use burn_zero_comm::{Communicator, agree};
use burn_zero_core::{ParamInfo, Zero, ZeroState, ZeroTensor};

use crate::error::CheckpointError;

/// One parameter of the module on this rank.
pub(crate) struct RankParam<B: Backend> {
    pub id: ParamId,
    pub info: ParamInfo,
    pub value: ZeroTensor<B>,
    pub frozen: bool,
}

impl<B: Backend> RankParam<B> {
    /// Whether this rank holds a shard of it (rather than the whole tensor).
    pub fn is_sharded(&self) -> bool {
        self.value.as_sharded().is_some()
    }

    pub fn numel(&self) -> usize {
        self.info.shape.num_elements()
    }
}

/// The module's parameters in visit order, and the state of the `shard` call that sharded them.
pub(crate) struct RankParams<B: Backend> {
    pub zero: ZeroState<B>,
    pub params: Vec<RankParam<B>>,
}

struct Collect<'a, B: Backend> {
    zero: &'a ZeroState<B>,
    infos: Vec<ParamInfo>,
    params: Vec<RankParam<B>>,
    unsharded: usize,
}

impl<AB, B> ModuleVisitor<AB> for Collect<'_, B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        let id = DistributedParamId::from(param.id.val());
        let Some(key) = self.zero.store().key_of(&id) else {
            self.unsharded += 1;
            return;
        };
        let Some(info) = self.infos.get(key).cloned() else {
            self.unsharded += 1;
            return;
        };
        let tensor = param.val();
        let frozen = !tensor.is_require_grad();
        let value = tensor.inner().into_primitive().tensor();
        self.params.push(RankParam {
            id: param.id,
            info,
            value,
            frozen,
        });
    }
}

/// The parameters of `module`, which must have been sharded as one module by the `shard` call
/// that returned `zero`.
pub(crate) fn collect<AB, B, M>(
    module: &M,
    zero: &ZeroState<B>,
) -> Result<RankParams<B>, CheckpointError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
    M: Module<AB>,
{
    let mut collect = Collect {
        zero,
        infos: zero.params(),
        params: Vec::new(),
        unsharded: 0,
    };
    module.visit(&mut collect);
    if collect.params.is_empty() || collect.unsharded > 0 {
        return Err(CheckpointError::Unsupported(format!(
            "checkpoints need a module sharded with `shard`, as one module, and the optimizer \
             built from the state that `shard` returned; this module has {} parameters of \
             the optimizer's sharded module and {} others",
            collect.params.len(),
            collect.unsharded
        )));
    }
    Ok(RankParams {
        zero: zero.clone(),
        params: collect.params,
    })
}

/// The tensor's values, flat, as bytes of its own dtype: elements `[start, end)` of a whole
/// tensor, or the first `end - start` elements of a shard.
pub(crate) fn flat_bytes<B: Backend>(value: &ZeroTensor<B>, start: usize, end: usize) -> Vec<u8> {
    let (tensor, from) = match value {
        ZeroTensor::Sharded(view) => (view.param().shard(), 0),
        ZeroTensor::Local(tensor) => (tensor.clone(), start),
    };
    let numel = tensor.shape().num_elements();
    let flat = Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
        B::float_reshape(tensor, [numel].into()),
    ));
    slice_bytes(flat, from, from + (end - start))
}

/// Elements `[start, end)` of a flat tensor as bytes of its dtype.
pub(crate) fn slice_bytes<B: Backend>(flat: Tensor<B, 1>, start: usize, end: usize) -> Vec<u8> {
    if start == end {
        return Vec::new();
    }
    let part = if start == 0 && end == flat.dims()[0] {
        flat
    } else {
        flat.slice(start..end)
    };
    part.into_data().as_bytes().to_vec()
}

/// A flat tensor on `device` from bytes of `stored` dtype, converted to `dtype`.
pub(crate) fn tensor_from_bytes<B: Backend>(
    bytes: Vec<u8>,
    stored: DType,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, 1> {
    let len = bytes.len() / stored.size();
    let mut data = TensorData::from_bytes_vec(bytes, [len], stored);
    if stored != dtype {
        data = data.convert_dtype(dtype);
    }
    Tensor::<B, 1>::from_data(data, (device, dtype))
}

/// Every rank learns whether every rank succeeded: a rank's own error is returned as is, and a
/// rank that succeeded while another failed returns [`CheckpointError::OtherRank`] naming the
/// ranks that failed. A failing rank reports its error to the group before the others learn of
/// it, so the job's error names it as the cause.
pub(crate) fn agree<B: Backend, T>(
    zero: &ZeroState<B>,
    result: Result<T, CheckpointError>,
    what: &'static str,
) -> Result<T, CheckpointError> {
    agree_on(zero.comm().as_ref(), zero.device(), result, what)
}

/// [`agree`] over the ranks of `comm` (every rank of the job, for hybrid sharding's shard
/// groups that wait for the group that writes).
pub(crate) fn agree_on<B: Backend, T>(
    comm: &dyn Communicator<B>,
    device: &B::Device,
    result: Result<T, CheckpointError>,
    what: &'static str,
) -> Result<T, CheckpointError> {
    let failure = result
        .as_ref()
        .err()
        .map(|error| format!("{what} failed: {error}"));
    let failed = agree::failed_ranks(comm, device, failure.as_deref());
    let result = result?;
    let failed = failed?;
    if !failed.is_empty() {
        return Err(CheckpointError::OtherRank {
            rank: comm.rank(),
            what,
            failed,
        });
    }
    Ok(result)
}

/// Params by id, for mapping new values into the module.
pub(crate) type NewValues<B> = HashMap<ParamId, ZeroTensor<B>>;

/// The error for an optimizer made with `ZeroOptimizer::unbound` that was never bound.
pub(crate) fn unbound() -> CheckpointError {
    CheckpointError::Unsupported(
        "the optimizer is not bound to a sharded module (made with `ZeroOptimizer::unbound` and \
         no `ZeroOptimizerRecord::binding` loaded): build it with `ZeroOptimizer::new(&zero_state, \
         optim)`"
            .to_string(),
    )
}
