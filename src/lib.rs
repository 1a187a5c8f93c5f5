#![doc = include_str!("../README.md")]
//!
//! ## Crates
//! - [`comm`]: the [`comm::Communicator`] trait, the in-process [`comm::LocalGroup`] engine
//!   and the [`comm::launch`] rank launcher.

pub use burn_zero_comm as comm;
