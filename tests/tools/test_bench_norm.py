"""bench norm: a residual add and LayerNorm alone, by norm kernel (the Pallas kernels
interpreted on this CPU host, at a tiny size): both kernels and a launch setting timed,
the same value, the table and the JSON; bad arguments name the valid values."""

import argparse
import json

import pytest

from attention_jax.tools.bench import norm_speed


def _args(*extra):
    parser = argparse.ArgumentParser()
    norm_speed.add_parser(parser.add_subparsers(dest="which"))
    return parser.parse_args(["norm", "--rows", "16", "--width", "96", "--repeats", "1",
                              "--steps", "1", *extra])


def test_kernels_and_a_launch_setting_timed_with_the_same_value(tmp_path, capsys):
    out = tmp_path / "norm.json"
    result = norm_speed.run(_args("--norm-kernel", "xla,pallas", "--pallas-settings",
                                  "rows=8,program_rows=8,warps=4", "--out", str(out)))
    names = ["xla", "pallas", "pallas rows=8,program_rows=8,warps=4"]
    assert list(result["kernels"]) == names
    for name in names:
        k = result["kernels"][name]
        assert 0 < k["forward_s"] and 0 < k["forward_backward_s"]
        for what in ("value", "gradients"):
            assert k[what] == pytest.approx(result["kernels"]["xla"][what], rel=1e-5)
    assert result["array_bytes"] == 16 * 96 * 4 and result["pass_s"] > 0
    assert json.loads(out.read_text())["kernels"].keys() == set(names)
    # what the kernels ran with: the defaults (16 rows: one backward program of 16) and the
    # setting given, as given
    assert result["kernels"]["pallas"]["launch"] == {"rows": 1, "program_rows": 16, "num_warps": 1}
    assert result["kernels"][names[2]]["launch"] == {"rows": 8, "program_rows": 8, "num_warps": 4}
    assert "launch" not in result["kernels"]["xla"]
    printed = capsys.readouterr().out
    assert "| pallas rows=8,program_rows=8,warps=4 (8 rows, backward 8, 4 warps) |" in printed
    assert "| pallas (1 rows, backward 16, 1 warps) |" in printed


def test_bad_arguments_name_the_valid_values():
    for text, says in (("rows=3", "rows=3; valid: a power of two >= 1"),
                       ("lanes=4", "'lanes=4' in 'lanes=4'; valid: comma-separated rows=N, "
                                   "program_rows=N, warps=N")):
        with pytest.raises(SystemExit):
            _args("--pallas-settings", text)
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            norm_speed.settings_argument(text)
    with pytest.raises(SystemExit, match=r"--norm-kernel 'cudnn'; valid: \['auto', 'xla', 'pallas'\]"):
        norm_speed.run(_args("--norm-kernel", "cudnn"))
    with pytest.raises(SystemExit, match=r"--dtype 'int8'; valid: float32, bfloat16 or float16"):
        norm_speed.run(_args("--dtype", "int8"))
    # rows the setting's programs cannot divide would be XLA's ops in a "pallas" row
    with pytest.raises(SystemExit, match=r"'pallas rows=32,program_rows=32': the kernels cannot take \[16, 96\]: "
                                         r"16 rows per device, not a multiple of 32"):
        norm_speed.run(_args("--norm-kernel", "xla", "--pallas-settings",
                             "rows=32,program_rows=32"))
    with pytest.raises(SystemExit):  # a combination of valid values that is none
        _args("--pallas-settings", "rows=16,program_rows=8")
