"""bench loss: the LM head's loss alone, by loss kernel (the Pallas kernels interpreted
on this CPU host, at a tiny size): both kernels timed, the same loss, the table and the
JSON; bad arguments name the valid values."""

import argparse
import json

import pytest

from attention_jax.tools.bench import loss_speed


def _args(*extra):
    parser = argparse.ArgumentParser()
    loss_speed.add_parser(parser.add_subparsers(dest="which"))
    return parser.parse_args(["loss", "--rows", "16", "--width", "8", "--vocab", "37",
                              "--repeats", "1", "--steps", "1", *extra])


def test_both_kernels_timed_with_the_same_loss(tmp_path, capsys):
    out = tmp_path / "loss.json"
    result = loss_speed.run(_args("--loss-kernel", "xla,pallas", "--out", str(out)))
    xla, pallas = result["kernels"]["xla"], result["kernels"]["pallas"]
    assert pallas["loss"] == pytest.approx(xla["loss"], rel=1e-6)
    for k in (xla, pallas):
        assert 0 < k["forward_s"] and 0 < k["forward_backward_s"]
    assert result["logits_bytes"] == 16 * 37 * 4 and result["dtype"] == "float32"
    assert result["pass_s"] > 0
    assert json.loads(out.read_text())["kernels"].keys() == {"xla", "pallas"}
    printed = capsys.readouterr().out
    assert "| pallas |" in printed and "pallas / xla: forward" in printed


def test_a_row_per_launch_setting_of_the_kernels(capsys):
    result = loss_speed.run(_args("--loss-kernel", "xla", "--pallas-settings",
                                  "chunk=16,warps=4", "chunk=32"))
    assert list(result["kernels"]) == ["xla", "pallas chunk=16,warps=4", "pallas chunk=32"]
    for name in ("pallas chunk=16,warps=4", "pallas chunk=32"):
        assert result["kernels"][name]["loss"] == pytest.approx(result["kernels"]["xla"]["loss"],
                                                                rel=1e-6)
    assert "| pallas chunk=32 |" in capsys.readouterr().out
    for text, says in (("chunk=48", "chunk=48; valid: a power of two >= 16"),
                       ("lanes=4", "'lanes=4' in 'lanes=4'; valid: comma-separated chunk=N, "
                                   "warps=N, stages=N"), ("warps=0", "num_warps=0; valid")):
        with pytest.raises(SystemExit):
            _args("--pallas-settings", text)
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            loss_speed.settings_argument(text)


def test_cpu_default_is_xla_alone(capsys):
    result = loss_speed.run(_args())
    assert list(result["kernels"]) == ["xla"]
    assert "pallas / xla" not in capsys.readouterr().out


def test_bad_arguments_name_the_valid_values():
    with pytest.raises(SystemExit, match=r"--rows 0; valid: an integer >= 1"):
        loss_speed.run(_args("--rows", "0"))
    with pytest.raises(SystemExit, match=r"--loss-kernel 'triton'; valid: \['auto', 'xla', 'pallas'\]"):
        loss_speed.run(_args("--loss-kernel", "triton"))
    with pytest.raises(SystemExit, match=r"--dtype 'float77'; valid: float32, bfloat16 or float16"):
        loss_speed.run(_args("--dtype", "float77"))


@pytest.mark.parametrize("argv,message", [
    (["attention", "--sizes", "0"], "argument --sizes: '0'; valid: an integer >= 1"),
    (["attention", "--repeats", "-1"], "argument --repeats: '-1'; valid: an integer >= 1"),
    (["attention", "--memory-fraction", "2"],
     "argument --memory-fraction: '2'; valid: a number in (0, 1]"),
    (["train", "--implementation", "flash"],
     "--implementation 'flash' on a CPU; valid: one of ['reference', 'blockwise', 'xla']"),
])
def test_the_bench_command_names_a_bad_argument(argv, message, capsys):
    """They were tracebacks (an empty median, a reshape to -5, a model config's error)."""
    from attention_jax.tools.bench.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert message in capsys.readouterr().err + str(e.value.code)
