"""`bench train` machinery on a tiny model for a couple of steps (no timing asserted):
the table and JSON come out, FLOPs follow the stated formula, peers match our sizes."""

import argparse
import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from attention_jax.models import flops
from attention_jax.tools.bench import __main__ as bench_cli
from attention_jax.tools.bench import train_speed


def test_model_flops_formula():
    shape = train_speed.SHAPES["gpt-cpu"]
    # 6·N + 12·L·T·D per token, B·T tokens.
    n = 1000
    assert flops.flops_per_token(n, 4, 64, 128) == 6 * n + 12 * 4 * 64 * 128
    row = train_speed.finish_row({}, [0.5], shape, n, rate=1e9)
    assert row["model_flops_per_step"] == 12 * 64 * (6 * n + 12 * 4 * 64 * 128)
    assert row["mfu"] == pytest.approx(row["model_flops_per_step"] / 0.5 / 1e9)
    vit = train_speed.SHAPES["vit-digits"]
    assert vit.tokens == 17 and vit.units_per_step() == vit.batch  # 16 patches + [CLS]


def test_run_train_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "train.json"
    parser = argparse.ArgumentParser()
    train_speed.add_parser(parser.add_subparsers(dest="which"))
    args = parser.parse_args(["train", "--models", "gpt-test", "--warmup", "1", "--repeats", "2",
                              "--matmul-repeats", "1", "--settle", "0", "--out", str(out)])
    rows = train_speed.run(args)
    sides = {r["side"] for r in rows}
    assert "jax" in sides and (sides == {"jax"} or sides == {"jax", "torch"})
    for r in rows:
        assert len(r["times"]) == 2 and r["step_s"] > 0 and np.isfinite(r["loss"])
        assert 0 < r["mfu"] and r["units_per_s"] == pytest.approx(2 * 16 / r["step_s"])
    printed = capsys.readouterr().out
    assert "| gpt-test | jax |" in printed and "float32 matmul rate" in printed
    saved = json.loads(out.read_text())
    assert saved["rows"][0]["model"] == "gpt-test" and saved["matmul_flops_per_s"] > 0


def test_bench_cli_registers_train(monkeypatch):
    seen = {}
    monkeypatch.setattr(train_speed, "run", lambda args: seen.setdefault("args", args))
    bench_cli.main(["train", "--models", "gpt-test", "--no-torch"])
    assert seen["args"].models == ["gpt-test"] and seen["args"].no_torch


@pytest.mark.parametrize("name", ["gpt-cpu", "vit-digits"])
def test_torch_peer_has_our_parameter_count(name):
    pytest.importorskip("transformers")
    shape = train_speed.SHAPES[name]
    model, _, args = train_speed.build_ours(shape)
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), *args)["params"]))
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert sum(p.numel() for p in train_speed.build_torch(shape).parameters()) == ours
