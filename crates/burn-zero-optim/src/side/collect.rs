//! The step's first phase: every gradient this side steps, taken out of Burn's
//! `GradientsParams` (or the reducer's orphans) to where the masters live.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, SimpleOptimizer};
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_zero_core::store::SharedRow;
use burn_zero_core::{Zero, ZeroState, ZeroTensor};

use super::owned::Owned;
use super::{Side, bound};
use crate::place::Place;

/// One parameter's gradient, taken out of `GradientsParams` (or the orphans) before the step.
pub(crate) struct Taken<H: Backend> {
    pub key: usize,
    /// This rank's part of the reduced gradient, flat, where the masters live.
    pub grad: Grad<H>,
}

/// A chunk's reduced row on the device, kept for the pass, and the same row where the masters
/// live.
type RowTaken<B, H> = (Arc<SharedRow<B>>, Tensor<H, 1>);

/// A parameter's gradient part: a tensor of its own, or its range of its chunk's reduced row
/// (the reduction delivers a sharded chunk's row whole), cut out only where it is read alone:
/// a chunk whose members are all ranges of one row steps that row as it is.
pub(crate) enum Grad<H: Backend> {
    Whole(Tensor<H, 1>),
    Part {
        row: Tensor<H, 1>,
        /// Which row: the same for every member delivered with it in this step.
        row_id: usize,
        range: Range<usize>,
    },
}

impl<H: Backend> Grad<H> {
    /// The gradient part as a tensor of its own (a view of the row, or a copy where the
    /// device's alignment needs one).
    pub(crate) fn tensor(&self) -> Tensor<H, 1> {
        match self {
            Grad::Whole(grad) => grad.clone(),
            Grad::Part { row, range, .. } if range.len() == row.dims()[0] => row.clone(),
            Grad::Part { row, range, .. } => row.clone().slice(range.clone()),
        }
    }
}

/// The gradients of one step that an optimizer steps, taken out of `GradientsParams`.
pub(crate) struct Collected<B: Backend, H: Backend> {
    pub(super) taken: HashMap<ParamId, Taken<H>>,
    pub(super) order: Vec<ParamId>,
    /// The current value of every parameter that has a gradient, by key.
    pub(super) values: HashMap<usize, ZeroTensor<B>>,
}

/// A 1-D tensor of the inner backend from a primitive.
pub(crate) fn flat<B: Backend>(primitive: B::FloatTensorPrimitive) -> Tensor<B, 1> {
    let numel = primitive.shape().num_elements();
    Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(
        primitive,
        Shape::new([numel]),
    )))
}

/// Reduced gradients of parameters a rank did not use, by parameter key.
pub(crate) type Orphans<B> = BTreeMap<usize, ZeroTensor<B>>;

impl<O, B: Backend, P: Place<B>> Side<O, B, P>
where
    O: SimpleOptimizer<P::Host>,
{
    /// First phase: takes the gradients of the parameters this optimizer steps out of `grads`
    /// (or out of the reducer's `orphans`, taken once for every optimizer of the step), to
    /// where the masters live.
    pub(crate) fn collect<AB, M>(
        &mut self,
        module: &M,
        grads: &mut GradientsParams,
        orphans: &mut Option<Orphans<B>>,
    ) -> Collected<B, P::Host>
    where
        AB: AutodiffBackend<InnerBackend = Zero<B>>,
        M: AutodiffModule<AB>,
    {
        let mut collect = Collect::<B, P> {
            zero: bound(&self.zero),
            owned: &self.owned,
            grads,
            orphans,
            taken: HashMap::new(),
            order: Vec::new(),
            values: HashMap::new(),
            rows: HashMap::new(),
            _placement: std::marker::PhantomData,
        };
        module.visit(&mut collect);
        let collected = Collected {
            taken: collect.taken,
            order: collect.order,
            values: collect.values,
        };
        if !collected.order.is_empty() {
            self.check_placement();
            if self.tracked.is_none() {
                self.tracked = Some([0; 3]);
            }
        }
        collected
    }
}

/// First pass: takes every sharded parameter's gradient, in visit order, to where the masters
/// live.
struct Collect<'a, B: Backend, P: Place<B>> {
    zero: &'a ZeroState<B>,
    /// The parameters this optimizer steps; the others' gradients are left in `grads`.
    owned: &'a Owned,
    grads: &'a mut GradientsParams,
    /// The reducer's orphan gradients, taken at the first parameter that needs one.
    orphans: &'a mut Option<Orphans<B>>,
    taken: HashMap<ParamId, Taken<P::Host>>,
    order: Vec<ParamId>,
    /// The current value of every parameter that has a gradient, by key (a chunked step makes
    /// a chunk's master from its members' values).
    values: HashMap<usize, ZeroTensor<B>>,
    /// The chunks' reduced rows met so far, by address, where the masters live: each taken
    /// there once. Holding them keeps every address unique for the pass.
    rows: HashMap<usize, RowTaken<B, P::Host>>,
    _placement: std::marker::PhantomData<P>,
}

impl<B: Backend, P: Place<B>> Collect<'_, B, P> {
    /// Parameter `key`'s path in the module, for messages.
    fn path_of(&self, key: usize) -> String {
        self.zero
            .params()
            .get(key)
            .map_or_else(String::new, |info| info.path.clone())
    }

    fn orphan(&mut self, key: usize) -> Option<ZeroTensor<B>> {
        let zero = self.zero;
        self.orphans
            .get_or_insert_with(|| zero.take_orphan_gradients())
            .remove(&key)
    }
}

impl<AB, B, P> ModuleVisitor<AB> for Collect<'_, B, P>
where
    B: Backend,
    P: Place<B>,
    AB: AutodiffBackend<InnerBackend = Zero<B>>,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        // A parameter sharded by another `shard` call would be stepped with the wrong state,
        // or silently never learn.
        if let ZeroTensor::Sharded(view) = param.val().inner().into_primitive().tensor()
            && !Arc::ptr_eq(view.param().store(), self.zero.store())
        {
            panic!(
                "burn-zero: parameter {} was sharded by another `shard` call than the one this \
                 ZeroOptimizer was built from; build one optimizer per sharded module, from the \
                 ZeroState its `shard` returned",
                param.id
            );
        }
        let Some(key) = self
            .zero
            .store()
            .key_of(&DistributedParamId::from(param.id.val()))
        else {
            // Not a parameter of the module this optimizer's state belongs to: not ours.
            return;
        };
        if !self.owned.steps(key) {
            return;
        }
        // Frozen when sharded: never reduced, never stepped. A gradient means the parameter
        // was unfrozen afterwards, and it would be stepped unreduced, differently on each rank.
        if !self.zero.is_trainable(key) {
            if self.grads.remove::<Zero<B>, D>(param.id).is_some() {
                panic!(
                    "burn-zero: parameter #{key} `{}` has a gradient, but it was frozen (did not \
                     require a gradient) when the module was sharded, so it has no place in the \
                     gradient buckets; set `require_grad` as training needs it before `shard`",
                    self.path_of(key)
                );
            }
            return;
        }
        // Trainable when sharded: its bucket reduced it on every rank. Frozen since, it would
        // be stepped with the zeros that stood in for its gradient.
        if !param.val().is_require_grad() {
            panic!(
                "burn-zero: parameter #{key} `{}` was trainable when the module was sharded but \
                 no longer requires a gradient; its bucket still reduces it and the optimizer \
                 would step it. Freeze parameters before `shard` (shard again to change which \
                 are frozen)",
                self.path_of(key)
            );
        }
        let grad = self
            .grads
            .remove::<Zero<B>, D>(param.id)
            .map(|g| g.into_primitive().tensor())
            .or_else(|| self.orphan(key));
        let Some(grad) = grad else { return };
        let sharded = self.zero.gradient_is_sharded(key);
        let counters = self.zero.store().counters();
        let grad = match grad {
            // Moved to host memory as it arrived (an offloaded optimizer): no device transfer.
            ZeroTensor::Sharded(view) if sharded => match view.param().host_data() {
                Some(data) => Grad::Whole(P::from_host_data(data, self.zero.device())),
                None => match view.param().row_part() {
                    Some((row, range)) => {
                        let row_id = Arc::as_ptr(&row) as usize;
                        let (_, row) = self.rows.entry(row_id).or_insert_with(|| {
                            let values = P::to_host(flat(row.values()), counters);
                            (row, values)
                        });
                        Grad::Part {
                            row: row.clone(),
                            row_id,
                            range,
                        }
                    }
                    None => Grad::Whole(P::to_host(flat(view.param().shard()), counters)),
                },
            },
            ZeroTensor::Local(full) if !sharded => Grad::Whole(P::to_host(flat(full), counters)),
            ZeroTensor::Local(_) => panic!(
                "burn-zero: the gradient of parameter #{key} `{}` is whole, but this stage \
                 reduces it to shards: it was not reduced. A backward pass uses up the \
                 parameters' gradient marks and `ZeroOptimizer::step` renews them, so a second \
                 backward pass before a step is not reduced; call `step` after every backward \
                 (`with_accumulation(n)` accumulates n of them)",
                self.path_of(key)
            ),
            ZeroTensor::Sharded(_) => panic!(
                "burn-zero: the gradient of parameter #{key} `{}` is sharded but this stage \
                 reduces it whole",
                self.path_of(key)
            ),
        };
        self.order.push(param.id);
        self.taken.insert(param.id, Taken { key, grad });
        self.values
            .insert(key, param.val().inner().into_primitive().tensor());
    }
}
