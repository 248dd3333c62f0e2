r"""Training throughput against PyTorch peers: `python -m attention_jax.tools.bench train`.

On a GPU (JAX's backend, asked in a child process; or `--device gpu`) `run` hands over
to train_speed_gpu.py: GPT-2 124M and medium at T = 1024 in bfloat16 against a PyTorch
GPT-2 of this project (torch_gpt.py, torch.compile), MFU against the H100's peak and a
measured bf16 matmul. Everything below is the CPU mode.

For each model shape below, one training step (forward, backward, AdamW update) is
timed on our side and on a PyTorch peer of the same architecture, sizes and batch:

  gpt-cpu    GPT, nanoGPT's CPU recipe: 4 layers, 4 heads, width 128, context 64, batch 12
  gpt-baby   GPT, nanoGPT's "baby" shape: 6 layers, 6 heads, width 384, context 256, batch 16
  bert-mini  BERT-base-shaped tiny (Turc et al. 2019's "mini": 4 layers × 256, 4 heads of
             64, F = 4D, post-norm): masked LM, sequence 128, batch 32
  vit-digits ViT on 8×8 digits as configs/vit.py trains it (vit-tiny/2: 16 patches +
             [CLS], width 32, 2 layers), batch 32

Ours: bare_step.py's step, `jax.jit` of value_and_grad of the model's loss plus
`optax.adamw`, on the model modules directly (the trainer adds only data loading and
logging around this), with the state donated. The peer: `transformers`' GPT2LMHeadModel,
BertForMaskedLM and ViTForImageClassification, randomly initialised from a config, eager
mode, default attention implementation, `torch.optim.AdamW`,
`torch.set_num_threads(os.cpu_count())` so both sides use the same cores. Dropout is 0
on both sides; batches are synthetic (random tokens / images, the same arrays every
step: throughput only).

Timing: each side runs in a process of its own (a fresh Python that imports only what
that side needs): a few untimed warm-up steps (ours includes compilation), then
individually timed steps, each ended by waiting for the loss. The two sides take turns,
two processes each with a pause before each, and the report gives the median over both.
Separate processes because the two runtimes' worker threads spin after their work is
done: in one process, each side's step is slower right after the other's (README, Measurements behind the code).

Model FLOPs per token: 6·N + 12·L·T·D (PaLM's convention; models/flops.py, whose
docstring explains the terms, as the trainer counts them), N counted from our model's
parameters (all but the position and token-type tables: flops.matmul_params). A ViT
image is T = patches (+1) tokens. BERT's MLM head: our loss, like the trainer's,
projects only the ~15% predicted positions onto the vocabulary while BertForMaskedLM
projects all of them; the FLOP count uses the full-model formula for both, so it
slightly flatters neither. Model FLOPs utilisation (MFU) = model FLOP/s ÷ this machine's
float32 matmul rate through XLA (timing.matmul_rate, a 2048² matmul): the share of what
the cores can do that reaches the model's own arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.models import flops
from attention_jax.tools.bench import bare_step, train_speed_gpu
from attention_jax.tools.bench.bare_step import BETAS, EPS, LR, WEIGHT_DECAY
from attention_jax.tools.bench.timing import (installed, matmul_rate, say_ignored_on_cpu,
                                             wall_times)

MASK_RATE = 0.15


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmarked model: family, sizes, batch (both sides build it from this)."""
    name: str
    family: str  # gpt | bert | vit
    layers: int
    width: int  # D
    heads: int
    batch: int
    seq_len: int = 0  # T for text models
    vocab: int = 0
    mlp: int = 0  # F; 0 means 4D
    image_size: int = 0
    patch_size: int = 0
    channels: int = 0
    classes: int = 0

    @property
    def mlp_dim(self) -> int:
        return self.mlp or 4 * self.width

    @property
    def tokens(self) -> int:
        """Sequence length the attention sees (ViT: patches + [CLS])."""
        if self.family == "vit":
            return (self.image_size // self.patch_size) ** 2 + 1
        return self.seq_len

    @property
    def unit(self) -> str:
        return "images" if self.family == "vit" else "tokens"

    def units_per_step(self) -> int:
        return self.batch if self.family == "vit" else self.batch * self.seq_len


# nanoGPT's char-level Shakespeare vocabulary is 65 characters; both GPT shapes use it.
SHAPES = {
    "gpt-cpu": Shape("gpt-cpu", "gpt", layers=4, width=128, heads=4, batch=12, seq_len=64, vocab=65),
    "gpt-baby": Shape("gpt-baby", "gpt", layers=6, width=384, heads=6, batch=16, seq_len=256,
                      vocab=65),
    "bert-mini": Shape("bert-mini", "bert", layers=4, width=256, heads=4, batch=32, seq_len=128,
                       vocab=1024),
    "vit-digits": Shape("vit-digits", "vit", layers=2, width=32, heads=2, batch=32, mlp=64,
                        image_size=8, patch_size=2, channels=1, classes=10),
}
# A shape small enough for the test suite (compiles in seconds).
SHAPES_TINY = {"gpt-test": Shape("gpt-test", "gpt", layers=1, width=32, heads=2, batch=2,
                                 seq_len=16, vocab=65)}


def synthetic_batch(shape: Shape, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs and targets as numpy (each side converts): the same for both."""
    rng = np.random.default_rng(seed)
    b, t = shape.batch, shape.seq_len
    if shape.family == "vit":
        return {"image": rng.normal(size=(b, shape.image_size, shape.image_size, shape.channels))
                .astype(np.float32), "label": rng.integers(0, shape.classes, b).astype(np.int32)}
    tokens = rng.integers(4, shape.vocab, (b, t + 1)).astype(np.int32)
    if shape.family == "gpt":
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    # Masked LM: the same number of predicted positions in every row (top_k needs a fixed M).
    m = max(1, round(MASK_RATE * t))
    positions = np.sort(np.stack([rng.choice(t, m, replace=False) for _ in range(b)]), axis=1)
    inputs = tokens[:, :t].copy()
    targets = np.take_along_axis(inputs, positions, axis=1)
    np.put_along_axis(inputs, positions, 3, axis=1)  # id 3 stands for [MASK]
    return {"inputs": inputs, "positions": positions.astype(np.int32), "targets": targets}


def measure_side(name: str, side: str, implementation: str, warmup: int, repeats: int) -> dict:
    """One side of shape `name` in this process: `warmup` untimed steps, then `repeats`
    timed ones. Returns the side's info (params, loss, ...) with "times" in seconds."""
    shape = {**SHAPES, **SHAPES_TINY}[name]
    step, info = prepare_ours(shape, implementation) if side == "jax" else prepare_torch(shape)
    for _ in range(warmup):
        step()
    return {**info, "times": wall_times(step, repeats)}


def measure_in_subprocess(name: str, side: str, implementation: str, warmup: int,
                          repeats: int) -> dict:
    """`measure_side` in a fresh Python process (see the module docstring: why)."""
    cmd = [sys.executable, "-m", "attention_jax.tools.bench.train_speed", name, side,
           implementation, str(warmup), str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"timing {name} ({side}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_in_turns(name: str, sides: list[str], implementation: str, warmup: int, repeats: int,
                  rounds: int = 2, settle_s: float = 2.0) -> dict[str, dict]:
    """Each side's info and `repeats` step times, taken in `rounds` processes per side
    that alternate between the sides (load from other jobs falls on both alike), each
    after a `settle_s` pause."""
    per_round = [repeats // rounds + (i < repeats % rounds) for i in range(rounds)]
    results: dict[str, dict] = {}
    for count in per_round:
        for side in sides:
            time.sleep(settle_s)
            r = measure_in_subprocess(name, side, implementation, warmup, count)
            r["times"] = results.get(side, {}).get("times", []) + r["times"]
            results[side] = r
    return results


# ======================================================================================= ours
def build_ours(shape: Shape, implementation: str = "blockwise"):
    """(model, loss(params, batch) -> scalar, init input) for our model of `shape`."""
    from attention_jax.models import bert, gpt, losses, vit
    if shape.family == "gpt":
        cfg = gpt.GPTConfig(vocab_size=shape.vocab, max_len=shape.seq_len, num_layers=shape.layers,
                            d_model=shape.width, num_heads=shape.heads, mlp_dim=shape.mlp_dim,
                            implementation=implementation)
        model = gpt.GPT(cfg)

        def loss(params, batch):
            logits, _ = model.apply({"params": params}, batch["inputs"])
            return losses.cross_entropy(logits, batch["targets"])[0]

        return model, loss, (jnp.zeros((1, shape.seq_len), jnp.int32),)
    if shape.family == "bert":
        cfg = bert.BertConfig(vocab_size=shape.vocab, d_model=shape.width, num_layers=shape.layers,
                              num_heads=shape.heads, mlp_dim=shape.mlp_dim,
                              max_len=shape.seq_len, dropout_rate=0.0,
                              attention_dropout_rate=0.0, implementation=implementation)
        model = bert.Bert(cfg)

        def loss(params, batch):
            out, _ = model.apply({"params": params}, batch["inputs"],
                                 masked_positions=batch["positions"])
            return losses.cross_entropy(out["mlm_logits"], batch["targets"])[0]

        return model, loss, (jnp.zeros((1, shape.seq_len), jnp.int32),)
    cfg = vit.ViTConfig(image_size=shape.image_size, patch_size=shape.patch_size,
                        num_channels=shape.channels, d_model=shape.width, num_layers=shape.layers,
                        num_heads=shape.heads, mlp_dim=shape.mlp_dim, num_classes=shape.classes,
                        implementation=implementation)
    model = vit.ViT(cfg)

    def loss(params, batch):
        logits, _ = model.apply({"params": params}, batch["image"])
        return losses.cross_entropy(logits, batch["label"])[0]

    return model, loss, (jnp.zeros((1, shape.image_size, shape.image_size, shape.channels)),)


def prepare_ours(shape: Shape, implementation: str = "blockwise"):
    """(step(), info): the bare step (bare_step.make_train_step) of our model on a fixed
    synthetic batch."""
    import flax.linen as nn
    model, loss_fn, init_args = build_ours(shape, implementation)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), *init_args)["params"])
    tx = bare_step.adamw()
    step_fn = bare_step.make_train_step(loss_fn, tx)
    batch = jax.tree.map(jnp.asarray, synthetic_batch(shape))
    info = {"side": "jax", "impl": implementation,
            "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
            "matmul_params": flops.matmul_params(params)}
    box = {"state": (params, tx.init(params))}

    def step():
        box["state"], loss = step_fn(box["state"], batch)
        info["loss"] = float(loss)  # waits for the step

    return step, info


# ======================================================================================= peer
def build_torch(shape: Shape):
    """The transformers model of `shape`, random init, dropout 0, eager (no compile)."""
    import transformers as tf
    if shape.family == "gpt":
        cfg = tf.GPT2Config(vocab_size=shape.vocab, n_positions=shape.seq_len, n_embd=shape.width,
                            n_layer=shape.layers, n_head=shape.heads, n_inner=shape.mlp_dim,
                            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                            bos_token_id=0, eos_token_id=0)  # GPT-2's 50256 is past this vocab
        return tf.GPT2LMHeadModel(cfg)
    if shape.family == "bert":
        cfg = tf.BertConfig(vocab_size=shape.vocab, hidden_size=shape.width,
                            num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                            intermediate_size=shape.mlp_dim, max_position_embeddings=shape.seq_len,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(cfg)
    cfg = tf.ViTConfig(image_size=shape.image_size, patch_size=shape.patch_size,
                       num_channels=shape.channels, hidden_size=shape.width,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       intermediate_size=shape.mlp_dim, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=shape.classes)
    return tf.ViTForImageClassification(cfg)


def prepare_torch(shape: Shape):
    """(step(), info): one eager training step of the transformers peer."""
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = build_torch(shape).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    b = synthetic_batch(shape)
    if shape.family == "vit":
        # transformers' ViT takes channels-first pixels.
        kwargs = {"pixel_values": torch.from_numpy(b["image"]).permute(0, 3, 1, 2).contiguous(),
                  "labels": torch.from_numpy(b["label"]).long()}
    elif shape.family == "gpt":
        # GPT2LMHeadModel shifts the labels itself: labels = the input window.
        inputs = torch.from_numpy(b["inputs"]).long()
        kwargs = {"input_ids": inputs, "labels": inputs}
    else:
        labels = torch.full(b["inputs"].shape, -100, dtype=torch.long)  # -100: not predicted
        labels.scatter_(1, torch.from_numpy(b["positions"]).long(),
                        torch.from_numpy(b["targets"]).long())
        kwargs = {"input_ids": torch.from_numpy(b["inputs"]).long(), "labels": labels}
    info = {"side": "torch", "impl": getattr(model.config, "_attn_implementation", "eager"),
            "params": sum(p.numel() for p in model.parameters())}

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(**kwargs).loss
        loss.backward()
        opt.step()
        info["loss"] = loss.item()

    return step, info


# ===================================================================================== report
def finish_row(row: dict, times: list[float], shape: Shape, matmul_params: int,
               rate: float) -> dict:
    """Median step time, steps/s, units/s, model FLOP/s and MFU (the same FLOP count for
    both sides)."""
    per_step = shape.batch * shape.tokens * flops.flops_per_token(
        matmul_params, shape.layers, shape.tokens, shape.width)
    row.update(times=times, step_s=statistics.median(times))
    row.update(model=shape.name, unit=shape.unit, batch=shape.batch, seq=shape.tokens,
               steps_per_s=1.0 / row["step_s"],
               units_per_s=shape.units_per_step() / row["step_s"],
               model_flops_per_step=per_step, model_flops_per_s=per_step / row["step_s"],
               mfu=per_step / row["step_s"] / rate)
    return row


def train_table(rows: list[dict], rate: float) -> str:
    """Markdown table. Besides the median, the best step: on a shared machine it is the
    closer estimate of what each side does undisturbed."""
    lines = ["| model | side | attention | params | batch × T | step ms median / best | steps/s "
             "| units/s | model GFLOP/s | MFU | jax/torch throughput median / best |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_model = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["side"]] = r
    for r in rows:
        peer = by_model[r["model"]].get("torch")
        ratio = (f"{peer['step_s'] / r['step_s']:.2f}× / {min(peer['times']) / min(r['times']):.2f}×"
                 if r["side"] == "jax" and peer else "")
        lines.append(
            f"| {r['model']} | {r['side']} | {r['impl']} | {r['params'] / 1e6:.2f}M | "
            f"{r['batch']} × {r['seq']} | {r['step_s'] * 1e3:.1f} / {min(r['times']) * 1e3:.1f} | "
            f"{r['steps_per_s']:.2f} | {r['units_per_s']:,.0f} {r['unit']}/s | "
            f"{r['model_flops_per_s'] / 1e9:.1f} | {100 * r['mfu']:.0f}% | {ratio} |")
    lines += ["", f"float32 matmul rate (XLA, 2048²): {rate / 1e9:.0f} GFLOP/s; "
                  f"{os.cpu_count()} CPU threads; JAX {jax.__version__}"]
    return "\n".join(lines)


def run(args) -> list[dict]:
    """`bench train`: both sides for each chosen shape; prints the table, writes JSON.
    On a GPU (asked in a child process, so this one never touches it) train_speed_gpu.run."""
    device = getattr(args, "device", "cpu")
    if device != "cpu":
        info = train_speed_gpu.gpu_available() if device == "auto" else None
        if device == "gpu" or info:
            args.repeats = args.repeats or train_speed_gpu.GPU_REPEATS
            args.implementation = args.implementation or "auto"
            return train_speed_gpu.run(args, info)
    say_ignored_on_cpu(args)
    args.repeats = args.repeats or 10
    args.implementation = args.implementation or "blockwise"
    cpu_kinds = ("reference", "blockwise", "xla")
    if args.implementation not in cpu_kinds:  # (checked before the children time anything)
        raise SystemExit(f"error: --implementation {args.implementation!r} on a CPU; valid: "
                         f"one of {list(cpu_kinds)} (cudnn, pallas and auto with --device gpu)")
    table = {**SHAPES, **SHAPES_TINY}
    names = args.models or list(SHAPES)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"error: --models {unknown} unknown; valid: {sorted(table)}")
    peers = installed("torch", "transformers") and not args.no_torch
    # The machine's rate is the best of a measurement before and after: on a shared
    # machine a single one may catch another job and flatter every MFU.
    rate_before = matmul_rate(repeats=args.matmul_repeats)
    print(f"backend {jax.default_backend()}, {os.cpu_count()} CPU threads, matmul "
          f"{rate_before / 1e9:.0f} GFLOP/s, torch peer: {'yes' if peers else 'no'}",
          file=sys.stderr)
    measured = []  # (shape, info, times): rows once the matmul rate is known
    for name in names:
        sides = ["jax", "torch"] if peers else ["jax"]
        results = time_in_turns(name, sides, args.implementation, args.warmup, args.repeats,
                                settle_s=args.settle)
        for side in sides:
            info = results[side]
            times = info.pop("times")
            measured.append((table[name], info, times, results["jax"]["matmul_params"]))
            print(f"  {name} {side}: {statistics.median(times) * 1e3:.1f} ms/step",
                  file=sys.stderr)
    rate = max(rate_before, matmul_rate(repeats=args.matmul_repeats))
    # Both sides count model FLOPs from our parameter count (the peers' differ by BERT's
    # unused pooler/NSP head at most).
    rows = [finish_row(info, times, shape, matmul_params, rate)
            for shape, info, times, matmul_params in measured]
    print(train_table(rows, rate))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"matmul_flops_per_s": rate, "threads": os.cpu_count(),
                               "shapes": {n: dataclasses.asdict(table[n]) for n in names},
                               "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return rows


def add_parser(sub) -> None:
    """Registers `train` on the bench command's subcommand parser."""
    p = sub.add_parser("train", help="training steps/s, tokens/s and MFU against PyTorch peers")
    p.add_argument("--models", nargs="+", help=f"shapes to run (default: all of {list(SHAPES)})")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (ours compiles)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed steps (median reported; default 10); on a GPU, timings of "
                        f"--steps steps each (default {train_speed_gpu.GPU_REPEATS})")
    p.add_argument("--implementation", default=None,
                   help="our attention backend (reference | blockwise | xla; default blockwise); "
                        "on a GPU also cudnn | pallas | auto (the default there), or a "
                        "comma-separated list of them")
    p.add_argument("--matmul-repeats", type=int, default=10, help="timed 2048² matmuls")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds of pause before each block of timed steps")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peers")
    p.add_argument("--out", default="bench_results/train.json", help="JSON output path")
    train_speed_gpu.add_arguments(p)


if __name__ == "__main__":  # one side's timing, run by measure_in_subprocess
    _name, _side, _implementation, _warmup, _repeats = sys.argv[1:]
    print(json.dumps(measure_side(_name, _side, _implementation, int(_warmup), int(_repeats))))
