"""The GPU plan's commands (docs/gpu_*.sh, docs/gpu_next.md) against today's code: a GPU
session has 15 minutes, and an option renamed or a test moved since the plan was written
would cost a call. Every `bench` command in them parses with today's parser, and every
test the scripts run exists."""

import argparse
import re
import shlex
from pathlib import Path

import pytest

from attention_jax.tools.bench.__main__ import BENCHMARKS

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "docs").glob("gpu_*.sh"))  # gpu_common.sh: what they share, no command
# What the scripts' variables hold when they run (docs/gpu_common.sh).
VARIABLES = {"PY": "python3", "SHAPE": "gpt2-124m", "OUT": "/tmp/out", "PWD": "/repo"}


def _lines(path: Path) -> list[str]:
    """The file's lines with shell continuations joined; a Markdown file's indented code
    lines only."""
    text = path.read_text().replace("\\\n", " ")
    if path.suffix == ".md":
        return [line for line in text.splitlines() if line.startswith("    ")]
    return text.splitlines()


def _expanded(line: str, assigned: dict) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: assigned.get(m.group(1), VARIABLES.get(
        m.group(1), m.group(0))), line)


def bench_commands(path: Path) -> list[list[str]]:
    """The argument lists of the `python -m attention_jax.tools.bench ...` commands in a
    script or in the code blocks of a Markdown file (a variable assigned in the script,
    VAR="...", is expanded where it is used)."""
    assigned, found = {}, []
    for line in _lines(path):
        line = _expanded(line.split(" # ")[0], assigned)
        assignment = re.match(r'\s*(\w+)="([^"]*)"\s*$', line)
        if assignment:
            assigned[assignment.group(1)] = assignment.group(2)
            continue
        command = re.search(r"-m attention_jax\.tools\.bench\s+(.*)", line)
        if command:
            rest = re.split(r"\s*(?:;|&&|\|\||\||`|\s\d*>)", command.group(1))[0]
            found.append(shlex.split(rest))
    return found


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench")
    sub = parser.add_subparsers(dest="which", required=True)
    for module in BENCHMARKS.values():
        module.add_parser(sub)
    return parser


@pytest.mark.parametrize("path", [*(p for p in SCRIPTS if p.name != "gpu_common.sh"),
                                  REPO / "docs" / "gpu_next.md"], ids=lambda p: p.name)
def test_every_bench_command_of_the_gpu_plan_parses(path, capsys):
    commands = bench_commands(path)
    assert commands, f"{path.name}: no bench command found"
    parser = _parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{path.name}: bench {' '.join(argv)}: {capsys.readouterr().err}")


def test_a_renamed_option_would_be_caught(tmp_path):
    """The reading itself: a script with an option the bench does not have fails."""
    script = tmp_path / "gpu_plan.sh"
    script.write_text('LOSS="$PY -m attention_jax.tools.bench loss --repeats 3"\n'
                      "run a 60 $LOSS --pallas-warps 16 --out $OUT/a.json 2>&1\n")
    (argv,) = bench_commands(script)
    assert argv == ["loss", "--repeats", "3", "--pallas-warps", "16", "--out", "/tmp/out/a.json"]
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_test_the_gpu_scripts_run_exists(path):
    targets = [t for line in _lines(path) if "pytest" in line
               for t in re.findall(r"(tests/[\w/]+\.py)(?:::(?:\w+::)?(\w+))?", line)]
    assert bool(targets) == ("pytest" in path.read_text()), targets
    for file, function in targets:
        assert (REPO / file).is_file(), f"{path.name}: {file} does not exist"
        if function:
            assert re.search(rf"^\s*def {function}\(", (REPO / file).read_text(), re.M), (
                f"{path.name}: {file} has no {function}")
