#!/usr/bin/env python3
"""PyTorch FSDP2 peer of the GPU check: the GPT of burn-zero's step-time comparison, with the
same shape (GPT `small`: 4 pre-norm blocks of width 192, 6 heads, MLP 768, a tied output head;
76 symbols, 64 positions; global batch 16), trained with `torch.distributed.fsdp.fully_shard`
on a world-size-1 process group, Adam at lr 1e-3. Step times are taken with the device
synchronised after each step, as on burn-zero's side.

    python3 fsdp2.py --out fsdp2.json                 # CUDA device 0, NCCL group
    python3 fsdp2.py --device cpu --steps 3           # CPU, gloo group (checks the script)

Prints one JSON object and writes it to --out.
"""

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VOCAB = 76
SEQ_LEN = 64
GLOBAL_BATCH = 16
D_MODEL = 192
HEADS = 6
LAYERS = 4
D_FF = 4 * D_MODEL
LR = 1e-3


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): Burn's pre-norm encoder layer."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, HEADS, dropout=0.0, batch_first=True)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.fc1 = nn.Linear(D_MODEL, D_FF)
        self.fc2 = nn.Linear(D_FF, D_MODEL)

    def forward(self, x, causal):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Gpt(nn.Module):
    """Token and position embeddings, the blocks, a final norm, a head tied to the tokens."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Embedding(SEQ_LEN, D_MODEL)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fsdp2.py: no CUDA device visible to PyTorch (try --device cpu)")
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
        model = Gpt().to(device)
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
            batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
            batch = batch.to(device)
            logits = model(batch[:, :-1])
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
            "parameters": parameters,
            "global_batch": GLOBAL_BATCH,
            "seq_len": SEQ_LEN,
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
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
