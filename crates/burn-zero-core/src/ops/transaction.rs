//! Transactions: read several tensors at once; sharded ones are gathered first.

use burn::tensor::backend::{Backend, ExecutionError};
use burn::tensor::ops::{TransactionOps, TransactionPrimitive, TransactionPrimitiveData};

use crate::backend::Zero;
use crate::tensor::ZeroTensor;

impl<B: Backend> TransactionOps<Self> for Zero<B> {
    fn tr_execute(
        transaction: TransactionPrimitive<Self>,
    ) -> impl Future<Output = Result<TransactionPrimitiveData, ExecutionError>> + Send {
        B::tr_execute(TransactionPrimitive::new(
            transaction
                .read_floats
                .into_iter()
                .map(ZeroTensor::materialize)
                .collect(),
            transaction.read_qfloats,
            transaction.read_ints,
            transaction.read_bools,
        ))
    }
}
