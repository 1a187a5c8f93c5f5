//! `Zero<B>`'s op traits, one file per kind, written by the forwarding macros of `forward`.

mod forward;
mod prelude;

mod activation;
mod bool;
mod distributed;
mod float;
mod int;
mod module;
mod qtensor;
mod transaction;
