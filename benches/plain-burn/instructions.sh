#!/usr/bin/env bash
# Single-rank overhead of burn-zero over plain Burn, in instructions: callgrind counts the
# instructions of a process exactly, whatever else the machine runs, so the ratio does not
# drift as wall-clock times do on a shared machine.
#
# Each side runs a few GPT `small` training steps on Flex with one rayon thread (idle workers
# spinning would count): plain Burn (`Autodiff<Flex>`, Burn's Adam; this package's `steps`)
# and burn-zero at N = 1 (`Autodiff<Zero<Flex>>`, ZeroOptimizer with Adam; the workspace's
# `zero_steps`) at stages 0 and 3. Each runs twice under callgrind, with FEW and MANY steps;
# the difference divided by MANY - FEW is the instructions of one step, start-up and the first
# (state-creating) step cancelled out. Writes target/bench-reports/instructions.json, which
# `cargo run -p scaling-report` puts in docs/scaling.md.
# Run from anywhere: benches/plain-burn/instructions.sh  (FEW=1 MANY=3 by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
few="${FEW:-1}"
many="${MANY:-3}"
export RAYON_NUM_THREADS=1
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is not installed" >&2; exit 1; }

# The path of a bench executable that `cargo bench --no-run` builds.
executable() {
    cargo bench --no-run --message-format=json "$@" 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "bench" in m["target"]["kind"]:
        print(m["executable"])'
}
plain=$(executable --manifest-path benches/plain-burn/Cargo.toml --bench steps)
zero=$(executable --bench zero_steps)
[ -x "$plain" ] && [ -x "$zero" ] || { echo "instructions.sh: the runners did not build" >&2; exit 1; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Instructions (Ir) of one run: callgrind's total over every thread.
count() {
    local file="$out/callgrind.out"
    valgrind --tool=callgrind --callgrind-out-file="$file" "$@" >/dev/null 2>"$out/log" ||
        { cat "$out/log" >&2; exit 1; }
    sed -n 's/^totals: *\([0-9]*\).*/\1/p' "$file"
}
per_step() { # name, command...
    local name=$1; shift
    local a b
    a=$(count "$@" "$few")
    b=$(count "$@" "$many")
    echo "$name: $a instructions with $few step(s), $b with $many" >&2
    echo "\"$name\": {\"few\": $a, \"many\": $b, \"per_step\": $(( (b - a) / (many - few) ))}"
}
{
    echo "{"
    echo "\"few_steps\": $few, \"many_steps\": $many,"
    echo "\"cpu\": \"$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)\","
    echo "\"valgrind\": \"$(valgrind --version)\","
    echo "\"unix_time\": $(date +%s),"
    per_step plain "$plain"; echo ","
    per_step stage0 "$zero" 0; echo ","
    per_step stage3 "$zero" 3
    echo "}"
} > "$out/instructions.json"
mkdir -p target/bench-reports
python3 -m json.tool "$out/instructions.json" > target/bench-reports/instructions.json
cat target/bench-reports/instructions.json
