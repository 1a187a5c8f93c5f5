#!/usr/bin/env bash
# CUDA checks of burn-zero: the NCCL engine's tests and the NCCL collective benchmark.
#
#   scripts/cuda.sh run           On a CUDA machine with cargo: build and run the CUDA tests,
#                                 then the NCCL benchmark (`cargo bench --features cuda`).
#   scripts/cuda.sh build [DIR]   Anywhere, no GPU or CUDA needed: build the CUDA test binary,
#                                 the rank probe it starts and the benchmark, strip them, and
#                                 pack them with a runner into DIR (default target/cuda-bundle)
#                                 and DIR.tar.gz. Prints the binaries.
#   DIR/run.sh                    On the GPU machine (no cargo needed): run what `build` packed.
#                                 From the tarball: tar xzf cuda-bundle.tar.gz && cuda-bundle/run.sh
#
# NCCL: cudarc opens `libnccl.so` (not libnccl.so.2). Both runners look, in order, at
# $NCCL_LIB_DIR, a libnccl.so already on the loader path, the pip package nvidia-nccl-cu12/-cu13
# (through python3), then any libnccl.so.2 under /usr, /opt and python's site directories; they
# make a folder with a `libnccl.so` symlink to it and put that folder on LD_LIBRARY_PATH.
#
# Environment: NCCL_LIB_DIR (a folder holding libnccl.so or libnccl.so.2), NCCL_BENCH_MAX_MIB
# (largest benchmark buffer, default 64), BENCH_PROFILE=dev (build mode: build the benchmark
# with the dev profile instead of `cargo bench`'s release profile, much faster to build).
set -euo pipefail
cd "$(dirname "$0")/.."

# Makes `libnccl.so` loadable (see above). Also written into the bundle's run.sh.
nccl_setup() {
    local found="" dir
    if [ -n "${NCCL_LIB_DIR:-}" ]; then
        if [ -e "$NCCL_LIB_DIR/libnccl.so" ]; then
            export LD_LIBRARY_PATH="$NCCL_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            echo "NCCL: $NCCL_LIB_DIR/libnccl.so"
            return 0
        fi
        found=$(ls "$NCCL_LIB_DIR"/libnccl.so.2* 2>/dev/null | head -n 1 || true)
    fi
    if [ -z "$found" ] && ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
        echo "NCCL: libnccl.so is on the loader path"
        return 0
    fi
    if [ -z "$found" ] && command -v python3 >/dev/null 2>&1; then
        found=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
roots = []
try:
    import nvidia.nccl
    roots += list(nvidia.nccl.__path__)
except Exception:
    pass
dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
roots += [os.path.join(d, "nvidia", "nccl") for d in dirs]
for root in roots:
    for path in sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*"))):
        print(path)
        raise SystemExit
PY
)
    fi
    if [ -z "$found" ]; then
        found=$(find /usr/lib /usr/lib64 /usr/local /opt -maxdepth 7 -name 'libnccl.so.2*' \
            -type f 2>/dev/null | head -n 1 || true)
    fi
    if [ -z "$found" ]; then
        echo "NCCL: no libnccl.so.2 found; install nvidia-nccl-cu12 (pip) or set NCCL_LIB_DIR" >&2
        return 1
    fi
    dir=$(mktemp -d)
    ln -s "$found" "$dir/libnccl.so"
    export LD_LIBRARY_PATH="$dir:$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "NCCL: $found (linked as $dir/libnccl.so)"
}

gpu_report() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L || true
    else
        echo "nvidia-smi not found: the CUDA tests will say they were skipped if no GPU is visible"
    fi
}

# Executables that a cargo --message-format=json build produced: "name kind path" lines.
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

run_here() {
    gpu_report
    nccl_setup
    echo "== CUDA tests"
    cargo test -p burn-zero-comm --features cuda --test nccl -- --nocapture
    echo "== NCCL benchmark"
    cargo bench --features cuda --bench nccl
}

build_bundle() {
    local out=${1:-target/cuda-bundle} log
    log=$(mktemp -d)
    echo "== building the CUDA test binary and the rank probe"
    cargo test -p burn-zero-comm --features cuda --test nccl --no-run \
        --message-format=json-render-diagnostics >"$log/tests.json"
    echo "== building the NCCL benchmark (${BENCH_PROFILE:-bench} profile)"
    if [ "${BENCH_PROFILE:-}" = dev ]; then
        cargo build --features cuda --bench nccl --message-format=json-render-diagnostics \
            >"$log/bench.json"
    else
        cargo bench --features cuda --bench nccl --no-run \
            --message-format=json-render-diagnostics >"$log/bench.json"
    fi
    local tests probe bench
    tests=$(executables "$log/tests.json" | awk '$1 == "nccl" && $2 == "test" {print $3}' | tail -n 1)
    probe=$(executables "$log/tests.json" | awk '$1 == "nccl-rank-probe" {print $3}' | tail -n 1)
    bench=$(executables "$log/bench.json" | awk '$1 == "nccl" && $2 == "bench" {print $3}' | tail -n 1)
    for binary in "$tests" "$probe" "$bench"; do
        if [ -z "$binary" ] || [ ! -x "$binary" ]; then
            echo "could not find a built binary (tests: '$tests', probe: '$probe', bench: '$bench')" >&2
            exit 1
        fi
    done
    rm -rf "$out"
    mkdir -p "$out"
    cp "$tests" "$out/nccl-tests"
    cp "$probe" "$out/nccl-rank-probe"
    cp "$bench" "$out/nccl-bench"
    strip "$out/nccl-tests" "$out/nccl-rank-probe" "$out/nccl-bench" 2>/dev/null || true
    {
        echo '#!/usr/bin/env bash'
        echo '# Runs the CUDA tests and the NCCL benchmark packed by scripts/cuda.sh build.'
        echo 'set -euo pipefail'
        echo 'here=$(cd "$(dirname "$0")" && pwd)'
        declare -f nccl_setup
        declare -f gpu_report
        echo 'gpu_report'
        echo 'nccl_setup'
        echo 'export NCCL_RANK_PROBE="$here/nccl-rank-probe"'
        echo 'echo "== CUDA tests"'
        echo '"$here/nccl-tests" --nocapture'
        echo 'echo "== NCCL benchmark"'
        echo '"$here/nccl-bench"'
    } >"$out/run.sh"
    chmod +x "$out/run.sh"
    tar czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
    rm -rf "$log"
    echo "== bundle"
    echo "built from: $tests"
    echo "            $probe"
    echo "            $bench"
    ls -l "$out" "$out.tar.gz"
    echo "on the GPU machine: tar xzf $(basename "$out").tar.gz && $(basename "$out")/run.sh"
}

case "${1:-}" in
    run) run_here ;;
    build) build_bundle "${2:-}" ;;
    *)
        sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
