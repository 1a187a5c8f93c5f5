//! The parameters of a sharded module, as a checkpoint sees them: module path, key, the group
//! that sharded them and this rank's value (a shard, or the whole tensor).

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, ElementConversion, Tensor, TensorData, TensorMetadata};
use burn_zero_comm::ReduceOp;
use burn_zero_core::{ParamInfo, Zero, ZeroGroup, ZeroTensor, group_of};

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

/// The module's parameters in visit order, and the group that sharded them.
pub(crate) struct RankParams<B: Backend> {
    pub group: Arc<ZeroGroup<B>>,
    pub params: Vec<RankParam<B>>,
}

struct Collect<B: Backend> {
    groups: Vec<(Arc<ZeroGroup<B>>, Vec<ParamInfo>)>,
    params: Vec<(usize, RankParam<B>)>,
    unsharded: usize,
}

impl<AB, B> ModuleVisitor<AB> for Collect<B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        let Some((group, key)) = group_of::<B>(&DistributedParamId::from(param.id.val())) else {
            self.unsharded += 1;
            return;
        };
        let index = match self.groups.iter().position(|(g, _)| Arc::ptr_eq(g, &group)) {
            Some(index) => index,
            None => {
                let infos = group.params();
                self.groups.push((group, infos));
                self.groups.len() - 1
            }
        };
        let Some(info) = self.groups[index].1.get(key).cloned() else {
            self.unsharded += 1;
            return;
        };
        let tensor = param.val();
        let frozen = !tensor.is_require_grad();
        let value = tensor.inner().into_primitive().tensor();
        self.params.push((
            index,
            RankParam {
                id: param.id,
                info,
                value,
                frozen,
            },
        ));
    }
}

/// The parameters of `module`, which must have been sharded (as one module) on this thread.
pub(crate) fn collect<AB, B, M>(module: &M) -> Result<RankParams<B>, CheckpointError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
    M: Module<AB>,
{
    let mut collect = Collect {
        groups: Vec::new(),
        params: Vec::new(),
        unsharded: 0,
    };
    module.visit(&mut collect);
    if collect.groups.len() != 1 || collect.unsharded > 0 {
        return Err(CheckpointError::Unsupported(format!(
            "checkpoints need a module sharded with `shard` on this thread, as one module; this \
             one has {} parameters from {} sharded modules and {} not sharded",
            collect.params.len(),
            collect.groups.len(),
            collect.unsharded
        )));
    }
    let group = collect.groups.remove(0).0;
    Ok(RankParams {
        group,
        params: collect.params.into_iter().map(|(_, p)| p).collect(),
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
/// rank that succeeded while another failed returns [`CheckpointError::OtherRank`].
pub(crate) fn agree<B: Backend, T>(
    group: &ZeroGroup<B>,
    result: Result<T, CheckpointError>,
    what: &'static str,
) -> Result<T, CheckpointError> {
    let failed = if result.is_err() { 1.0f32 } else { 0.0 };
    let flag = Tensor::<B, 1>::from_floats([failed], group.device());
    let total = group.comm().all_reduce(flag, ReduceOp::Sum);
    let result = result?;
    let total = total?.into_scalar().elem::<f32>();
    if total > 0.0 {
        return Err(CheckpointError::OtherRank {
            rank: group.rank(),
            what,
        });
    }
    Ok(result)
}

/// Params by id, for mapping new values into the module.
pub(crate) type NewValues<B> = HashMap<ParamId, ZeroTensor<B>>;
