//! burn-zero: ZeRO-style sharded data-parallel training for Burn.
//!
//! This facade re-exports the crates users need:
//! - [`comm`]: the [`comm::Communicator`] trait, the in-process [`comm::LocalGroup`] engine
//!   and the [`comm::launch`] rank launcher.

pub use burn_zero_comm as comm;
