//! `Issued`: a collective queued on the device whose completion the host has not yet seen,
//! handed to the thread that consumes its result.
//!
//! # Why
//!
//! An engine whose collectives run on a device stream of their own (NCCL) cannot order the
//! consumer's stream after them without that stream's handle, which cubecl keeps to itself.
//! What it can do is let the host see the collective complete before the consumer's work is
//! queued. Seen on the thread that issued the collective, that costs the issuing thread a
//! round trip per collective, and every later collective of the rank queues behind it. Seen by
//! the consumer, just before it reads the result, the issuing thread goes straight on to the
//! next collective, and a result gathered ahead of use (a prefetch) is usually complete by the
//! time it is asked for: the host then queries, and does not wait.
//!
//! # Lifetimes
//!
//! An [`Issued`] holds what the device may still touch (the input, the output, whatever the
//! engine keeps for the collective) until its [`Completion`] says the device is done with
//! them. The result is handed out only after that, so no stream can read the output early,
//! and a dropped `Issued` waits for its completion before it lets the buffers go.

use burn::tensor::{Tensor, backend::Backend};

use crate::error::CommError;

/// How the host learns that the device has finished a collective.
pub trait Completion: Send {
    /// Returns once the collective has completed on the device (so any stream may read its
    /// output and its buffers may be reused), or with the error that ended it.
    fn wait(self: Box<Self>) -> Result<(), CommError>;

    /// Asks, without waiting, whether the collective has completed: `Some(true)` when it has
    /// (or has failed: [`Self::wait`] then returns at once with the error), `Some(false)` while
    /// it runs, `None` where the engine cannot tell without waiting (the default).
    fn is_done(&self) -> Option<bool> {
        None
    }
}

/// A collective queued on the device; [`Issued::wait`] gives its result once it completed.
#[must_use = "an issued collective's result is read with `wait`"]
pub struct Issued<B: Backend> {
    /// Makes the result; runs only after `completion` (it may queue work reading the output).
    result: Option<Box<dyn FnOnce() -> Tensor<B, 1> + Send>>,
    /// `None` once the device is done (or for a collective that finished when issued).
    completion: Option<Box<dyn Completion>>,
}

impl<B: Backend> Issued<B> {
    /// A collective that has finished already: `wait` returns `result` at once.
    pub fn ready(result: Tensor<B, 1>) -> Self {
        Issued {
            result: Some(Box::new(move || result)),
            completion: None,
        }
    }

    /// A collective still running on the device: once `completion` says it finished, `result`
    /// makes its result (from buffers the closure holds until then).
    pub fn pending(
        completion: Box<dyn Completion>,
        result: impl FnOnce() -> Tensor<B, 1> + Send + 'static,
    ) -> Self {
        Issued {
            result: Some(Box::new(result)),
            completion: Some(completion),
        }
    }

    /// Whether the result may be taken without asking the device.
    pub fn is_ready(&self) -> bool {
        self.completion.is_none()
    }

    /// Asks, without waiting, whether [`Self::wait`] would return at once: `Some(true)` for a
    /// collective that is ready or whose completion says it is done, `Some(false)` while it
    /// runs, `None` where its engine cannot tell without waiting ([`Completion::is_done`]).
    pub fn is_done(&self) -> Option<bool> {
        match &self.completion {
            None => Some(true),
            Some(completion) => completion.is_done(),
        }
    }

    /// The same collective with `then` applied to its result after completion: Burn ops on
    /// the output (a mean's division, a fold of pieces), or the output in another backend's
    /// type.
    pub fn map<C: Backend>(
        mut self,
        then: impl FnOnce(Tensor<B, 1>) -> Tensor<C, 1> + Send + 'static,
    ) -> Issued<C> {
        let result = self.result.take();
        let completion = self.completion.take();
        Issued {
            result: result.map(|result| {
                Box::new(move || then(result())) as Box<dyn FnOnce() -> Tensor<C, 1> + Send>
            }),
            completion,
        }
    }

    /// Waits until the device has finished the collective, then returns its result.
    pub fn wait(mut self) -> Result<Tensor<B, 1>, CommError> {
        if let Some(completion) = self.completion.take() {
            completion.wait()?;
        }
        let result = self.result.take().ok_or_else(|| {
            CommError::InvalidGroup("an issued collective lost its result".into())
        })?;
        Ok(result())
    }
}

impl<B: Backend> Drop for Issued<B> {
    /// A result nobody reads still holds buffers the device may be writing: they go only once
    /// the collective completed (or failed).
    fn drop(&mut self) {
        if let Some(completion) = self.completion.take()
            && let Err(error) = completion.wait()
        {
            tracing::debug!(%error, "a discarded collective ended with an error");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use burn::backend::NdArray;

    use super::*;

    struct Counted(Arc<AtomicUsize>, Result<(), CommError>);

    impl Completion for Counted {
        fn wait(self: Box<Self>) -> Result<(), CommError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            self.1
        }
    }

    fn tensor(values: [f32; 3]) -> Tensor<NdArray, 1> {
        Tensor::from_floats(values, &Default::default())
    }

    #[test]
    fn the_result_is_made_only_after_completion_and_a_failure_is_returned() {
        let waits = Arc::new(AtomicUsize::new(0));
        let seen = waits.clone();
        let issued = Issued::pending(Box::new(Counted(waits.clone(), Ok(()))), move || {
            assert_eq!(
                seen.load(Ordering::SeqCst),
                1,
                "result made before completion"
            );
            tensor([1.0, 2.0, 3.0])
        })
        .map(|t| t.mul_scalar(2.0));
        assert!(!issued.is_ready());
        let doubled = issued.wait().unwrap().into_data().to_vec::<f32>().unwrap();
        assert_eq!(doubled, vec![2.0, 4.0, 6.0]);

        let failed: Issued<NdArray> = Issued::pending(
            Box::new(Counted(
                waits.clone(),
                Err(CommError::Unavailable("test".into())),
            )),
            || tensor([0.0; 3]),
        );
        assert!(matches!(failed.wait(), Err(CommError::Unavailable(_))));
        assert_eq!(waits.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_dropped_collective_waits_for_its_completion() {
        let waits = Arc::new(AtomicUsize::new(0));
        let issued: Issued<NdArray> =
            Issued::pending(Box::new(Counted(waits.clone(), Ok(()))), || {
                tensor([0.0; 3])
            });
        drop(issued);
        assert_eq!(waits.load(Ordering::SeqCst), 1);
        let ready = Issued::<NdArray>::ready(tensor([5.0; 3]));
        assert!(ready.is_ready());
        drop(ready);
        assert_eq!(waits.load(Ordering::SeqCst), 1);
    }
}
