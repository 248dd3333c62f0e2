"""The bench command's arguments, checked before anything is measured: each mistake one
line naming the option (they ended in tracebacks from statistics, numpy or the OS, or
after a ten-minute run, or in the out-of-memory killer)."""

import argparse
import os
import subprocess
import sys

import pytest

from attention_jax.tools.bench import __main__ as bench_main
from attention_jax.tools.bench import data_speed, multihost_speed, train_speed, train_speed_gpu


@pytest.mark.parametrize("argv, says", [
    (["train", "--models", "gpt-cpu", "--repeats", "-2"], "--repeats=-2; valid: >= 1"),
    (["train", "--models", "gpt-cpu", "--warmup", "-1"], "--warmup=-1; valid: >= 0"),
    (["checkpoint", "--layers", "0"], "--layers=0; valid: >= 1"),
    (["data", "--batches", "0"], "--batches=0; valid: >= 1"),
    (["images", "--images", "0"], "--images=0; valid: >= 1"),
    (["profile", "--steps", "0"], "--steps=0; valid: >= 1"),
    (["multihost", "--repeats", "0"], "--repeats=0; valid: >= 1"),
    # An option of --save runs without --save was ignored unsaid.
    (["profile", "--pinned-host", "off"], "--pinned-host is for runs with --save; add --save"),
])
def test_numbers_below_their_least_value_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_an_output_path_that_cannot_be_written_is_found_first(tmp_path, capsys):
    for argv in (["attention", "--sizes", "128", "--out", str(tmp_path)],
                 ["checkpoint", "--json", str(tmp_path)], ["data", "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            bench_main.main(argv)
        assert e.value.code == 2 and f"={tmp_path} is a folder" in capsys.readouterr().err
    # The tools whose --out is a folder: a file there failed after the profile's windows
    # (FileExistsError; with --save orbax's "is not a directory" after the saves).
    (tmp_path / "f").write_text("x")
    for argv, says in ((["profile", "--out", str(tmp_path / "f")],
                        f"--out={tmp_path / 'f'} is a file; valid: a folder (made if absent)"),
                       (["gpu-hlo", "--out", str(tmp_path / "f" / "hlo")],
                        f"--out={tmp_path / 'f' / 'hlo'}: the folder cannot be made")):
        with pytest.raises(SystemExit) as e:
            bench_main.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_what_only_a_run_knows_is_refused_before_it_runs():
    with pytest.raises(SystemExit, match=r"--sizes='3,2'; valid: increasing sizes in MB"):
        data_speed._sizes("3,2")
    with pytest.raises(SystemExit, match=r"--sizes='abc'"):
        data_speed._sizes("abc")
    args = argparse.Namespace(steps=5, log_every=10, repeats=1, json="")
    with pytest.raises(SystemExit, match=r"--steps=5 with --log_every=10: .* valid: --steps >= "
                                         r"2 × --log_every = 20"):
        multihost_speed.run(args)
    # --device gpu where JAX has no GPU: it ran GPT-2's rows on the CPU until the kernel's
    # out-of-memory killer stopped it.
    parser = argparse.ArgumentParser()
    train_speed.add_parser(parser.add_subparsers(dest="which"))
    args = parser.parse_args(["train", "--device", "gpu", "--quick"])
    with pytest.raises(SystemExit, match=r"--device gpu: JAX's backend here is 'cpu' \(cpu\); "
                                         r"valid: --device cpu or auto"):
        train_speed_gpu.run(args, info={"backend": "cpu", "device": "cpu"})


def test_gpu_only_options_given_to_a_cpu_run_are_named(capsys):
    """`bench attention --width 768` and `bench train --shapes gpt2-124m` on a CPU ran
    the CPU table as if they had not been given."""
    import argparse as ap

    from attention_jax.tools.bench.timing import say_ignored_on_cpu
    parser = ap.ArgumentParser()
    sub = parser.add_subparsers(dest="which")
    train_speed.add_parser(sub)
    args = parser.parse_args(["train", "--shapes", "gpt2-124m", "--quick"])
    given = bench_main.gpu_only_given(sub.choices["train"], args)
    assert sorted(given) == ["--quick", "--shapes"]
    say_ignored_on_cpu(ap.Namespace(gpu_only_given=["--quick", "--shapes"]))
    assert capsys.readouterr().err == ("note: --quick, --shapes are for a GPU run; this one "
                                       "runs on the CPU and ignores them\n")
    assert bench_main.gpu_only_given(sub.choices["train"], parser.parse_args(["train"])) == []


def test_bench_images_reads_its_images_before_removing_them(tmp_path):
    """The read-ahead threads were still reading when the bench removed its temporary
    JPEGs, and each read warned that an image 'cannot be decoded'. The folder now goes
    at exit, after those threads end; it is gone afterwards all the same."""
    run = subprocess.run(
        [sys.executable, "-m", "attention_jax.tools.bench", "images", "--images", "16",
         "--size", "40", "30", "--image-size", "16", "--batch", "4", "--workers", "0",
         "--warmup", "1", "--batches", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert "| 0 |" in run.stdout and "cannot be decoded" not in run.stderr, run.stderr
    assert not list(tmp_path.glob("bench_images_*"))
