#!/usr/bin/env bash
# Runs burn-zero's GPU check from a bundle made by `scripts/gpu-check.sh build`; needs no Rust
# toolchain and no network. Usage:
#
#   run.sh [REPORT_DIR]        (default: ./gpu-check-report)
#
# Sections: environment, tests (CUDA kernels, NCCL engine, training on NCCL, train_gpt under
# zero-run, ranks sharing the GPU), workloads (what users train: GPT-2 small's shape and GPT
# small, f32 and bf16, plain Burn against Zero at stages 0 and 3 over CubeBackend and fused
# Cuda, and FSDP2, with counts and launches), nccl (collective bandwidth), pack (pack/unpack against a device copy), optimizer
# (the fused Adam kernel against Burn's Adam, the copy bandwidth and the host pass), steps
# (GPT step time, Zero at stages 0-3 with one parameter per chunk and at stage 3 with the
# searched chunk size, against plain Burn, with memory and burn-zero's collectives and device
# synchronisations per step), largest (the largest GPT whose step fits the device's free
# memory, plain Burn against burn-zero's placements), fsdp2 (PyTorch FSDP2 on the same GPT).
# A section that fails
# records its error and the others still run; at the end REPORT_DIR holds report.json,
# report.md and every section's log.
#
# Environment: NCCL_LIB_DIR (a folder holding libnccl.so or libnccl.so.2), GPU_CHECK_ROUNDS
# (step-time rounds, default 3), GPU_CHECK_SECTIONS (space-separated subset to run),
# GPU_CHECK_WORKLOADS (the workloads section's runs, e.g. "gpt2-f32 small-f32"),
# GPU_CHECK_LARGEST_SIDES, GPU_CHECK_LARGEST_MIN_K, GPU_CHECK_LARGEST_MAX_K,
# GPU_CHECK_LARGEST_BUDGET_MIB and GPU_CHECK_LARGEST_BATCH (the largest-model search's sides,
# first and largest size, device budget, default the free memory, and sequences a step,
# default 8), GPU_CHECK_SECTION_TIMEOUT (seconds a section may
# run before it is stopped and recorded as timed out, exit 124; default none; a section named
# as NAME:SECONDS in GPU_CHECK_SECTIONS gets its own), GPU_CHECK_DEADLINE (seconds the whole
# run must end within: each section's limit is cut to what is left, less half a minute for
# the report, and a section with under 15 s left is not started), GPU_CHECK_TARBALL (a file
# that receives the report folder as a .tar.gz, with report.md beside it, after every section:
# what a run cut short still brings back), PYTHON (default python3).
#
# The report is written after every section, and on TERM or INT the running section is
# stopped (its programs with it) and the report written before the script exits.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$PWD/gpu-check-report}
mkdir -p "$out/logs" "$out/data"
out=$(cd "$out" && pwd)
python=${PYTHON:-python3}
rounds=${GPU_CHECK_ROUNDS:-3}
section_timeout=${GPU_CHECK_SECTION_TIMEOUT:-}
deadline=${GPU_CHECK_DEADLINE:-}
tarball=${GPU_CHECK_TARBALL:-}
sections=${GPU_CHECK_SECTIONS:-"environment tests workloads nccl pack optimizer steps largest fsdp2"}
bin="$here/bin"
status="$out/data/sections.tsv"
: >"$status"

# Makes `libnccl.so` loadable: cudarc opens that name, the pip package nvidia-nccl-cu12/-cu13
# ships libnccl.so.2. Looks at $NCCL_LIB_DIR, the loader path, the pip package (through
# python), then /usr and /opt; links the library as libnccl.so in a private folder.
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
    if [ -z "$found" ] && ldconfig -p 2>/dev/null | grep 'libnccl\.so ' >/dev/null; then
        echo "NCCL: libnccl.so is on the loader path"
        return 0
    fi
    if [ -z "$found" ] && command -v "$python" >/dev/null 2>&1; then
        found=$("$python" - <<'PY' 2>/dev/null || true
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
        echo "NCCL: no libnccl.so.2 found; install nvidia-nccl-cu13 (pip) or set NCCL_LIB_DIR"
        return 1
    fi
    dir="$out/data/nccl-lib"
    mkdir -p "$dir"
    ln -sf "$found" "$dir/libnccl.so"
    export LD_LIBRARY_PATH="$dir:$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "NCCL: $found (linked as $dir/libnccl.so)"
}

# The CUDA toolkit's libraries (NVRTC compiles cubecl's kernels) on the loader path; without a
# toolkit, NVRTC from the pip packages (nvidia-cuda-nvrtc, -cu12), found through python.
cuda_setup() {
    local d found=""
    for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" "${CUDA_HOME:-/usr/local/cuda}/targets/x86_64-linux/lib"; do
        if [ -d "$d" ]; then
            export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then found=$d; fi
        fi
    done
    if [ -z "$found" ] && command -v "$python" >/dev/null 2>&1; then
        found=$("$python" - <<'PY' 2>/dev/null || true
import glob, os, site
dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
for d in dirs:
    for path in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so*"))):
        print(os.path.dirname(path))
        raise SystemExit
PY
)
        if [ -n "$found" ]; then
            export LD_LIBRARY_PATH="$found${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
    echo "NVRTC: ${found:-not found in the CUDA toolkit or the pip packages}"
}

# Whether the driver sees a GPU (nvidia-smi lists one). Greps read to the end (no -q): under
# pipefail, a grep that quits early could fail the pipeline on the writer's SIGPIPE.
gpu_present() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep '^GPU ' >/dev/null
}

# The running section's `timeout` process and its name and start, for the signal handler.
current="" current_name="" current_started=""

# section NAME LIMIT COMMAND...: runs COMMAND (for at most LIMIT seconds, when not empty) with
# its output in logs/NAME.log and records
# "NAME<TAB>exit code<TAB>milliseconds" in data/sections.tsv.
section() {
    local name=$1 limit=$2 started rc
    shift 2
    echo "== $name"
    started=$(date +%s%N)
    # Another shell: whatever goes wrong inside a section stays inside it. `timeout` runs it
    # in a process group of its own, so that stopping the section stops its programs too; in
    # the background, so that a signal to this script is handled at once (`on_signal`).
    export -f "$@" with_driver_memory 2>/dev/null
    export here out bin python rounds
    timeout --kill-after=10 "${limit:-1000000}" bash -c "$*" >"$out/logs/$name.log" 2>&1 &
    current=$! current_name=$name current_started=$started
    wait "$current"
    rc=$?
    current=""
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( ($(date +%s%N) - started) / 1000000 ))" >>"$status"
    if [ "$rc" -eq 0 ]; then
        echo "   ok"
    else
        echo "   failed (exit $rc): see $out/logs/$name.log"
        tail -n 5 "$out/logs/$name.log" | sed 's/^/   | /'
    fi
    return 0
}

# Runs a program and samples the GPU memory the driver reports for its process every 0.2 s;
# the peak (MiB) goes to FILE. Usage: with_driver_memory FILE COMMAND...
with_driver_memory() {
    local file=$1 pid peak=0 used
    shift
    "$@" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        if command -v nvidia-smi >/dev/null 2>&1; then
            used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
                | awk -F', *' -v p="$pid" '$1 == p {print $2}' | head -n 1)
            if [ -n "$used" ] && [ "$used" -gt "$peak" ] 2>/dev/null; then
                peak=$used
            fi
        fi
        sleep 0.2
    done
    wait "$pid"
    local rc=$?
    echo "$peak" >"$file"
    return "$rc"
}

environment() {
    echo "host: $(hostname)"
    echo "kernel: $(uname -srm)"
    if [ -f "$here/BUILD.txt" ]; then cat "$here/BUILD.txt"; fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
        nvidia-smi | head -n 4 || true
    else
        echo "nvidia-smi not found"
    fi
    ls -d "${CUDA_HOME:-/usr/local/cuda}" 2>/dev/null && cat "${CUDA_HOME:-/usr/local/cuda}/version.json" 2>/dev/null | head -n 20
    "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 || true
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    echo "BURN_ZERO_REQUIRE_CUDA=${BURN_ZERO_REQUIRE_CUDA:-}"
}

tests() {
    local rc=0
    export NCCL_RANK_PROBE="$bin/nccl-rank-probe" ZERO_RUN="$bin/zero-run" TRAIN_GPT="$bin/train_gpt"
    # One test at a time: GPU tests of different binaries share the device anyway. The
    # training tests of rank processes sharing the GPU (names with "process") last: they are
    # the longest, and a hang there must not keep the others from running.
    for t in kernel-cuda-tests "cuda-tests --skip process" nccl-tests "cuda-tests process"; do
        echo "--- $t"
        # shellcheck disable=SC2086
        "$bin"/$t --test-threads 1 || rc=1
    done
    return $rc
}

workloads() {
    # What users train, world size 1: GPT-2 small's shape (12 blocks of width 768, 12 heads;
    # sequences of 512, 8 a step) and GPT small, each in f32 and in bf16; plain Burn against
    # Zero at stages 0 and 3 (searched chunks) over CubeBackend and over Burn's fused Cuda, and
    # PyTorch FSDP2 on the same shape. Short runs (3 warm-up steps, 10 timed), the most wanted
    # first; GPU_CHECK_WORKLOADS narrows them ("gpt2-f32 small-f32 ..."). Then the kernel
    # launches of one GPT-2 step, plain Burn and stage 3, in runs of their own.
    local rc=0 workload preset precision backend stage shape
    mkdir -p "$out/data/workloads"
    for workload in ${GPU_CHECK_WORKLOADS:-gpt2-f32 small-f32 gpt2-bf16 small-bf16}; do
        preset=${workload%-*}
        precision=${workload#*-}
        shape=(--preset "$preset" --precision "$precision" --warmup 3 --steps 10)
        if [ "$preset" = gpt2 ]; then shape+=(--seq-len 512 --batch 8); fi
        for backend in cube cuda; do
            echo "--- $workload: plain Burn ($backend)"
            with_driver_memory "$out/data/workloads/$workload-plain-$backend.driver-mib" \
                "$bin/plain-gpu" --backend "$backend" "${shape[@]}" \
                --out "$out/data/workloads/$workload-plain-$backend.json" || rc=1
            for stage in 0 3; do
                echo "--- $workload: burn-zero stage $stage ($backend, searched chunks)"
                with_driver_memory "$out/data/workloads/$workload-zero-$backend-$stage.driver-mib" \
                    "$bin/gpu-steps" --backend "$backend" --stage "$stage" --chunk-size search \
                    "${shape[@]}" --out "$out/data/workloads/$workload-zero-$backend-$stage.json" || rc=1
            done
        done
        echo "--- $workload: PyTorch FSDP2"
        local seq=()
        if [ "$preset" = gpt2 ]; then seq=(--seq-len 512 --batch 8); fi
        "$python" "$here/fsdp2.py" --preset "$preset" --precision "$precision" "${seq[@]}" \
            --warmup 3 --steps 10 --out "$out/data/workloads/$workload-fsdp2.json" || rc=1
    done
    for backend in cube cuda; do
        echo "--- kernel launches of one gpt2-f32 step ($backend)"
        local launches=(--preset gpt2 --seq-len 512 --batch 8 --warmup 2 --steps 1 --count-launches)
        "$bin/plain-gpu" --backend "$backend" "${launches[@]}" \
            --out "$out/data/workloads/launches-gpt2-f32-plain-$backend.json" || rc=1
        "$bin/gpu-steps" --backend "$backend" --stage 3 --chunk-size search "${launches[@]}" \
            --out "$out/data/workloads/launches-gpt2-f32-zero-$backend-3.json" || rc=1
    done
    return $rc
}

nccl() {
    NCCL_BENCH_REPORT="$out/data/nccl.json" "$bin/nccl-bench"
}

pack() {
    PACK_CUDA_REPORT="$out/data/pack.json" "$bin/pack-cuda" --bench
}

optimizer() {
    OPTIMIZER_CUDA_REPORT="$out/data/optimizer.json" "$bin/optimizer-cuda"
}

largest() {
    # The largest GPT whose step fits the device's free memory: plain Burn against stage 3 with
    # the optimizer and parameters on the host, and the auto placement (sizes doubled, then
    # halved between the last that fit and the first that did not; each trial a process).
    # The budget is the free memory unless GPU_CHECK_LARGEST_BUDGET_MIB names one.
    if [ -n "${GPU_CHECK_LARGEST_BUDGET_MIB:-}" ]; then
        export LARGEST_BUDGET_MIB=$GPU_CHECK_LARGEST_BUDGET_MIB
    fi
    LARGEST_MODEL_REPORT="$out/data/largest.json" \
        LARGEST_SIDES=${GPU_CHECK_LARGEST_SIDES:-plain-burn,stage3-parameters-on-host,stage3-auto-placement} \
        LARGEST_MIN_K=${GPU_CHECK_LARGEST_MIN_K:-1} LARGEST_MAX_K=${GPU_CHECK_LARGEST_MAX_K:-48} \
        LARGEST_BATCH=${GPU_CHECK_LARGEST_BATCH:-8} LARGEST_JUDGE=in_use \
        "$bin/largest-model" --bench --backend cuda
}

steps() {
    local round stage rc=0
    mkdir -p "$out/data/steps"
    # Rounds alternate the sides, so that a slow phase of the machine weighs on all of them.
    for round in $(seq 1 "$rounds"); do
        for backend in cube cuda; do
            echo "--- round $round: plain Burn ($backend)"
            with_driver_memory "$out/data/steps/plain-$backend-$round.driver-mib" \
                "$bin/plain-gpu" --backend "$backend" --out "$out/data/steps/plain-$backend-$round.json" || rc=1
        done
        for stage in 0 1 2 3; do
            echo "--- round $round: burn-zero stage $stage"
            with_driver_memory "$out/data/steps/zero-$stage-$round.driver-mib" \
                "$bin/gpu-steps" --stage "$stage" --chunk-size param \
                --out "$out/data/steps/zero-$stage-$round.json" || rc=1
        done
        # Chunks: the stage-3 step with the searched chunk size beside one parameter per chunk.
        echo "--- round $round: burn-zero stage 3, searched chunks"
        with_driver_memory "$out/data/steps/zero-3-search-$round.driver-mib" \
            "$bin/gpu-steps" --stage 3 --chunk-size search \
            --out "$out/data/steps/zero-3-search-$round.json" || rc=1
    done
    # Kernel launches of one step, in runs of their own: cubecl's execution log, which counts
    # them, writes a line per launch and would slow the timed steps.
    mkdir -p "$out/data/launches"
    for run in "0 param zero-0" "3 param zero-3" "3 search zero-3-search"; do
        read -r stage chunks name <<<"$run"
        echo "--- kernel launches: $name"
        "$bin/gpu-steps" --stage "$stage" --chunk-size "$chunks" --warmup 3 --steps 1 \
            --count-launches --out "$out/data/launches/$name.json" || rc=1
    done
    echo "--- kernel launches: plain-cube"
    "$bin/plain-gpu" --backend cube --warmup 3 --steps 1 \
        --count-launches --out "$out/data/launches/plain-cube.json" || rc=1
    return $rc
}

fsdp2() {
    "$python" "$here/fsdp2.py" --out "$out/data/fsdp2.json"
}

# Writes the report from what has run so far and, with GPU_CHECK_TARBALL, packs the report
# folder there (whole or not at all) with report.md beside it.
write_report() {
    "$python" "$here/report.py" "$out" >"$out/logs/report.log" 2>&1 \
        || echo "report.py failed: the logs are in $out/logs"
    if [ -n "$tarball" ]; then
        tar czf "$tarball.part" -C "$(dirname "$out")" "$(basename "$out")" \
            && mv "$tarball.part" "$tarball"
        if [ -f "$out/report.md" ]; then cp "$out/report.md" "$(dirname "$tarball")/report.md"; fi
    fi
}

# TERM or INT (an outer time limit): stops the running section with its programs, records
# it (exit 143) and writes the report.
on_signal() {
    if [ -n "$current" ]; then
        kill -TERM "$current" 2>/dev/null
        wait "$current" 2>/dev/null
        printf '%s\t%s\t%s\n' "$current_name" 143 \
            "$(( ($(date +%s%N) - current_started) / 1000000 ))" >>"$status"
    fi
    write_report
    exit 143
}
trap on_signal TERM INT

echo "burn-zero GPU check: report in $out"
cuda_setup >"$out/logs/nccl-setup.log" 2>&1
nccl_setup >>"$out/logs/nccl-setup.log" 2>&1
cat "$out/logs/nccl-setup.log"
if gpu_present; then
    # The driver sees a GPU: a test that finds no device has found a bug, not a reason to skip.
    export BURN_ZERO_REQUIRE_CUDA=1
fi
for entry in $sections; do
    # NAME or NAME:SECONDS
    name=${entry%%:*}
    limit=$section_timeout
    if [ "$entry" != "$name" ]; then limit=${entry#*:}; fi
    if [ -n "$deadline" ]; then
        left=$(( deadline - SECONDS - 30 ))
        if [ "$left" -lt 15 ]; then
            echo "== $name: not started, $(( deadline - SECONDS )) s left of the deadline"
            continue
        fi
        if [ -z "$limit" ] || [ "$limit" -gt "$left" ]; then limit=$left; fi
    fi
    section "$name" "$limit" "$name"
    write_report
done
write_report
cat "$out/logs/report.log"
