//! This process's MPI: initialised once, with every thread allowed to call it, and finalised
//! when the last group built on it is dropped, unless a collective was left unfinished.

use std::sync::{Arc, Mutex};

use mpi::Threading;
use mpi::environment::Universe;

use crate::error::CommError;

/// The process's MPI, while some group uses it.
static PROCESS: Mutex<Option<ProcessState>> = Mutex::new(None);

struct ProcessState {
    /// `None` once finalised: MPI cannot start twice in one process.
    universe: Option<Universe>,
    users: usize,
    /// A collective was left unfinished: finalising would wait for it forever.
    abandoned: bool,
}

/// A handle that keeps MPI initialised; the last one finalises it.
#[derive(Debug)]
pub(crate) struct MpiProcess {
    _private: (),
}

impl MpiProcess {
    /// Initialises MPI (once per process) with `MPI_THREAD_MULTIPLE`, or takes another handle
    /// on it.
    pub fn acquire() -> Result<Arc<MpiProcess>, CommError> {
        let mut process = PROCESS.lock().unwrap_or_else(|p| p.into_inner());
        match process.as_mut() {
            Some(state) if state.universe.is_none() => {
                return Err(CommError::Unavailable(
                    "MPI was already finalised in this process (MPI starts once per process: keep \
                     a group alive for as long as the process runs collectives)"
                        .into(),
                ));
            }
            Some(state) => state.users += 1,
            None => {
                if mpi::environment::is_initialized() {
                    return Err(CommError::Unavailable(
                        "MPI was initialised by something other than burn-zero in this process"
                            .into(),
                    ));
                }
                let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
                    .ok_or_else(|| CommError::Unavailable("MPI_Init_thread failed".into()))?;
                if threading != Threading::Multiple {
                    return Err(CommError::Unavailable(format!(
                        "this MPI library gives threads {threading:?} access, and burn-zero \
                         issues collectives from several threads (it needs MPI_THREAD_MULTIPLE; \
                         Open MPI 4 gives it)"
                    )));
                }
                *process = Some(ProcessState {
                    universe: Some(universe),
                    users: 1,
                    abandoned: false,
                });
            }
        }
        Ok(Arc::new(MpiProcess { _private: () }))
    }

    /// Marks that a collective was left unfinished: MPI is then not finalised (it would wait
    /// for that collective), and the process leaves MPI as it exits.
    pub fn abandon(&self) {
        let mut process = PROCESS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(state) = process.as_mut() {
            state.abandoned = true;
        }
    }
}

impl Drop for MpiProcess {
    fn drop(&mut self) {
        let mut process = PROCESS.lock().unwrap_or_else(|p| p.into_inner());
        let Some(state) = process.as_mut() else {
            return;
        };
        state.users -= 1;
        if state.users > 0 {
            return;
        }
        if let Some(universe) = state.universe.take() {
            if state.abandoned {
                // Finalising waits for every pending operation of every connected process.
                std::mem::forget(universe);
            } else {
                drop(universe); // MPI_Finalize.
            }
        }
    }
}
