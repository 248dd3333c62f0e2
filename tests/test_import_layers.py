"""The package's import structure, read from its source with `ast` (nothing imported):
no import circles, and every import points to the module's own layer or a lower one:

    attention, data < checkpoint < layers < models < tasks, convert, config(_help), workdir
        < optimizer, steps < train < runs, main, verify, configs < tools

axes.py, quiet.py, errors.py, heap.py, sharding.py and digests.py import nothing of the package but
axes, quiet and errors and so stand on the ground floor with attention/ and data/, where
anything may use them. checkpoint.py stands on digests (never the other way round), beside
its background saver (background_save.py) and its packed format (packed_state.py), and the checkpoint verifier (verify.py) is a
command like main. kernel_tiles.py (what the row-wise Pallas kernels share) stands on
attention's target backend, below the layers and models that use it.
"""

import ast
import os

import pytest

from helpers import REPO

PACKAGE = "attention_jax"
LAYERS = [{"attention", "data", "axes", "sharding", "digests", "quiet", "errors", "heap"},
          {"checkpoint", "background_save", "packed_state", "kernel_tiles"},
          {"layers"}, {"models"}, {"tasks", "convert", "config", "config_help", "workdir"},
          {"optimizer", "steps"}, {"train"}, {"runs", "main", "verify", "configs"}, {"tools"}]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, str]:
    """Dotted module name -> source path, for every .py file of the package."""
    out = {}
    for root, _, files in os.walk(os.path.join(REPO, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), REPO)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(root, f)
    return out


def imports(path: str, name: str, known) -> set[str]:
    """The package modules `path` imports, anywhere in the file (function bodies too)."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = name.split(".")[:len(name.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")}
    return found - {name}


def layer(module: str) -> str:
    return module.split(".")[1]


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {m: imports(p, m, known) for m, p in known.items() if m != PACKAGE}


def test_every_module_has_a_layer(graph):
    assert not sorted({layer(m) for m in graph} - set(RANK)), "add the new module to LAYERS"


def test_imports_point_down_or_sideways(graph):
    up = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
          for m, targets in graph.items() for t in sorted(targets)
          if t != PACKAGE and RANK[layer(t)] > RANK[layer(m)]]
    assert not up, "imports that run up the layer order:\n" + "\n".join(up)


def test_no_import_circles(graph):
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The rules above would catch what they are for (a fake graph)."""
    fake = {"attention_jax.models.gpt": {"attention_jax.train"},
            "attention_jax.train": {"attention_jax.models.gpt"}}
    assert RANK[layer("attention_jax.train")] > RANK[layer("attention_jax.models.gpt")]
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circles(fake)
    with pytest.raises(AssertionError, match="run up the layer order"):
        test_imports_point_down_or_sideways(fake)
