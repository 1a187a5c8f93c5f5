//! Every rank's step outputs for the metrics when each rank is its own process.
//!
//! Ranks on threads of one process hand their items to one event processor directly. Ranks in
//! separate processes cannot: an item is the model's own output type, tensors on the rank's
//! device. [`CrossRank`] says how an output crosses ranks — its tensors' values and shapes,
//! all-gathered through the rank's communicator — and is implemented for burn-train's outputs
//! (classification, multi-label classification, regression, sequence). With
//! `ZeroStrategy::with_items_from_every_rank`, rank 0's metrics then see every rank's items, in
//! rank order, exactly as under ranks on threads.
//!
//! The values travel as f32: exact for f32, f16 and bf16 tensors and for integers up to 2²⁴ in
//! magnitude (class indices, token ids); anything else is refused by name rather than rounded.

use std::any::type_name;
use std::sync::Arc;

use burn::tensor::backend::{Backend, BackendTypes};
use burn::tensor::{BasicOps, DType, Tensor, TensorData};
use burn_train::{
    ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput, SequenceOutput,
};
use burn_zero_comm::{Communicator, agree};

use crate::error::TrainError;

/// A step output whose every rank's copy can be gathered, in rank order (a collective: every
/// rank calls it at the same step).
pub trait CrossRank: Sized {
    /// This rank's output and the other ranks', in rank order.
    fn all_gather<C: Backend>(
        self,
        comm: &dyn Communicator<C>,
        device: &C::Device,
    ) -> Result<Vec<Self>, TrainError>;
}

/// Largest integer magnitude an f32 holds exactly.
const EXACT_INT: i64 = 1 << 24;

/// The tensors of one output, flattened into one f32 buffer for two collectives: one for the
/// shapes, one for the values.
#[derive(Default)]
struct Packet {
    values: Vec<f32>,
    /// Each tensor's shape and dtype, in push order.
    layouts: Vec<(Vec<usize>, DType)>,
}

impl Packet {
    fn push<B: Backend, const D: usize, K: BasicOps<B>>(
        &mut self,
        tensor: Tensor<B, D, K>,
    ) -> Result<(), TrainError> {
        let data = tensor.into_data();
        let dtype = data.dtype;
        let shape = data.shape.to_vec();
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                let values = data.convert::<f32>().into_vec::<f32>().map_err(convert)?;
                self.values.extend(values);
            }
            DType::I64
            | DType::I32
            | DType::I16
            | DType::I8
            | DType::U8
            | DType::U16
            | DType::U32
            | DType::U64 => {
                let values = data.convert::<i64>().into_vec::<i64>().map_err(convert)?;
                if let Some(v) = values.iter().find(|v| v.abs() > EXACT_INT) {
                    return Err(TrainError::Invalid(format!(
                        "an output integer tensor holds {v}, beyond the ±2^24 that cross \
                         ranks exactly"
                    )));
                }
                self.values.extend(values.into_iter().map(|v| v as f32));
            }
            other => {
                return Err(TrainError::Invalid(format!(
                    "output tensors of dtype {other:?} cannot cross ranks exactly (f32, f16, \
                     bf16 and integers can)"
                )));
            }
        }
        self.layouts.push((shape, dtype));
        Ok(())
    }

    /// Every rank's packet, in rank order. The ranks' outputs have the same tensors (ranks
    /// and dtypes); their shapes may differ.
    fn all_gather<C: Backend>(
        self,
        comm: &dyn Communicator<C>,
        device: &C::Device,
    ) -> Result<Vec<Unpacker>, TrainError> {
        let world = comm.world_size();
        // The header: the value count, then every dim, each as two exact 16-bit halves.
        let mut header = Vec::new();
        for n in std::iter::once(self.values.len()).chain(
            self.layouts
                .iter()
                .flat_map(|(shape, _)| shape.iter().copied()),
        ) {
            header.extend(agree::halves(n)?);
        }
        let width = header.len();
        let headers = gather_f32(comm, device, header)?;
        if headers.len() != width * world {
            return Err(TrainError::State(format!(
                "the ranks' step outputs differ in their tensors ({} header values from {world} \
                 ranks, {width} here)",
                headers.len()
            )));
        }
        let read = |at: usize, rank: usize| agree::from_halves(&headers[rank * width + at * 2..]);
        let lengths: Vec<usize> = (0..world).map(|r| read(0, r)).collect();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let mut values = self.values;
        values.resize(longest, 0.0);
        let all = gather_f32(comm, device, values)?;
        let mut unpackers = Vec::with_capacity(world);
        for (rank, &length) in lengths.iter().enumerate() {
            let mut at = 1;
            let mut layouts = Vec::with_capacity(self.layouts.len());
            for (shape, dtype) in &self.layouts {
                let dims: Vec<usize> = (0..shape.len()).map(|i| read(at + i, rank)).collect();
                at += shape.len();
                layouts.push((dims, *dtype));
            }
            let start = rank * longest;
            unpackers.push(Unpacker {
                values: Arc::from(&all[start..start + length]),
                offset: 0,
                layouts: layouts.into_iter(),
            });
        }
        Ok(unpackers)
    }
}

/// One rank's tensors out of a gathered packet, in push order.
struct Unpacker {
    values: Arc<[f32]>,
    offset: usize,
    layouts: std::vec::IntoIter<(Vec<usize>, DType)>,
}

impl Unpacker {
    fn pop<B: Backend, const D: usize, K: BasicOps<B>>(
        &mut self,
        device: &B::Device,
    ) -> Result<Tensor<B, D, K>, TrainError> {
        let (shape, dtype) = self.layouts.next().ok_or_else(|| {
            TrainError::State("a gathered step output has fewer tensors than pushed".into())
        })?;
        let numel: usize = shape.iter().product();
        let end = self.offset + numel;
        let values = self.values.get(self.offset..end).ok_or_else(|| {
            TrainError::State(format!(
                "a gathered step output is shorter than its shapes say ({end} > {})",
                self.values.len()
            ))
        })?;
        self.offset = end;
        let data = TensorData::new(values.to_vec(), shape).convert_dtype(dtype);
        Ok(Tensor::from_data(data, device))
    }
}

fn gather_f32<C: Backend>(
    comm: &dyn Communicator<C>,
    device: &C::Device,
    values: Vec<f32>,
) -> Result<Vec<f32>, TrainError> {
    let block = Tensor::<C, 1>::from_data(TensorData::new(values.clone(), [values.len()]), device);
    comm.all_gather(block)?
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(convert)
}

fn convert(error: burn::tensor::DataError) -> TrainError {
    TrainError::State(format!("reading a step output's values: {error:?}"))
}

/// The fields of burn-train's classification, multi-label and regression outputs: loss, output,
/// targets.
type Triple<B, const D: usize, K> = (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, D, K>);

/// Every rank's [`Triple`], in rank order.
fn gather_triple<C, B, const D: usize, K>(
    (loss, output, targets): Triple<B, D, K>,
    comm: &dyn Communicator<C>,
    device: &C::Device,
) -> Result<Vec<Triple<B, D, K>>, TrainError>
where
    C: Backend,
    B: Backend,
    K: BasicOps<B>,
{
    let here = loss.device();
    let mut packet = Packet::default();
    packet.push(loss)?;
    packet.push(output)?;
    packet.push(targets)?;
    packet
        .all_gather(comm, device)?
        .into_iter()
        .map(|mut r| Ok((r.pop(&here)?, r.pop(&here)?, r.pop(&here)?)))
        .collect()
}

impl<B: Backend> CrossRank for ClassificationOutput<B> {
    fn all_gather<C: Backend>(
        self,
        comm: &dyn Communicator<C>,
        device: &C::Device,
    ) -> Result<Vec<Self>, TrainError> {
        let all = gather_triple((self.loss, self.output, self.targets), comm, device)?;
        Ok(all
            .into_iter()
            .map(|(loss, output, targets)| Self::new(loss, output, targets))
            .collect())
    }
}

impl<B: Backend> CrossRank for MultiLabelClassificationOutput<B> {
    fn all_gather<C: Backend>(
        self,
        comm: &dyn Communicator<C>,
        device: &C::Device,
    ) -> Result<Vec<Self>, TrainError> {
        let all = gather_triple((self.loss, self.output, self.targets), comm, device)?;
        Ok(all
            .into_iter()
            .map(|(loss, output, targets)| Self {
                loss,
                output,
                targets,
            })
            .collect())
    }
}

impl<B: Backend> CrossRank for RegressionOutput<B> {
    fn all_gather<C: Backend>(
        self,
        comm: &dyn Communicator<C>,
        device: &C::Device,
    ) -> Result<Vec<Self>, TrainError> {
        let all = gather_triple((self.loss, self.output, self.targets), comm, device)?;
        Ok(all
            .into_iter()
            .map(|(loss, output, targets)| Self {
                loss,
                output,
                targets,
            })
            .collect())
    }
}

impl<B: Backend> CrossRank for SequenceOutput<B> {
    fn all_gather<C: Backend>(
        self,
        comm: &dyn Communicator<C>,
        device: &C::Device,
    ) -> Result<Vec<Self>, TrainError> {
        let here = self.loss.device();
        let predicted = self.predictions.is_some();
        let mut packet = Packet::default();
        packet.push(self.loss)?;
        packet.push(self.logits)?;
        packet.push(self.targets)?;
        if let Some(predictions) = self.predictions {
            packet.push(predictions)?;
        }
        packet
            .all_gather(comm, device)?
            .into_iter()
            .map(|mut r| {
                let loss = r.pop(&here)?;
                let logits = r.pop(&here)?;
                let targets = r.pop(&here)?;
                let predictions = if predicted { Some(r.pop(&here)?) } else { None };
                Ok(Self {
                    loss,
                    logits,
                    predictions,
                    targets,
                })
            })
            .collect()
    }
}

/// How a run's training and validation outputs cross ranks: set by
/// `ZeroStrategy::with_items_from_every_rank` for one pair of output types, found again by type
/// when the strategy trains.
pub(crate) struct Exchange<B: Backend, TO, VO> {
    pub train: GatherFn<B, TO>,
    pub valid: GatherFn<B, VO>,
}

/// Every rank's copy of an output `T`, through a communicator of backend `B`.
pub(crate) type GatherFn<B, T> =
    fn(T, &dyn Communicator<B>, &<B as BackendTypes>::Device) -> Result<Vec<T>, TrainError>;

impl<B: Backend, TO: CrossRank, VO: CrossRank> Exchange<B, TO, VO> {
    pub fn new() -> Self {
        Self {
            train: |item, comm, device| item.all_gather(comm, device),
            valid: |item, comm, device| item.all_gather(comm, device),
        }
    }
}

/// An [`Exchange`] set for output types `names`, type-erased until the strategy knows its
/// learner's types.
pub(crate) struct ErasedExchange {
    pub exchange: Arc<dyn std::any::Any + Send + Sync>,
    /// The training and validation output types it was set for.
    pub names: (&'static str, &'static str),
}

impl ErasedExchange {
    pub fn new<B: Backend, TO: CrossRank + 'static, VO: CrossRank + 'static>() -> Self {
        Self {
            exchange: Arc::new(Exchange::<B, TO, VO>::new()),
            names: (type_name::<TO>(), type_name::<VO>()),
        }
    }

    /// The exchange for outputs `TO` and `VO`, or an error naming both pairs of types.
    pub fn get<B: Backend, TO: 'static, VO: 'static>(
        &self,
    ) -> Result<&Exchange<B, TO, VO>, TrainError> {
        self.exchange.downcast_ref().ok_or_else(|| {
            TrainError::Invalid(format!(
                "`with_items_from_every_rank` was set for outputs `{}` and `{}`, but the \
                 learner's model steps to `{}` and `{}`",
                self.names.0,
                self.names.1,
                type_name::<TO>(),
                type_name::<VO>()
            ))
        })
    }
}
