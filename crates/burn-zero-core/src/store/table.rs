//! The parameter table: what the store knows of each parameter of the sharded module.

use std::collections::HashMap;

use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::{DType, Shape};

/// What the store knows of one parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// Position in the module's visit order.
    pub key: usize,
    /// Path in the module, as `blocks.0.attn.query.weight`.
    pub path: String,
    /// Full shape.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
    /// Replicated (below `persist_below_numel`) rather than sharded.
    pub persistent: bool,
    /// Required a gradient when the module was sharded. A frozen parameter (`false`) is
    /// gathered for compute like any other, but it has no place in the gradient buckets, is
    /// never reduced, and an optimizer keeps no master copy or state of it.
    pub trainable: bool,
}

/// Every parameter in visit order, and the key of each gradient-hook mark.
///
/// Filled while the module is sharded and fixed afterwards, so readers take no lock.
#[derive(Debug, Default)]
pub struct ParamTable {
    infos: Vec<ParamInfo>,
    keys: HashMap<DistributedParamId, usize>,
}

impl ParamTable {
    /// Adds the next parameter in visit order, marked `id` for the gradient hooks.
    pub fn push(&mut self, info: ParamInfo, id: DistributedParamId) {
        self.keys.insert(id, info.key);
        self.infos.push(info);
    }

    /// Every parameter, in visit order.
    pub fn infos(&self) -> &[ParamInfo] {
        &self.infos
    }

    /// Parameter `key`.
    pub fn get(&self, key: usize) -> Option<&ParamInfo> {
        self.infos.get(key)
    }

    /// The key of the parameter marked `id`.
    pub fn key_of(&self, id: &DistributedParamId) -> Option<usize> {
        self.keys.get(id).copied()
    }

    /// Every gradient-hook mark.
    pub fn ids(&self) -> impl Iterator<Item = &DistributedParamId> {
        self.keys.keys()
    }
}
