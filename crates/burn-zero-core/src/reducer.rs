//! The communication thread: reduces gradient buckets while backward is still running.
//!
//! Autodiff's hook hands each final gradient over and returns at once; the thread reduces a
//! bucket as soon as all of its members are in, on a duplicate of the rank's communicator (so
//! its collectives never interleave with the gathers the training thread issues during a
//! stage-3 backward). At the end of backward the training thread asks for the results and
//! writes them into autodiff's gradient slots itself. Buckets are still reduced strictly in
//! layout order, with the same arithmetic as on the training thread, so results are bitwise
//! the same as without overlap.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn_zero_comm::{CommError, Communicator};

use crate::bucket::{Bucket, ReduceError, Reduction};
use crate::memory::MemoryTracker;
use crate::queue::{BucketQueue, Reduced};

enum Job<B: Backend> {
    /// Parameter `key`'s final gradient, counted as `bytes` of bucket memory.
    Gradient {
        key: usize,
        grad: B::FloatTensorPrimitive,
        bytes: usize,
    },
    /// Backward is over (its last hook ran at `backward_ended`): reduce the remaining
    /// buckets and send everything back.
    Finish { backward_ended: Instant },
}

/// What the thread sends back at the end of a backward pass.
pub(crate) struct Finished<B: Backend> {
    pub reduced: Result<Vec<Reduced<B>>, ReduceError>,
    /// Time the thread spent packing, reducing and unpacking.
    pub busy_seconds: f64,
    /// Buckets whose reduction was done before backward's last hook ran.
    pub early: usize,
}

/// Handle on a rank's communication thread.
pub(crate) struct Reducer<B: Backend> {
    jobs: Option<Sender<Job<B>>>,
    finished: Receiver<Finished<B>>,
    thread: Option<JoinHandle<()>>,
}

impl<B: Backend> Reducer<B> {
    /// Starts the thread for rank `rank`, reducing `buckets` on `comm` (a duplicate of the
    /// rank's communicator) on `device`.
    pub fn spawn(
        comm: Arc<dyn Communicator<B>>,
        buckets: Vec<Bucket>,
        device: B::Device,
        predivide: f64,
        memory: Arc<MemoryTracker>,
    ) -> std::io::Result<Self> {
        let (jobs, inbox) = channel::<Job<B>>();
        let (outbox, finished) = channel::<Finished<B>>();
        let rank = comm.rank();
        let thread = std::thread::Builder::new()
            .name(format!("burn-zero-reduce-{rank}"))
            .spawn(move || {
                let ctx = Reduction {
                    comm: comm.as_ref(),
                    device: &device,
                    predivide,
                    memory: &memory,
                };
                serve(&ctx, BucketQueue::new(buckets), &inbox, &outbox);
            })?;
        Ok(Self {
            jobs: Some(jobs),
            finished,
            thread: Some(thread),
        })
    }

    /// Hands over parameter `key`'s final gradient. The caller has finished writing it on its
    /// device (the thread reads it from its own stream).
    pub fn submit(&self, key: usize, grad: B::FloatTensorPrimitive, bytes: usize) {
        if let Some(jobs) = &self.jobs {
            // A send fails only when the thread is gone; `finish` reports that.
            let _ = jobs.send(Job::Gradient { key, grad, bytes });
        }
    }

    /// Waits for every bucket of this backward pass, which ended at `backward_ended`.
    pub fn finish(&self, backward_ended: Instant) -> Finished<B> {
        let gone = || Finished {
            reduced: Err(ReduceError::Comm(CommError::InvalidGroup(
                "the gradient communication thread has stopped".into(),
            ))),
            busy_seconds: 0.0,
            early: 0,
        };
        match &self.jobs {
            Some(jobs) if jobs.send(Job::Finish { backward_ended }).is_ok() => {
                self.finished.recv().unwrap_or_else(|_| gone())
            }
            _ => gone(),
        }
    }
}

impl<B: Backend> Drop for Reducer<B> {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.jobs.take();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the gradient communication thread panicked");
        }
    }
}

/// The thread's loop: queue gradients, reduce complete buckets in order, answer `Finish`.
fn serve<B: Backend>(
    ctx: &Reduction<'_, B>,
    mut queue: BucketQueue<B>,
    inbox: &Receiver<Job<B>>,
    outbox: &Sender<Finished<B>>,
) {
    let mut pass = Pass::default();
    for job in inbox {
        match job {
            Job::Gradient { key, grad, bytes } => {
                queue.push(key, grad, bytes);
                while pass.failure.is_none() && queue.next_is_complete() {
                    pass.reduce_next(ctx, &mut queue);
                }
            }
            Job::Finish { backward_ended } => {
                let early = pass
                    .done_at
                    .iter()
                    .filter(|&&done| done <= backward_ended)
                    .count();
                while pass.failure.is_none() && !queue.is_done() {
                    pass.reduce_next(ctx, &mut queue);
                }
                queue.reset(ctx.memory);
                let done = std::mem::take(&mut pass);
                let sent = outbox.send(Finished {
                    reduced: match done.failure {
                        Some(error) => Err(error),
                        None => Ok(done.reduced),
                    },
                    busy_seconds: done.busy_seconds,
                    early,
                });
                if sent.is_err() {
                    return;
                }
            }
        }
    }
}

/// The thread's results for the backward pass in progress.
struct Pass<B: Backend> {
    reduced: Vec<Reduced<B>>,
    /// When each bucket's reduction finished.
    done_at: Vec<Instant>,
    failure: Option<ReduceError>,
    busy_seconds: f64,
}

impl<B: Backend> Default for Pass<B> {
    fn default() -> Self {
        Self {
            reduced: Vec::new(),
            done_at: Vec::new(),
            failure: None,
            busy_seconds: 0.0,
        }
    }
}

impl<B: Backend> Pass<B> {
    fn reduce_next(&mut self, ctx: &Reduction<'_, B>, queue: &mut BucketQueue<B>) {
        let started = Instant::now();
        match queue.reduce_next(ctx) {
            Ok(reduced) => {
                self.reduced.push(reduced);
                self.done_at.push(Instant::now());
            }
            Err(error) => self.failure = Some(error),
        }
        self.busy_seconds += started.elapsed().as_secs_f64();
    }
}
