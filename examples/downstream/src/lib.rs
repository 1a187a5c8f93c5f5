//! What Burn's `distributed` feature, which burn-zero turns on, means for a crate that uses
//! burn-zero. The examples below are compiled by `cargo test --doc`: they are the proof.
//!
//! `Autodiff<Zero<…>>` is an autodiff backend on every Burn backend, fused ones included:
//!
//! ```
//! use burn::backend::{Autodiff, Flex, NdArray, Wgpu};
//! use burn::tensor::backend::AutodiffBackend;
//! use burn_zero::Zero;
//!
//! fn trains<B: AutodiffBackend>() {}
//! trains::<Autodiff<Zero<Flex>>>();
//! trains::<Autodiff<Zero<NdArray>>>();
//! trains::<Autodiff<Zero<Wgpu>>>();
//! ```
//!
//! With the feature on, Burn's autodiff needs a backend that takes part in its gradient
//! synchronisation, so `Autodiff<NdArray>` (and any backend that does not) is no longer one:
//!
//! ```compile_fail,E0277
//! use burn::backend::{Autodiff, NdArray};
//! use burn::tensor::backend::AutodiffBackend;
//!
//! fn trains<B: AutodiffBackend>() {}
//! trains::<Autodiff<NdArray>>();
//! ```
//!
//! ```compile_fail,E0277
//! use burn::backend::{Autodiff, Flex};
//! use burn::tensor::backend::AutodiffBackend;
//!
//! fn trains<B: AutodiffBackend>() {}
//! trains::<Autodiff<Flex>>();
//! ```
