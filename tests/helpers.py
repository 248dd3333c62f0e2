"""Helpers the tests share: load an experiment file, shrink its config to one tiny step.

Importable from every test directory (pytest puts tests/, where conftest.py lives, on
sys.path); the `data_dir` fixture is in conftest.py.
"""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    """experiments/<name>.py as a module."""
    path = os.path.join(REPO, "experiments", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shrink(c, data_dir):
    """One step at tiny size on small offline data (the 2k-pair translation set, six
    corpus files), so the test builds its datasets in seconds."""
    c.data.data_dir = data_dir
    if c.data.name == "number_translation":
        c.data.name = "number_translation/small"
    if "max_files" in c.data:
        c.data.max_files = 6
    if c.task == "gpt":
        c.data.seq_len = min(c.data.seq_len, 32)
        c.model.num_layers, c.model.d_model = 1, 4 * c.model.num_heads
    c.train.steps = 1
    c.train.batch_size = 8
    c.train.progress = False
    c.eval.every = -1
    return c
