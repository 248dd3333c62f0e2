"""`bench ring` machinery at tiny sizes on the 8 fake devices (no timing asserted): the
three tables come out, and what they report follows from the memory analysis."""

import argparse
import json

import pytest

from attention_jax.tools.bench import ring_speed as bench_ring


@pytest.mark.slow
def test_run_ring_writes_tables_and_json(tmp_path, capsys):
    out = tmp_path / "ring.json"
    parser = argparse.ArgumentParser()
    bench_ring.add_parser(parser.add_subparsers(dest="which"))
    args = parser.parse_args(["ring", "--sizes", "1", "4", "--length", "256",
                              "--gpt-length", "256", "--budget-mib", "9", "--min-length", "256",
                              "--max-length", "512", "--repeats", "1", "--out", str(out)])
    bench_ring._gpt_step.cache_clear()
    results = bench_ring.run(args)
    assert json.loads(out.read_text()) == results
    att, gpt = results["attention"], results["gpt"]
    assert [r["implementation"] for r in att] == ["blockwise", "ring"]
    assert [r["pairs"] for r in att] == ["-", "blockwise"]  # auto on CPU: no fused kernel
    assert all(r["seconds"] > 0 for r in att + gpt)
    assert gpt[1]["bytes"] < gpt[0]["bytes"]  # 4 devices share the sequence
    one, gspmd, ring = results["context"]
    assert (one["devices"], ring["devices"], ring["implementation"]) == (1, 4, "ring")
    assert ring["longest_T"] > one["longest_T"] > 0
    assert 0 < ring["bytes"] <= ring["budget_bytes"]
    assert "longest GPT training context within 9 MiB" in capsys.readouterr().out
    # the search starts where the gpt table's steps are: those two compile once, not twice
    assert bench_ring._gpt_step.cache_info().hits == 2


def test_lengths_the_ring_cannot_split_are_one_line_before_any_work():
    parser = argparse.ArgumentParser()
    bench_ring.add_parser(parser.add_subparsers(dest="which"))
    args = parser.parse_args(["ring", "--sizes", "1", "3", "4", "--length", "1000"])
    with pytest.raises(SystemExit, match=r"--length=1000 does not split over --sizes \[3\]; "
                                         r"valid: a multiple of 24 \(2P for every P"):
        bench_ring.run(args)  # no child started, nothing compiled
    args = parser.parse_args(["ring", "--sizes", "2", "--length", "1024", "--gpt-length", "4098"])
    with pytest.raises(SystemExit, match=r"--gpt-length=4098 does not split over --sizes \[2\]; "
                                         r"valid: a multiple of 4"):
        bench_ring.run(args)
    args = parser.parse_args(["ring", "--sizes", "2", "--min-length", "4096", "--max-length", "2048"])
    with pytest.raises(SystemExit, match=r"--min-length=4096 is past --max-length=2048; "
                                         r"valid: at most --max-length"):
        bench_ring.run(args)
    with pytest.raises(SystemExit):  # argparse: sizes are integers >= 1
        parser.parse_args(["ring", "--sizes", "0"])
