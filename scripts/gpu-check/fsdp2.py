#!/usr/bin/env python3
"""PyTorch FSDP2 peer of the GPU check: the GPT of burn-zero's step-time comparison, with the
same shape (by default GPT `small`: 4 pre-norm blocks of width 192, 6 heads, MLP 768, a tied
output head; 76 symbols, 64 positions; global batch 16; `--preset gpt2`: 12 blocks of width
768, 12 heads), trained with `torch.distributed.fsdp.fully_shard` (one unit per block) on a
world-size-1 process group, Adam at lr 1e-3, in f32 or with every parameter in bf16
(`--precision`, as burn-zero's side casts them). Step times are taken with the device
synchronised after each step, as on burn-zero's side.

    python3 fsdp2.py --out fsdp2.json                 # CUDA device 0, NCCL group
    python3 fsdp2.py --preset gpt2 --seq-len 256 --precision bf16 --out fsdp2-gpt2.json
    python3 fsdp2.py --device cpu --steps 3           # CPU, gloo group (checks the script)

Prints one JSON object and writes it to --out.
"""

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

VOCAB = 76
SEQ_LEN = 64
GLOBAL_BATCH = 16
LR = 1e-3
# (width, heads, blocks) of burn-zero-gpt's presets.
PRESETS = {"small": (192, 6, 4), "base": (384, 6, 6), "gpt2": (768, 12, 12)}


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--out")
    return parser.parse_args()


def report(result, out):
    """Prints `result` as JSON and writes it to `out` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def gpu_listed():
    """Whether the NVIDIA driver lists a GPU (what the runner's `gpu_present` asks)."""
    if shutil.which("nvidia-smi") is None:
        return False
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return any(line.startswith("GPU ") for line in listed.stdout.splitlines())


def no_cuda(reason, args):
    """Ends a `--device cuda` run that cannot use CUDA. Where the driver lists no GPU, that is
    a skip, reported as the check's other programs report one (`{"skipped": ...}`, exit 0);
    where it lists one, the peer is missing from a GPU run: a failure naming `reason`."""
    if args.device == "cuda" and not gpu_listed():
        report({"skipped": f"no CUDA device visible ({reason})"}, args.out)
        sys.exit(0)
    raise SystemExit(f"fsdp2.py: {reason}")


try:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
except ImportError as missing:
    no_cuda(f"PyTorch is not installed: {missing}", arguments())


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): Burn's pre-norm encoder layer."""

    def __init__(self, d_model, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=0.0, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x, causal):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Gpt(nn.Module):
    """Token and position embeddings, the blocks, a final norm, a head tied to the tokens."""

    def __init__(self, preset, seq_len):
        super().__init__()
        d_model, heads, layers = PRESETS[preset]
        self.tokens = nn.Embedding(VOCAB, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tokens):
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)[None]
        causal = torch.triu(
            torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1
        )
        for block in self.blocks:
            x = block(x, causal)
        return self.norm(x) @ self.tokens.weight.t()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = arguments()
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    if args.device == "cuda" and not torch.cuda.is_available():
        no_cuda("PyTorch sees no CUDA device (try --device cpu)", args)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh(device.type, (1,))
        torch.manual_seed(2024)
        model = Gpt(args.preset, args.seq_len).to(device=device, dtype=dtype)
        parameters = sum(p.numel() for p in model.parameters())
        # FSDP2: each block is a unit (its parameters gathered together), then the root.
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        generator = torch.Generator().manual_seed(2024)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def step():
            batch = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=generator)
            batch = batch.to(device)
            logits = model(batch[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        first = step().item()
        for _ in range(max(args.warmup - 1, 0)):
            step()
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = []
        for _ in range(args.steps):
            started = time.perf_counter()
            loss = step()
            sync()
            seconds.append(time.perf_counter() - started)
        result = {
            "side": "pytorch-fsdp2",
            "backend": f"PyTorch {torch.__version__} fully_shard, {device.type}",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "preset": args.preset,
            "precision": args.precision,
            "parameters": parameters,
            "global_batch": args.batch,
            "seq_len": args.seq_len,
            "world_size": 1,
            "first_loss": first,
            "uniform_loss": math.log(VOCAB),
            "last_loss": loss.item(),
            "median_step_s": statistics.median(seconds),
            "fastest_step_s": min(seconds),
            "samples_step_s": seconds,
        }
        if device.type == "cuda":
            result["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            result["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    finally:
        dist.destroy_process_group()
    report(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
