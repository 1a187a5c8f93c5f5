#!/usr/bin/env python3
"""Turns a GPU-check run (run.sh's REPORT_DIR: data/, logs/) into report.json and report.md.

Every section gets a status: "ok", "failed" (with its exit code and the end of its log),
"no CUDA device" (the programs ran and found none), or "not run". Standard library only.
"""

import glob
import json
import os
import re
import statistics
import sys

MEMORY_KINDS = [
    "parameter_shards",
    "persistent_parameters",
    "gradient_shards",
    "gathered",
    "buckets",
    "master_weights",
    "optimizer_state",
    "gradient_accumulators",
]


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def load(path):
    text = read(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as error:
        return {"error": f"{os.path.basename(path)}: not JSON ({error})"}


def tail(text, lines=15):
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


def sections_run(out):
    rows = {}
    for line in (read(os.path.join(out, "data", "sections.tsv")) or "").splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            rows[parts[0]] = {"exit_code": int(parts[1]), "seconds": int(parts[2]) / 1000}
    return rows


def environment(log):
    env = {}
    for line in (log or "").splitlines():
        m = re.match(r"^(\d+), (.+), (\d+ MiB), ([\d.]+)$", line.strip())
        if m:
            env.setdefault("gpus", []).append(
                {"index": int(m[1]), "name": m[2], "memory": m[3], "driver": m[4]}
            )
        m = re.search(r"CUDA Version: ([\d.]+)", line)
        if m:
            env["driver_cuda_version"] = m[1]
        if line.startswith("torch "):
            env["torch"] = line[len("torch "):]
        for key in ("host", "kernel", "commit", "built", "profile", "rustc"):
            if line.startswith(key + ": "):
                env[key] = line[len(key) + 2:]
        if line.startswith("NCCL: "):
            env["nccl"] = line[len("NCCL: "):]
    return env


def tests(log):
    """Counts per test binary (each block starts at the `--- NAME` line run.sh prints): from
    libtest's summary line where the binary finished; where it was stopped (a time limit), from
    the tests that printed `ok`, naming the test that was still running."""
    passed = failed = skipped_count = 0
    skipped, failures, interrupted = [], [], []
    blocks = re.split(r"^--- ([^\n]+)\n", log or "", flags=re.M)
    # re.split with a group: [before, name1, block1, name2, block2, ...]
    named = list(zip(blocks[1::2], blocks[2::2])) or [("tests", log or "")]
    for name, block in named:
        block_skipped = re.findall(r"SKIPPED: ([^:\s]+): ([^\n]*)", block)
        skipped += block_skipped
        skipped_count += len(block_skipped)
        failures += re.findall(r"^test (\S+) \.\.\. FAILED", block, re.M)
        summary = re.search(r"test result: \w+\. (\d+) passed; (\d+) failed", block)
        if summary:
            passed += int(summary[1]) - len(block_skipped)
            failed += int(summary[2])
            continue
        ok = len(re.findall(r"(?:\.\.\. |^)ok$", block, re.M))
        passed += max(0, ok - len(block_skipped))
        failed += len(re.findall(r"^test (\S+) \.\.\. FAILED", block, re.M))
        started = re.findall(r"^test (\S+) \.\.\.", block, re.M)
        if started:
            interrupted.append(f"{name}: {started[-1]}")
    return {
        "passed": passed,
        "failed": failed,
        "skipped": skipped_count,
        "skipped_tests": [{"test": t, "reason": r} for t, r in skipped],
        "failed_tests": failures,
        "interrupted": interrupted,
    }


def steps(out):
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "data", "steps", "*.json"))):
        name = os.path.basename(path)[: -len(".json")]
        config, _, _round = name.rpartition("-")
        value = load(path) or {}
        driver = read(path[: -len(".json")] + ".driver-mib")
        if driver and driver.strip().isdigit() and int(driver) > 0:
            value["driver_peak_mib"] = int(driver)
        runs.setdefault(config, []).append(value)
    if not runs:
        return None
    if all("skipped" in r for rs in runs.values() for r in rs):
        return {"skipped": next(iter(runs.values()))[0]["skipped"]}
    table = {}
    for config, values in runs.items():
        medians = [v["median_step_s"] for v in values if "median_step_s" in v]
        row = {
            "backend": next((v.get("backend") for v in values if v.get("backend")), None),
            "rounds": len(medians),
            "median_step_s": statistics.median(medians) if medians else None,
            "round_medians_s": medians,
            "driver_peak_mib": max((v.get("driver_peak_mib", 0) for v in values), default=0) or None,
        }
        # burn-zero's counts per step and chunk layout (the same in every round).
        for key in ("chunk_size", "chunks", "counts_per_step"):
            found = next((v[key] for v in values if v.get(key) is not None and "skipped" not in v), None)
            if found is not None:
                row[key] = found
        memory = next((v.get("memory") for v in values if v.get("memory")), None)
        if memory:
            row["tracer_peak_bytes"] = {
                k: memory[k]["peak"] for k in MEMORY_KINDS if isinstance(memory.get(k), dict)
            }
            row["tracer_sum_of_peaks_bytes"] = sum(row["tracer_peak_bytes"].values())
        table[config] = row
    for base in ("plain-cube", "plain-cuda"):
        reference = (table.get(base) or {}).get("median_step_s")
        for config, row in table.items():
            if config.startswith("zero-") and reference and row["median_step_s"]:
                row[f"ratio_to_{base}"] = row["median_step_s"] / reference
    # Kernel launches of one step, counted in runs of their own.
    for path in sorted(glob.glob(os.path.join(out, "data", "launches", "*.json"))):
        config = os.path.basename(path)[: -len(".json")]
        launches = (load(path) or {}).get("kernel_launches_per_step")
        if config in table and launches is not None:
            table[config]["kernel_launches_per_step"] = launches
    # Searched chunks against one parameter per chunk at stage 3.
    per_parameter = (table.get("zero-3") or {}).get("median_step_s")
    searched = table.get("zero-3-search")
    if searched and per_parameter and searched["median_step_s"]:
        searched["ratio_to_zero-3"] = searched["median_step_s"] / per_parameter
    return {"configs": table, "goal": "stage 3 at most 1.10x plain Burn"}


WORKLOAD_SIDES = ["plain-cube", "zero-cube-0", "zero-cube-3", "plain-cuda", "zero-cuda-0",
                  "zero-cuda-3", "fsdp2"]


def workloads(out):
    """The workloads section: each workload's runs by side, step-time ratios and counts."""
    table = {}
    for path in sorted(glob.glob(os.path.join(out, "data", "workloads", "*.json"))):
        name = os.path.basename(path)[: -len(".json")]
        value = load(path) or {}
        if name.startswith("launches-"):
            rest = name[len("launches-"):]
            workload = "-".join(rest.split("-")[:2])
            side = rest[len(workload) + 1:]
            launches = value.get("kernel_launches_per_step")
            if launches is not None:
                table.setdefault(workload, {}).setdefault(side, {})["kernel_launches_per_step"] = launches
            continue
        workload = "-".join(name.split("-")[:2])
        side = name[len(workload) + 1:]
        row = table.setdefault(workload, {}).setdefault(side, {})
        driver = read(path[: -len(".json")] + ".driver-mib")
        if driver and driver.strip().isdigit() and int(driver) > 0:
            row["driver_peak_mib"] = int(driver)
        for key in ("skipped", "error", "backend", "parameters", "seq_len", "global_batch",
                    "median_step_s", "counts_per_step", "chunks", "max_memory_allocated_bytes"):
            if key in value:
                row[key] = value[key]
    if not table:
        return None
    sides = [r for w in table.values() for r in w.values() if "median_step_s" in r or "skipped" in r]
    if sides and all("skipped" in r for r in sides):
        return {"skipped": sides[0]["skipped"]}
    for workload, runs in table.items():
        for backend in ("cube", "cuda"):
            plain = (runs.get(f"plain-{backend}") or {}).get("median_step_s")
            for stage in ("0", "3"):
                zero = runs.get(f"zero-{backend}-{stage}") or {}
                if plain and zero.get("median_step_s"):
                    zero["ratio_to_plain"] = zero["median_step_s"] / plain
        fsdp2 = (runs.get("fsdp2") or {}).get("median_step_s")
        for backend in ("cube", "cuda"):
            zero = runs.get(f"zero-{backend}-3") or {}
            if fsdp2 and zero.get("median_step_s"):
                zero["ratio_to_fsdp2"] = zero["median_step_s"] / fsdp2
    return {"workloads": table,
            "goal": "stage 3 within 1.05x plain Burn on the same backend for gpt2, 1.10x for small; "
                    "at or under FSDP2's step"}


def status_of(name, ran, data):
    if name not in ran:
        return "not run"
    if isinstance(data, dict) and isinstance(data.get("skipped"), str) and ran[name]["exit_code"] == 0:
        return "no CUDA device"
    if ran[name]["exit_code"] in (124, 137):
        return "timed out"
    if ran[name]["exit_code"] == 143:
        return "stopped with the run"
    return "ok" if ran[name]["exit_code"] == 0 else "failed"


def build(out):
    ran = sections_run(out)
    logs = {n: read(os.path.join(out, "logs", f"{n}.log")) for n in ran}
    report = {"sections": {}}
    data = {
        "environment": environment((logs.get("environment") or "") + "\n" + (read(os.path.join(out, "logs", "nccl-setup.log")) or "")),
        "tests": tests(logs.get("tests")),
        "nccl": load(os.path.join(out, "data", "nccl.json")),
        "pack": load(os.path.join(out, "data", "pack.json")),
        "optimizer": load(os.path.join(out, "data", "optimizer.json")),
        "steps": steps(out),
        "workloads": workloads(out),
        "largest": load(os.path.join(out, "data", "largest.json")),
        "fsdp2": load(os.path.join(out, "data", "fsdp2.json")),
    }
    for name, value in data.items():
        entry = {"status": status_of(name, ran, value), "data": value}
        # Every skipped test skipped for want of a device: the machine has none.
        if name == "tests" and name in ran and value["failed"] == 0 and value["skipped"] > 0 \
                and ran[name]["exit_code"] == 0 \
                and all("no CUDA device" in t["reason"] for t in value["skipped_tests"]):
            entry["status"] = "no CUDA device"
        if name in ran:
            entry.update(ran[name])
            if ran[name]["exit_code"] != 0:
                entry["error"] = tail(logs.get(name))
        report["sections"][name] = entry
    return report


def markdown(report):
    s = report["sections"]
    env = s["environment"]["data"]
    gpus = env.get("gpus") or []
    machine = ", ".join(f"{g['name']} ({g['memory']})" for g in gpus) or "no GPU visible"
    lines = [
        "# burn-zero GPU check",
        "",
        f"Machine: {machine}; driver {gpus[0]['driver'] if gpus else '-'}, "
        f"CUDA {env.get('driver_cuda_version', '-')}; host {env.get('host', '-')}; "
        f"PyTorch {env.get('torch', '-')}; NCCL {env.get('nccl', '-')}.",
        f"Bundle: {env.get('commit', '-')}, {env.get('profile', '-')} profile, built {env.get('built', '-')}.",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
    ]
    for name, entry in s.items():
        lines.append(f"| {name} | {entry['status']} | {entry.get('seconds', '-')} |")
    for name, entry in s.items():
        if entry.get("error"):
            lines += ["", f"**{name} failed** (exit {entry['exit_code']}):", "", "```text", entry["error"], "```"]

    t = s["tests"]["data"]
    lines += ["", "## Tests", "", f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped."]
    for f in t["failed_tests"]:
        lines.append(f"- FAILED {f}")
    for i in t.get("interrupted", []):
        lines.append(f"- still running when the section was stopped: {i}")
    for k in t["skipped_tests"]:
        lines.append(f"- skipped {k['test']}: {k['reason']}")

    lines += ["", "## NCCL collectives", ""]
    nccl = s["nccl"]["data"]
    if nccl and "rows" in nccl:
        lines += ["algbw = bytes / time; busbw = algbw × (n−1)/n (all-gather, reduce-scatter), "
                  "× 2(n−1)/n (all-reduce), as nccl-tests defines them.", "",
                  "| engine | op | ranks | bytes | time (ms) | algbw GB/s | busbw GB/s |", "|---|---|---|---|---|---|---|"]
        for r in nccl["rows"]:
            lines.append(f"| {r['engine']} | {r['op']} | {r['ranks']} | {r['bytes']} | {r['seconds'] * 1e3:.3f} | "
                         f"{r['algbw_gb_s']:.2f} | {r['busbw_gb_s']:.2f} |")
    else:
        lines.append(s["nccl"]["status"] if not nccl else nccl.get("skipped", nccl.get("error", "-")))

    lines += ["", "## Pack kernels against a device copy", ""]
    pack = s["pack"]["data"]
    if pack and "results" in pack:
        lines += ["Buckets of 1, 25 and 100 MiB, 7 or 48 members of odd lengths (at 25 MiB also 48 members "
                  "that divide by the widest vector), 1 or 8 rank rows; bytes read plus written "
                  "per second against the device copy of a tensor of the bucket's size. Device time: a "
                  "batch of calls between two synchronisations; host time: enqueueing one call. "
                  "Goal: 80% of the copy or more.", "",
                  "| path | device µs per call | GB/s | of copy | host µs per call |", "|---|---|---|---|---|"]
        for r in pack["results"]:
            frac = r.get("fraction_of_copy")
            host = r.get("host_s_per_call")
            lines.append(f"| {r['path']} | {r['median_s'] * 1e6:.1f} | {r['gb_per_s']:.0f} | "
                         f"{'-' if frac is None else f'{frac:.0%}'} | {'-' if host is None else f'{host * 1e6:.1f}'} |")
    else:
        lines.append(s["pack"]["status"] if not pack else pack.get("skipped", pack.get("error", "-")))

    lines += ["", "## Fused Adam kernel", ""]
    opt = (s.get("optimizer") or {}).get("data")
    if opt and "results" in opt:
        lines += ["One Adam step over one flat f32 shard: FusedAdam (one kernel launch) against Burn's "
                  "per-tensor Adam; kernel traffic 28 B/parameter against the device copy "
                  "(8 B/element).", "",
                  "| parameters | kernel ms | Burn Adam ms | speed-up | kernel GB/s | copy GB/s | of copy |",
                  "|---|---|---|---|---|---|---|"]
        for r in opt["results"]:
            lines.append(f"| {r['parameters']:,} | {r['fused_kernel_s'] * 1e3:.3f} | {r['burn_adam_s'] * 1e3:.3f} | "
                         f"{r['burn_adam_s'] / r['fused_kernel_s']:.1f}× | {r['kernel_gb_per_s']:.0f} | "
                         f"{r['copy_gb_per_s']:.0f} | {r['kernel_gb_per_s'] / r['copy_gb_per_s']:.0%} |")
        checks = opt.get("numerics") or []
        if checks:
            lines += ["", f"The optimizer kernels against the host pass after {checks[0]['steps']:,} steps, "
                      f"parameter and state (the kernels' multiply-adds: {opt.get('kernel_multiply_add', '-')}; "
                      "0 ulp from the fused pass expected):", "",
                      "| optimizer | elements | ulps from the fused pass | ulps from the rounded pass |",
                      "|---|---|---|---|"]
            for c in checks:
                lines.append(f"| {c['optimizer']} | {c['elements']:,} | {c['max_ulps_from_fused_host']} | "
                             f"{c['max_ulps_from_rounded_host']} |")
    else:
        o = s.get("optimizer") or {}
        lines.append(o.get("status", "not run") if not opt else opt.get("skipped", opt.get("error", "-")))

    lines += ["", "## What users train (world size 1)", ""]
    wl = (s.get("workloads") or {}).get("data")
    if wl and "workloads" in wl:
        def ms(run):
            value = (run or {}).get("median_step_s")
            return "-" if value is None else f"{value * 1e3:.1f}"

        def ratio(run, key):
            value = (run or {}).get(key)
            return f" ({value:.3f}x)" if isinstance(value, float) else ""

        lines += ["Median step (ms) of 10 timed steps, device synchronised after each; in brackets, "
                  "Zero over plain Burn on the same backend. Zero: searched chunks. Goal: " + wl["goal"] + ".", "",
                  "| workload | parameters | plain cube | Zero cube s0 | Zero cube s3 | plain Cuda | "
                  "Zero Cuda s0 | Zero Cuda s3 | FSDP2 | cube s3 / FSDP2 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for workload, runs in wl["workloads"].items():
            params = next((r.get("parameters") for r in runs.values() if r.get("parameters")), None)
            cells = []
            for side in WORKLOAD_SIDES:
                run = runs.get(side)
                cell = ms(run) + ratio(run, "ratio_to_plain")
                if run and "error" in run and "median_step_s" not in run:
                    cell = "failed"
                cells.append(cell)
            versus = (runs.get("zero-cube-3") or {}).get("ratio_to_fsdp2")
            lines.append(f"| {workload} | {'-' if params is None else f'{params:,}'} | " + " | ".join(cells)
                         + f" | {'-' if not isinstance(versus, float) else f'{versus:.3f}'} |")
        lines += ["", "What each stage-3 run paid per step (burn-zero's exact counts) and the kernel "
                      "launches of one step (cubecl's log, runs of their own, gpt2-f32 only):", "",
                  "| workload | run | collectives | syncs | engine waits | host reads | launches (plain) |",
                  "|---|---|---|---|---|---|---|"]
        for workload, runs in wl["workloads"].items():
            for backend in ("cube", "cuda"):
                run = runs.get(f"zero-{backend}-3") or {}
                c = run.get("counts_per_step")
                if not c:
                    continue
                launches = run.get("kernel_launches_per_step", "-")
                plain = (runs.get(f"plain-{backend}") or {}).get("kernel_launches_per_step", "-")
                lines.append(f"| {workload} | Zero {backend} s3 | {c['collectives']:g} | {c['syncs']:g} | "
                             f"{c.get('engine_waits', '-')} | {c['host_reads']:g} | {launches} ({plain}) |")
    else:
        entry = s.get("workloads") or {}
        lines.append(entry.get("status", "not run") if not wl else wl.get("skipped", "-"))

    lines += ["", "## GPT step time and memory (world size 1)", ""]
    st = s["steps"]["data"]
    if st and "configs" in st:
        lines += ["Median over rounds of each run's median step (device synchronised after every step). "
                  "Memory: the tracer's peaks (model data burn-zero accounts for) beside the driver's "
                  "peak for the process (nvidia-smi, everything: CUDA context, allocator pools, activations).", "",
                  "| run | backend | step (ms) | vs plain cube | vs plain Cuda | tracer sum of peaks (MB) | driver peak (MiB) |",
                  "|---|---|---|---|---|---|---|"]
        for config, r in sorted(st["configs"].items()):
            ms = r["median_step_s"] * 1e3 if r["median_step_s"] else None
            tracer = r.get("tracer_sum_of_peaks_bytes")
            lines.append(
                f"| {config} | {r['backend']} | {'-' if ms is None else f'{ms:.2f}'} | "
                f"{r.get('ratio_to_plain-cube', '-') if not isinstance(r.get('ratio_to_plain-cube'), float) else format(r['ratio_to_plain-cube'], '.3f')} | "
                f"{r.get('ratio_to_plain-cuda', '-') if not isinstance(r.get('ratio_to_plain-cuda'), float) else format(r['ratio_to_plain-cuda'], '.3f')} | "
                f"{'-' if tracer is None else f'{tracer / 1e6:.2f}'} | {r.get('driver_peak_mib') or '-'} |")
    else:
        lines.append(s["steps"]["status"] if not st else st.get("skipped", "-"))

    lines += ["", "## Collectives and synchronisations per step", ""]
    counted = {c: r for c, r in ((st or {}).get("configs") or {}).items() if r.get("counts_per_step")}
    if counted:
        lines += ["burn-zero's own counts over the timed steps of each run, divided by the steps (exact): "
                  "collectives by kind, device synchronisations, host reads; chunks as `--chunk-size` "
                  "laid them out (`param`: one parameter per chunk). Kernel launches: every launch on "
                  "the device in one step, from cubecl's execution log, in a run of its own.", "",
                  "| run | chunk size | chunks (sharded / replicated) | all-gathers | reduce-scatters | "
                  "all-reduces | other | syncs | engine waits | host reads | kernel launches |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for config, r in sorted(counted.items()):
            c, k = r["counts_per_step"], r.get("chunks") or {}
            lines.append(
                f"| {config} | {r.get('chunk_size', '-')} | {k.get('sharded', '-')} / {k.get('replicated', '-')} | "
                f"{c['all_gathers']:g} | {c['reduce_scatters']:g} | {c['all_reduces']:g} | "
                f"{c['other_collectives']:g} | {c['syncs']:g} | {c.get('engine_waits', '-')} | {c['host_reads']:g} | "
                f"{r.get('kernel_launches_per_step', '-')} |")
        plain_launches = (st["configs"].get("plain-cube") or {}).get("kernel_launches_per_step")
        if plain_launches is not None:
            lines += ["", f"Plain Burn on `CubeBackend<CudaRuntime>` with Burn's Adam, counted the "
                          f"same way: {plain_launches} kernel launches a step."]
        ratio = (st["configs"].get("zero-3-search") or {}).get("ratio_to_zero-3")
        if isinstance(ratio, float):
            lines += ["", f"Stage 3 step time, searched chunks / one parameter per chunk: {ratio:.3f}."]
    else:
        lines.append(s["steps"]["status"] if not st else st.get("skipped", "-"))

    lines += ["", "## Largest model under the device's free memory", ""]
    lg = (s.get("largest") or {}).get("data")
    if lg and "sides" in lg:
        lines += [f"The largest GPT (k blocks of width 64·k, {lg['batch']} × {lg['seq_len']} tokens a step, "
                  f"f32, 1 rank) whose step stays within {lg['budget_bytes'] / 2**20:.0f} MiB on "
                  f"{lg['adapter']}, judged by cubecl's bytes {lg['judged_by'].replace('_', ' ')}.", "",
                  "| placement | largest k | parameters | peak in use MiB | tokens/s | uploads per step | × plain Burn |",
                  "|---|---|---|---|---|---|---|"]
        plain = next((e["largest"]["parameters"] for e in lg["sides"]
                      if e["side"] == "plain-burn" and e.get("largest")), None)
        for e in lg["sides"]:
            fit = e.get("largest")
            if not fit:
                lines.append(f"| {e['side']} | none fits | - | - | - | - | - |")
                continue
            uploads = (fit.get("placement") or {}).get("uploads_per_step")
            ratio = f"{fit['parameters'] / plain:.2f}" if plain else "-"
            lines.append(f"| {e['side']} | {fit['k']} | {fit['parameters']:,} | "
                         f"{fit['peak_in_use_bytes'] / 2**20:.1f} | {fit['tokens_per_s']:.0f} | "
                         f"{'-' if uploads is None else f'{uploads:.0f}'} | {ratio} |")
    else:
        entry = s.get("largest") or {}
        lines.append(entry.get("status", "not run") if not lg else lg.get("skipped", "-"))

    lines += ["", "## PyTorch FSDP2 peer", ""]
    f = s["fsdp2"]["data"]
    if f and "median_step_s" in f:
        lines.append(f"{f['backend']} on {f['device']}: {f['parameters']} parameters, median step "
                     f"{f['median_step_s'] * 1e3:.2f} ms, loss {f['first_loss']:.3f} -> {f['last_loss']:.3f}, "
                     f"peak allocated {f.get('max_memory_allocated_bytes', 0) / 1e6:.1f} MB.")
    else:
        lines.append(s["fsdp2"]["status"] if not f else f.get("error", "-"))
    return "\n".join(lines) + "\n"


def main():
    out = sys.argv[1]
    report = build(out)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"report: {out}/report.json, {out}/report.md")


if __name__ == "__main__":
    main()
