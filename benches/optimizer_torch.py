#!/usr/bin/env python3
"""PyTorch's CPU Adam at the sizes of `cargo bench --bench optimizer`, printed as JSON.

The PyTorch side of burn-zero's optimizer benchmark (benches/optimizer.rs), kept beside it so
that anyone can rerun it on their own machine:

    pip install torch --index-url https://download.pytorch.org/whl/cpu
    python3 benches/optimizer_torch.py --threads 2

One flat f32 parameter of each size (the shard a rank steps) with a fixed gradient, stepped by
`torch.optim.Adam(foreach=True)` and `torch.optim.Adam(fused=True)` with Burn's defaults
(lr 1e-3, betas 0.9/0.999, eps 1e-5). Each side is created and warmed up first (the first step
allocates the moments), then the two sides alternate, `--rounds` times: one more warm-up step,
then `--steps` steps each timed on its own. The medians over every timed step, and the steps
themselves, go to stdout as JSON; nothing else is written to stdout.

The thread count is `torch.set_num_threads(--threads)` (default: the CPUs this process may
run on, as Rust's `available_parallelism` counts them); the Rust bench passes its own.
"""

import argparse
import json
import os
import statistics
import sys
import time

MODES = ("foreach", "fused")
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-5


def steps_for(n):
    """Timed steps per round, as the Rust bench chooses them: about 100M parameters a round."""
    return max(5, min(50, 100_000_000 // n))


def side(torch, mode, n):
    gen = torch.Generator().manual_seed(7)
    p = torch.empty(n, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen)
    p.requires_grad_(True)
    p.grad = torch.empty(n, dtype=torch.float32).uniform_(-1e-2, 1e-2, generator=gen)
    kwargs = {"foreach": True} if mode == "foreach" else {"fused": True}
    return torch.optim.Adam([p], lr=LR, betas=BETAS, eps=EPS, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000,50000000",
                        help="comma-separated parameter counts")
    parser.add_argument("--threads", type=int,
                        default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count())
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0,
                        help="timed steps per side and round (0: by size, as the Rust bench)")
    args = parser.parse_args()

    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: pip install torch --index-url "
              "https://download.pytorch.org/whl/cpu", file=sys.stderr)
        sys.exit(3)
    torch.set_num_threads(args.threads)

    out = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "lr": LR, "betas": BETAS, "eps": EPS,
        "sizes": [],
    }
    for n in (int(s) for s in args.sizes.split(",") if s):
        steps = args.steps or steps_for(n)
        optimizers = {mode: side(torch, mode, n) for mode in MODES}
        for opt in optimizers.values():
            for _ in range(args.warmup):
                opt.step()
        samples = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, opt in optimizers.items():
                opt.step()
                for _ in range(steps):
                    start = time.perf_counter()
                    opt.step()
                    samples[mode].append((time.perf_counter() - start) * 1e3)
        out["sizes"].append({
            "n": n,
            "steps_per_round": steps,
            **{mode: {"median_ms": statistics.median(ms), "samples_ms": ms}
               for mode, ms in samples.items()},
        })
        del optimizers
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
