"""A PyTorch GPT-2 training step as the GPU peer of `bench train`, in a process of its own:
`python -m attention_jax.tools.bench.torch_gpt --rows '[{"shape": ..., ...}]' --out F`.

Written in nanoGPT's manner (Karpathy's model.py; described, not copied): learned
position table, pre-LayerNorm blocks, causal self-attention through
`F.scaled_dot_product_attention(is_causal=True)` (flash / cuDNN kernels on a GPU), a GELU
(tanh) MLP of width 4D, a final LayerNorm and an LM head tied to the token embedding; no
dropout. The step: `torch.compile`d model, bfloat16 autocast, float32 parameters,
`torch.optim.AdamW(fused=True)` (decay on matrices only, as nanoGPT), random tokens.

Timing as train_speed_gpu.py's (which starts this, before JAX touches the GPU): a few
warm-up steps, then `--repeats` timings of `--steps` steps queued back to back and ended
by one synchronize; the median per step. Each row of --rows: {"shape", "layers", "heads",
"width", "seq_len", "vocab", "batch"}; the out file gets one result dict per row (an
"error" key when the step failed, e.g. out of memory), written after every row. AdamW's
hyperparameters are bare_step.py's, our step's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from attention_jax.tools.bench.bare_step import BETAS, EPS, LR, WEIGHT_DECAY  # ours (no JAX)


class Block(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.mlp_out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        # [B, T, D] -> [B, N, T, H]: SDPA wants heads before time.
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """tokens [B, T] -> logits [B, T, V]."""

    def __init__(self, layers: int, heads: int, width: int, seq_len: int, vocab: int,
                 remat: bool = False):
        super().__init__()
        self.remat = remat  # recompute each block in the backward pass (activation checkpointing)
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied (Press & Wolf 2017)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            # LayerNorm weights keep their ones.
        for block in self.blocks:  # GPT-2's residual-projection scaling, 1/sqrt(2L)
            for proj in (block.attn_out, block.mlp_out):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens):
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            if self.remat and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def make_step(row: dict, device: str = "cuda", compile: bool = True, lr: float = LR,
              seed: int = 0):
    """(step() -> loss tensor, model, info) for one row; step does forward, backward and
    the AdamW update on a fixed batch of random tokens. No host sync inside step."""
    torch.manual_seed(seed)
    model = GPT(row["layers"], row["heads"], row["width"], row["seq_len"], row["vocab"],
                remat=row.get("remat", "none") != "none").to(device)
    cuda = device.startswith("cuda")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=BETAS, eps=EPS, **({"fused": True} if cuda else {}))
    def compute_loss(inputs, targets):  # model and loss compiled together, as nanoGPT's forward
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    loss_fn = torch.compile(compute_loss) if compile else compute_loss
    tokens = torch.randint(0, row["vocab"], (row["batch"], row["seq_len"] + 1), device=device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        # bfloat16 compute on the GPU; float32 on the CPU (tests).
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    info = {"params": sum(p.numel() for p in model.parameters()),  # tied weight counted once
            "compiled": compile}
    return step, model, info


def error_line(e: BaseException) -> str:
    """The exception's type and first line, short enough for a table cell."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(row: dict, device: str = "cuda", compile: bool = True, warmup: int = 3,
            repeats: int = 5, steps: int = 10) -> dict:
    """One row's result: median seconds per step over `repeats` timings of `steps` queued
    steps, after `warmup` steps (the first compiles)."""
    result = {**row, "side": "torch", "impl": "sdpa" + (" + compile" if compile else "")}
    try:
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step, _, info = make_step(row, device, compile)
        result.update(info)
        loss = None
        for _ in range(max(1, warmup)):
            loss = step()
        result["first_loss"] = float(loss)  # synchronises
        result["warmup_s"] = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                loss = step()
            _sync(device)
            times.append((time.perf_counter() - start) / steps)
        result.update(times=times, step_s=statistics.median(times), loss=float(loss))
        if device.startswith("cuda"):
            result["peak_bytes"] = torch.cuda.max_memory_allocated()
    except Exception as e:  # out of memory, a compile failure: a result, not a crash
        result["error"] = error_line(e)
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", required=True, help="JSON list of row dicts (see the docstring)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for tests")
    parser.add_argument("--no-compile", action="store_true", help="eager (tests on the CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("torch has no CUDA device", file=sys.stderr)
            raise SystemExit(3)
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT; bf16 autocast does the matmuls
        torch.backends.cudnn.allow_tf32 = True
    results = []
    for row in json.loads(args.rows):
        r = measure(row, args.device, not args.no_compile, args.warmup, args.repeats, args.steps)
        if args.device.startswith("cuda"):
            r["device"] = torch.cuda.get_device_name()
        r["torch"] = torch.__version__
        results.append(r)
        said = r["error"] if "error" in r else "%.1f ms/step" % (1e3 * r["step_s"])
        print(f"  torch {row['shape']} b{row['batch']}: {said}", file=sys.stderr, flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
