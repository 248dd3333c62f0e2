"""bench checkpoint on a tiny GPT-2-shaped state: every figure it reports comes from real
saves and restores through the Checkpointer (no timing asserted)."""

import argparse
import json

import pytest

from attention_jax.tools.bench import checkpoint_speed


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    checkpoint_speed.add_parser(parser.add_subparsers(dest="which"))
    return parser.parse_args(["checkpoint", "--layers", "1", "--width", "48", "--vocab", "300",
                              "--repeats", "1", "--dir", str(tmp_path / "ck"), *extra])


@pytest.mark.parametrize("compression,packed", [("on", "on"), ("off", "off")])
def test_the_checkpoint_bench_saves_restores_and_reports(tmp_path, compression, packed):
    out = checkpoint_speed.run(_args(tmp_path, "--compression", compression, "--packed", packed,
                                     "--json", str(tmp_path / "out.json")))
    # the state: parameters, and AdamW's two moments beside them, float32
    assert out["state_values"] > 3 * out["params"] and out["state_bytes"] >= 4 * out["state_values"]
    for key in ("save_s", "save_blocking_s", "save_cpu_s", "restore_s", "snapshot_s"):
        assert out[key] > 0, key
    assert out["compression"] == compression and out["packed"] == packed
    # packed: the step holds the layout of the state's flat arrays
    assert (tmp_path / "ck" / "with" / "2" / "layout").is_dir() == (packed == "on")
    assert json.loads((tmp_path / "out.json").read_text())["params"] == out["params"]
    # every repeat saved a new step; two are kept
    assert sorted(int(p.name) for p in (tmp_path / "ck" / "with").iterdir()
                  if p.name.isdigit()) == [1, 2]


def test_a_width_the_heads_do_not_divide_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--width 50 --vocab 300; valid: a width that is a "
                                         r"multiple of GPT-2's 12 heads"):
        checkpoint_speed.run(_args(tmp_path, "--width", "50"))
