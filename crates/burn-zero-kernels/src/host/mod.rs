//! Direct access to the host memory of CPU backends' float tensors.
//!
//! Flex and NdArray keep a float tensor in a reference-counted host buffer. Reading it as a
//! slice costs nothing, and a buffer nobody else holds can be written in place. That lets the
//! bucket pack/unpack and `LocalGroup`'s collectives make one pass over memory per operand,
//! and write into buffers kept from the previous step instead of fresh allocations (whose
//! first touch costs a page fault per 4 KiB page).
//!
//! A generic `B: Backend` is recognised by its float primitive's type, as the kernel path
//! recognises `CubeTensor`: `FlexTensor` (feature `flex`) or `NdArrayTensor` (feature
//! `ndarray`). Everything here is safe code over the backends' public accessors: uniqueness is
//! the backends' own reference count, so a buffer is only written while no tensor shares it.
//!
//! The arithmetic ([`HostFloat`]) reproduces the backends' own, so results are bitwise those
//! of the Burn-ops path. [`adam_step`] and [`sgd_step`] are the optimizer's fused Adam/AdamW
//! and SGD passes over such memory.
//!
//! Without the `flex` and `ndarray` features no host tensor can exist: the code that handles
//! one is unreachable by construction, which the compiler is told below.
#![cfg_attr(
    not(any(feature = "flex", feature = "ndarray")),
    allow(
        unreachable_code,
        unreachable_patterns,
        unused_variables,
        unused_imports,
        dead_code
    )
)]

mod adam;
mod element;
mod half_copy;
mod multiply_add;
mod pack;
mod pool;
mod sgd;

use std::any::{Any, TypeId};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, TensorData};

pub use adam::{AdamRule, AdamStep, adam_step, adam_step_copying, adam_step_with};
pub use element::{FloatVisitor, HostFloat, visit};
pub use half_copy::HalfCopy;
pub use multiply_add::MultiplyAdd;
pub(crate) use pack::{HostPacker, divide_row, unpack};
pub use pool::BufferPool;
pub use sgd::{SgdMomentum, SgdStep, sgd_step, sgd_step_copying, sgd_step_with};

#[cfg(feature = "flex")]
use burn::backend::flex::FlexTensor;
#[cfg(feature = "ndarray")]
use burn::backend::ndarray::NdArrayTensor;

/// A CPU backend whose float tensors this module reads and writes in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostBackend {
    /// `burn::backend::Flex`: f64, f32, f16 and bf16.
    #[cfg(feature = "flex")]
    Flex,
    /// `burn::backend::NdArray`: f64 and f32.
    #[cfg(feature = "ndarray")]
    NdArray,
}

impl HostBackend {
    /// The host backend `B` is, if it is one compiled into this build.
    pub fn of<B: Backend>() -> Option<Self> {
        let primitive = TypeId::of::<B::FloatTensorPrimitive>();
        #[cfg(feature = "flex")]
        if primitive == TypeId::of::<FlexTensor>() {
            return Some(Self::Flex);
        }
        #[cfg(feature = "ndarray")]
        if primitive == TypeId::of::<NdArrayTensor>() {
            return Some(Self::NdArray);
        }
        let _ = primitive;
        None
    }

    /// Whether float tensors of `dtype` exist on this backend and have a [`HostFloat`] type.
    pub fn supports(self, dtype: DType) -> bool {
        match self {
            #[cfg(feature = "flex")]
            Self::Flex => matches!(dtype, DType::F64 | DType::F32 | DType::F16 | DType::BF16),
            #[cfg(feature = "ndarray")]
            Self::NdArray => matches!(dtype, DType::F64 | DType::F32),
        }
    }
}

/// A float tensor of a host backend, seen as host memory.
#[derive(Debug, Clone)]
pub struct HostTensor {
    repr: Repr,
}

#[derive(Debug, Clone)]
enum Repr {
    #[cfg(feature = "flex")]
    Flex(FlexTensor),
    #[cfg(feature = "ndarray")]
    NdArray(NdArrayTensor),
    /// Without either host backend no host tensor exists; this keeps the matches total.
    #[cfg(not(any(feature = "flex", feature = "ndarray")))]
    None(std::convert::Infallible),
}

impl HostTensor {
    /// `tensor` as a host tensor when `B` is a host backend; `tensor` back otherwise.
    pub fn from_primitive<B: Backend>(
        tensor: B::FloatTensorPrimitive,
    ) -> Result<Self, B::FloatTensorPrimitive> {
        let tensor = match downcast::<_, FlexTensorOrUnit>(tensor) {
            #[cfg(feature = "flex")]
            Ok(tensor) => return Ok(Self::new(Repr::Flex(tensor))),
            #[cfg(not(feature = "flex"))]
            Ok(never) => match never {},
            Err(tensor) => tensor,
        };
        match downcast::<_, NdArrayTensorOrUnit>(tensor) {
            #[cfg(feature = "ndarray")]
            Ok(tensor) => Ok(Self::new(Repr::NdArray(tensor))),
            #[cfg(not(feature = "ndarray"))]
            Ok(never) => match never {},
            Err(tensor) => Err(tensor),
        }
    }

    /// This tensor as `B`'s float primitive.
    ///
    /// # Panics
    /// When `B` is not the backend this tensor came from (a caller bug: host tensors are only
    /// made for the backend [`HostBackend::of`] found).
    pub fn into_primitive<B: Backend>(self) -> B::FloatTensorPrimitive {
        let backend = self.backend();
        let result: Option<B::FloatTensorPrimitive> = match self.repr {
            #[cfg(feature = "flex")]
            Repr::Flex(tensor) => downcast::<_, B::FloatTensorPrimitive>(tensor).ok(),
            #[cfg(feature = "ndarray")]
            Repr::NdArray(tensor) => downcast::<_, B::FloatTensorPrimitive>(tensor).ok(),
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            Repr::None(never) => match never {},
        };
        result.unwrap_or_else(|| {
            panic!(
                "a {backend:?} host tensor cannot become a float tensor of {}",
                std::any::type_name::<B>()
            )
        })
    }

    fn new(repr: Repr) -> Self {
        Self { repr }
    }

    /// A contiguous 1-D tensor of `backend` holding `values`, without copying them.
    ///
    /// # Panics
    /// When `backend` has no tensors of `E` (f16/bf16 on NdArray).
    pub fn from_vec<E: HostFloat>(backend: HostBackend, values: Vec<E>) -> Self {
        assert!(
            backend.supports(E::DTYPE),
            "{backend:?} has no {:?} tensors",
            E::DTYPE
        );
        let len = values.len();
        // `TensorData::new` takes the vector's allocation as its bytes; both backends adopt
        // those bytes as their storage.
        let data = TensorData::new(values, [len]);
        match backend {
            #[cfg(feature = "flex")]
            HostBackend::Flex => Self::new(Repr::Flex(FlexTensor::from_data(data))),
            #[cfg(feature = "ndarray")]
            HostBackend::NdArray => Self::new(Repr::NdArray(NdArrayTensor::from_data(data))),
        }
    }

    /// A contiguous 1-D tensor of `numel` zeros.
    pub fn zeros<E: HostFloat>(backend: HostBackend, numel: usize) -> Self {
        Self::from_vec(backend, bytemuck::zeroed_vec::<E>(numel))
    }

    /// Which backend this tensor belongs to.
    pub fn backend(&self) -> HostBackend {
        match self.repr {
            #[cfg(feature = "flex")]
            Repr::Flex(_) => HostBackend::Flex,
            #[cfg(feature = "ndarray")]
            Repr::NdArray(_) => HostBackend::NdArray,
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            Repr::None(never) => match never {},
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        #[cfg(feature = "ndarray")]
        use burn::tensor::TensorMetadata;
        match &self.repr {
            #[cfg(feature = "flex")]
            Repr::Flex(tensor) => tensor.dtype(),
            #[cfg(feature = "ndarray")]
            Repr::NdArray(tensor) => tensor.dtype(),
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            Repr::None(never) => match *never {},
        }
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        #[cfg(any(feature = "flex", feature = "ndarray"))]
        use burn::tensor::TensorMetadata;
        match &self.repr {
            #[cfg(feature = "flex")]
            Repr::Flex(tensor) => tensor.shape().num_elements(),
            #[cfg(feature = "ndarray")]
            Repr::NdArray(tensor) => tensor.shape().num_elements(),
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            Repr::None(never) => match *never {},
        }
    }

    /// Bytes of the elements.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype().size()
    }

    /// The elements in row-major order, in place, when they are `E`s laid out contiguously.
    pub fn as_slice<E: HostFloat>(&self) -> Option<&[E]> {
        if self.dtype() != E::DTYPE {
            return None;
        }
        match &self.repr {
            #[cfg(feature = "flex")]
            Repr::Flex(tensor) => tensor.as_slice::<E>(),
            #[cfg(feature = "ndarray")]
            Repr::NdArray(tensor) => E::ndarray_slice(tensor),
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            Repr::None(never) => match *never {},
        }
    }

    /// The same values, contiguous: `self` when it already is, a row-major copy otherwise.
    pub fn into_contiguous(self) -> Self {
        match self.repr {
            #[cfg(feature = "flex")]
            Repr::Flex(tensor) if !tensor.is_contiguous() => {
                Self::new(Repr::Flex(tensor.to_contiguous()))
            }
            #[cfg(feature = "ndarray")]
            Repr::NdArray(NdArrayTensor::F64(storage)) if storage.view().to_slice().is_none() => {
                Self::from_vec(
                    HostBackend::NdArray,
                    storage.view().iter().copied().collect(),
                )
            }
            #[cfg(feature = "ndarray")]
            Repr::NdArray(NdArrayTensor::F32(storage)) if storage.view().to_slice().is_none() => {
                Self::from_vec(
                    HostBackend::NdArray,
                    storage.view().iter().copied().collect(),
                )
            }
            repr => Self::new(repr),
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            Repr::None(never) => match never {},
        }
    }

    /// Whether no other tensor shares this tensor's buffer.
    pub fn is_unique(&self) -> bool {
        match &self.repr {
            #[cfg(feature = "flex")]
            Repr::Flex(tensor) => tensor.is_unique(),
            #[cfg(feature = "ndarray")]
            Repr::NdArray(tensor) => ndarray_is_unique(tensor),
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            Repr::None(never) => match *never {},
        }
    }

    /// The elements, writable, when this tensor is the only holder of a buffer of exactly its
    /// contiguous `E`s. `None` when the buffer is shared: writing would change another
    /// tensor's values.
    pub fn as_mut_slice<E: HostFloat>(&mut self) -> Option<&mut [E]> {
        if self.dtype() != E::DTYPE || !self.is_unique() {
            return None;
        }
        #[cfg(feature = "flex")]
        let numel = self.numel();
        match &mut self.repr {
            #[cfg(feature = "flex")]
            Repr::Flex(tensor) => {
                if tensor.layout().contiguous_offsets() != Some((0, numel))
                    || tensor.bytes().len() != numel * E::DTYPE.size()
                {
                    return None;
                }
                tensor.try_storage_mut::<E>()
            }
            #[cfg(feature = "ndarray")]
            Repr::NdArray(tensor) => E::ndarray_slice_mut(tensor),
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            Repr::None(never) => match *never {},
        }
    }
}

/// Whether an NdArray tensor's buffer is held by this tensor alone.
#[cfg(feature = "ndarray")]
fn ndarray_is_unique(tensor: &NdArrayTensor) -> bool {
    match tensor {
        NdArrayTensor::F64(storage) => storage.is_unique(),
        NdArrayTensor::F32(storage) => storage.is_unique(),
        _ => false,
    }
}

/// How each element type is found in each backend's tensors. Sealed: only the four
/// [`HostFloat`] types implement it.
mod access {
    #[cfg(feature = "ndarray")]
    use burn::backend::ndarray::NdArrayTensor;

    pub trait BackendAccess: Sized {
        /// The elements of an NdArray tensor of this type in row-major order, in place.
        #[cfg(feature = "ndarray")]
        fn ndarray_slice(tensor: &NdArrayTensor) -> Option<&[Self]>;
        /// The same, writable, when the tensor alone holds its buffer.
        #[cfg(feature = "ndarray")]
        fn ndarray_slice_mut(tensor: &mut NdArrayTensor) -> Option<&mut [Self]>;
    }

    /// An element type NdArray stores in variant `$variant`, or (no variant) never stores.
    macro_rules! access {
        ($elem:ty, $variant:ident) => {
            impl BackendAccess for $elem {
                #[cfg(feature = "ndarray")]
                fn ndarray_slice(tensor: &NdArrayTensor) -> Option<&[Self]> {
                    match tensor {
                        NdArrayTensor::$variant(storage) => storage.view().to_slice(),
                        _ => None,
                    }
                }
                #[cfg(feature = "ndarray")]
                fn ndarray_slice_mut(tensor: &mut NdArrayTensor) -> Option<&mut [Self]> {
                    match tensor {
                        // Unique and owned: `as_slice_mut` has nothing to copy on write.
                        NdArrayTensor::$variant(storage) if storage.is_unique() => {
                            storage.ensure_owned().as_slice_mut()
                        }
                        _ => None,
                    }
                }
            }
        };
        ($elem:ty) => {
            impl BackendAccess for $elem {
                #[cfg(feature = "ndarray")]
                fn ndarray_slice(_: &NdArrayTensor) -> Option<&[Self]> {
                    None
                }
                #[cfg(feature = "ndarray")]
                fn ndarray_slice_mut(_: &mut NdArrayTensor) -> Option<&mut [Self]> {
                    None
                }
            }
        };
    }

    access!(f64, F64);
    access!(f32, F32);
    access!(half::f16);
    access!(half::bf16);
}

#[cfg(feature = "flex")]
type FlexTensorOrUnit = FlexTensor;
#[cfg(not(feature = "flex"))]
type FlexTensorOrUnit = std::convert::Infallible;
#[cfg(feature = "ndarray")]
type NdArrayTensorOrUnit = NdArrayTensor;
#[cfg(not(feature = "ndarray"))]
type NdArrayTensorOrUnit = std::convert::Infallible;

/// `value` as a `U` when `T` and `U` are the same type, `value` back otherwise.
fn downcast<T: 'static, U: 'static>(value: T) -> Result<U, T> {
    let mut slot = Some(value);
    match (&mut slot as &mut dyn Any).downcast_mut::<Option<U>>() {
        Some(same) => Ok(same.take().expect("the slot was just filled")),
        None => Err(slot.expect("the slot is untouched")),
    }
}
