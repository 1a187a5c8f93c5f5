#!/usr/bin/env bash
# burn-zero's GPU check: the CUDA and NCCL tests, collective and pack-kernel bandwidth, GPT step
# time against plain Burn and PyTorch FSDP2, and memory, in one report (docs/gpu-check.md).
#
#   scripts/gpu-check.sh build [DIR]   Anywhere with cargo, no CUDA or GPU needed: builds the
#                                      programs with `--features cuda`, strips them and packs
#                                      them with the runner into DIR (default
#                                      target/gpu-check/burn-zero-gpu-check) and DIR.tar.xz.
#   scripts/gpu-check.sh run [REPORT]  Runs the bundle built here (DIR/run.sh) and writes the
#                                      report to REPORT (default target/gpu-check/report).
#
# On a GPU machine without cargo or network, copy the tarball there and run:
#   tar xJf burn-zero-gpu-check.tar.xz && burn-zero-gpu-check/run.sh [REPORT]
#
# Environment (build): GPU_CHECK_PROFILE (cargo profile, default release: timings matter),
# CARGO_TARGET_DIR. The runner's own variables are listed in scripts/gpu-check/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle_default=target/gpu-check/burn-zero-gpu-check
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
    bundle_default="$CARGO_TARGET_DIR/gpu-check/burn-zero-gpu-check"
fi

# "target-name kind path" of every executable a cargo --message-format=json build produced.
executables() {
    python3 -c '
import json, sys
for line in open(sys.argv[1]):
    try:
        message = json.loads(line)
    except ValueError:
        continue
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        target = message["target"]
        print(target["name"], target["kind"][0], message["executable"])
' "$1"
}

build_bundle() {
    local out=${1:-$bundle_default} profile=${GPU_CHECK_PROFILE:-release} log
    log=$(mktemp -d)
    trap 'rm -rf "$log"' RETURN
    echo "== building the GPU check's programs ($profile profile, --features cuda)"
    cargo build --profile "$profile" --message-format=json-render-diagnostics \
        -p burn-zero -p burn-zero-comm -p burn-zero-kernels -p burn-zero-launch \
        --features burn-zero/cuda,burn-zero-comm/cuda,burn-zero-kernels/cuda,burn-zero-launch/cli \
        --example train_gpt --bin zero-run --bin nccl-rank-probe \
        --bench nccl --bench gpu_steps --bench pack_cuda --bench optimizer_cuda --bench largest_model \
        --test nccl --test kernel_cuda --test cuda >"$log/workspace.json"
    echo "== building the plain-Burn side (benches/plain-burn, --features cuda)"
    cargo build --profile "$profile" --message-format=json-render-diagnostics \
        --manifest-path benches/plain-burn/Cargo.toml --features cuda \
        --bench plain_gpu >"$log/plain.json"
    executables "$log/workspace.json" >"$log/list"
    executables "$log/plain.json" >>"$log/list"

    rm -rf "$out"
    mkdir -p "$out/bin"
    # bundle name <- cargo target name and kind
    local name target kind path
    while read -r name target kind; do
        path=$(awk -v t="$target" -v k="$kind" '$1 == t && $2 == k {print $3}' "$log/list" | tail -n 1)
        if [ -z "$path" ] || [ ! -x "$path" ]; then
            echo "no built $kind '$target' in cargo's output" >&2
            exit 1
        fi
        cp "$path" "$out/bin/$name"
        strip "$out/bin/$name"
    done <<'LIST'
train_gpt train_gpt example
zero-run zero-run bin
nccl-rank-probe nccl-rank-probe bin
nccl-bench nccl bench
gpu-steps gpu_steps bench
pack-cuda pack_cuda bench
optimizer-cuda optimizer_cuda bench
largest-model largest_model bench
plain-gpu plain_gpu bench
nccl-tests nccl test
kernel-cuda-tests kernel_cuda test
cuda-tests cuda test
LIST
    cp scripts/gpu-check/run.sh scripts/gpu-check/report.py scripts/gpu-check/fsdp2.py "$out/"
    chmod +x "$out/run.sh"
    {
        echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
        echo "built: $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m)"
        echo "profile: $profile"
        echo "rustc: $(rustc --version)"
    } >"$out/BUILD.txt"
    tar -C "$(dirname "$out")" -cf - "$(basename "$out")" | xz -9 -T0 >"$out.tar.xz"
    echo "== bundle"
    ls -l "$out/bin"
    du -sh "$out"
    ls -l "$out.tar.xz"
    echo "compressed: $(( $(stat -c %s "$out.tar.xz") / 1024 / 1024 )) MiB (limit 60 MiB)"
    echo "on the GPU machine: tar xJf $(basename "$out").tar.xz && $(basename "$out")/run.sh"
}

run_bundle() {
    local bundle=${GPU_CHECK_BUNDLE:-$bundle_default}
    if [ ! -x "$bundle/run.sh" ]; then
        echo "no bundle at $bundle: run scripts/gpu-check.sh build first" >&2
        exit 1
    fi
    "$bundle/run.sh" "${1:-$(dirname "$bundle")/report}"
}

case "${1:-}" in
    build) build_bundle "${2:-}" ;;
    run) run_bundle "${2:-}" ;;
    *)
        sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
