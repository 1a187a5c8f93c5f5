//! Nothing here: the baseline is the `plain` bench (`benches/plain.rs`).
