//! What a caller holds while the issuing thread works for it: the result of deferred work, or
//! of a gather issued ahead of use.

use std::sync::mpsc::{Receiver, TryRecvError};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::issuer::stopped;
use crate::error::CommError;
use crate::issued::Issued;

/// The result of work run with [`super::Reservation::run_deferred`].
pub struct Deferred<T, E = CommError>(pub(super) Receiver<Result<T, E>>);

impl<T, E: From<CommError>> Deferred<T, E> {
    /// Waits for the result.
    pub fn wait(self) -> Result<T, E> {
        self.0.recv().unwrap_or_else(|_| Err(E::from(stopped())))
    }

    /// The result once it has arrived; `None` while the work is still to finish.
    pub fn try_take(&self) -> Option<Result<T, E>> {
        match self.0.try_recv() {
            Ok(result) => Some(result),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Err(E::from(stopped()))),
        }
    }
}

/// The result of a gather queued with [`super::Reservation::all_gather_later`].
pub struct Pending<B: Backend>(pub(super) Answer<B>);

/// Where a [`Pending`] result comes from.
pub(super) enum Answer<B: Backend> {
    /// From the issuing thread, once it has issued the collective.
    Queued(Receiver<Result<Issued<B>, CommError>>),
    /// Answered in place (a group of one rank).
    Ready(Issued<B>),
}

impl<B: Backend> Pending<B> {
    /// Waits for the issuing thread to issue the gather, then for the device to finish it,
    /// and returns the gathered tensor.
    pub fn wait(self) -> Result<Tensor<B, 1>, CommError> {
        match self.0 {
            Answer::Queued(issued) => issued.recv().unwrap_or_else(|_| Err(stopped()))?.wait(),
            Answer::Ready(issued) => issued.wait(),
        }
    }
}
