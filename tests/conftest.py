"""Test setup: 8 fake CPU devices so sharding tests run on real multi-device meshes, and
the CPU backend's fast-compile flags (helpers.FAST_COMPILE_XLA_FLAGS says why).

XLA reads the flags when the CPU backend starts, so they must be set before jax is imported.
"""

import os

from helpers import xla_flags

os.environ["XLA_FLAGS"] = xla_flags(8, before=os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `tpu` run only where JAX's default backend is a TPU (set JAX_PLATFORMS=tpu:
    this file defaults it to cpu); elsewhere they are skipped, saying why."""
    tpu_tests = [item for item in items if item.get_closest_marker("tpu")]
    if tpu_tests and jax.default_backend() != "tpu":
        skip = pytest.mark.skip(reason=f"needs a TPU; JAX's backend is {jax.default_backend()!r}")
        for item in tpu_tests:
            item.add_marker(skip)


@pytest.fixture
def x64():
    """Run a test with float64 enabled (numerics against the float64 reference)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A tfds data directory shared by a test module's tiny runs."""
    return str(tmp_path_factory.mktemp("tfds"))
