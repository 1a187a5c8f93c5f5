#!/usr/bin/env bash
# Builds the downstream crate as a project outside this repository would, runs its 2-rank CPU
# training (which fails unless the loss falls, the ranks agree and 2 ranks track 1 rank), and
# type-checks it with the `cuda` feature (no CUDA needed). Set CARGO_TARGET_DIR to share a
# build folder with the workspace.
set -euo pipefail
cd "$(dirname "$0")"
cargo run --locked -- --backend flex
cargo check --locked --features cuda
# The claims of its lib.rs: `Autodiff<Zero<…>>` trains; `Autodiff<NdArray>`/`<Flex>` no longer do.
cargo test --locked --doc
