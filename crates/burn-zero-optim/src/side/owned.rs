//! Which parameters of its module one side of the optimizer steps.
//!
//! A plain optimizer steps them all; a split one (part of the state on the host, part on the
//! device) gives each side its own keys, and moving chunks between the two changes them.

use std::collections::HashSet;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn_zero_core::{StepSite, ZeroState};

use crate::place::Place;

/// Which parameters of its module an optimizer steps.
#[derive(Debug, Clone, Default)]
pub(crate) enum Owned {
    /// Every trainable parameter.
    #[default]
    All,
    /// Those of these keys (a split optimizer's host side).
    Only(Arc<HashSet<usize>>),
    /// All but those of these keys (its device part: frozen parameters are checked here).
    Except(Arc<HashSet<usize>>),
}

impl Owned {
    /// Whether the parameter of `key` is stepped here.
    pub(crate) fn steps(&self, key: usize) -> bool {
        match self {
            Owned::All => true,
            Owned::Only(keys) => keys.contains(&key),
            Owned::Except(keys) => !keys.contains(&key),
        }
    }
}

/// Asks `zero`'s reduction to read the gradients of the `owned` parameters back to host memory
/// as they are reduced, when `P` steps them there.
pub(crate) fn keep_host_gradients<B: Backend, P: Place<B>>(zero: &ZeroState<B>, owned: &Owned) {
    if !P::GRADIENTS_ON_HOST {
        return;
    }
    match owned {
        Owned::All => zero.store().step_on(None, StepSite::Host),
        Owned::Only(keys) => zero.store().step_on(Some(keys), StepSite::Host),
        // A part that steps on the host everything but some keys is not made.
        Owned::Except(_) => {}
    }
}
