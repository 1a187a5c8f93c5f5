//! `ZeroTensor`: the float primitive of `Zero<B>` — a local tensor, or a view of a sharded one.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, TensorMetadata};

use crate::store::ShardedParam;
use crate::view::{ViewOp, debug_check_shape};

/// The float tensor primitive of [`crate::Zero`].
///
/// `Local` is an ordinary tensor of the inner backend. `Sharded` is a parameter (or a gradient)
/// of which this rank holds a flat 1/N shard, seen through lazy view ops; compute ops gather it
/// (see [`ZeroTensor::materialize`]). Shape, dtype and device answer from metadata.
#[derive(Debug, Clone)]
pub enum ZeroTensor<B: Backend> {
    /// A plain tensor of the inner backend.
    Local(B::FloatTensorPrimitive),
    /// A sharded tensor, seen through `views`.
    Sharded(ShardedView<B>),
}

/// A sharded tensor and the view ops applied to it since it was sharded.
#[derive(Debug, Clone)]
pub struct ShardedView<B: Backend> {
    pub(crate) param: Arc<ShardedParam<B>>,
    pub(crate) views: Vec<ViewOp>,
    pub(crate) shape: Shape,
}

impl<B: Backend> ShardedView<B> {
    /// A view of the whole tensor, in its own shape.
    pub fn new(param: Arc<ShardedParam<B>>) -> Self {
        let shape = param.shape().clone();
        Self {
            param,
            views: Vec::new(),
            shape,
        }
    }

    /// The sharded tensor behind the view.
    pub fn param(&self) -> &Arc<ShardedParam<B>> {
        &self.param
    }

    /// Whether no view op was applied (the view is the tensor in its own shape).
    pub fn is_identity(&self) -> bool {
        self.views.is_empty()
    }

    fn push(mut self, view: ViewOp) -> Self {
        self.shape = view.output_shape(&self.shape);
        self.views.push(view);
        self
    }
}

impl<B: Backend> ZeroTensor<B> {
    /// The tensor as the inner backend's primitive, gathering it if it is sharded. A gather is
    /// a collective: every rank must materialise the same tensors in the same order, which the
    /// identical (SPMD) forward and backward passes of data-parallel training guarantee.
    ///
    /// # Panics
    /// When the gather fails (another rank failed, schedules diverged, a timeout). Backend ops
    /// cannot return errors; `launch` turns the panic into an error naming the rank.
    pub fn materialize(self) -> B::FloatTensorPrimitive {
        match self {
            ZeroTensor::Local(tensor) => tensor,
            ZeroTensor::Sharded(view) => {
                let full = view.param.gather();
                let out = view.views.iter().fold(full, |t, v| v.apply::<B>(t));
                debug_check_shape(&out, &view.shape);
                out
            }
        }
    }

    /// Records a view op: lazily on a sharded tensor, at once on a local one.
    pub(crate) fn view(self, op: ViewOp) -> Self {
        match self {
            ZeroTensor::Local(tensor) => ZeroTensor::Local(op.apply::<B>(tensor)),
            ZeroTensor::Sharded(view) => ZeroTensor::Sharded(view.push(op)),
        }
    }

    /// The sharded view, if this tensor is sharded.
    pub fn as_sharded(&self) -> Option<&ShardedView<B>> {
        match self {
            ZeroTensor::Sharded(view) => Some(view),
            ZeroTensor::Local(_) => None,
        }
    }

    /// The device the tensor lives on (its shard's device when sharded).
    pub fn device(&self) -> B::Device {
        match self {
            ZeroTensor::Local(tensor) => B::float_device(tensor),
            ZeroTensor::Sharded(view) => view.param.device().clone(),
        }
    }
}

impl<B: Backend> TensorMetadata for ZeroTensor<B> {
    fn dtype(&self) -> DType {
        match self {
            ZeroTensor::Local(tensor) => tensor.dtype(),
            ZeroTensor::Sharded(view) => view.param.dtype(),
        }
    }

    fn shape(&self) -> Shape {
        match self {
            ZeroTensor::Local(tensor) => tensor.shape(),
            ZeroTensor::Sharded(view) => view.shape.clone(),
        }
    }
}
