#!/usr/bin/env bash
# Single-rank overhead of burn-zero over plain Burn, measured in alternation: the baseline and
# burn-zero's N = 1 runs take turns, ROUNDS times (default 5), so that a slow phase of the
# machine weighs on both. Writes target/bench-reports/ab-plain-K.json and ab-scaling-K.json,
# which `cargo run -p scaling-report` summarises in docs/scaling.md.
# Run from the repository root: benches/plain-burn/overhead.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds="${1:-5}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
rm -f target/bench-reports/ab-plain-*.json target/bench-reports/ab-scaling-*.json
for round in $(seq 1 "$rounds"); do
    PLAIN_REPORT="ab-plain-$round" cargo bench --manifest-path benches/plain-burn/Cargo.toml
    SCALING_REPORT="ab-scaling-$round" SCALING_WORLD_SIZES=1 cargo bench --bench scaling
done
