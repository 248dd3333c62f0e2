"""Test setup: 8 fake CPU devices so sharding tests run on real multi-device meshes.

XLA reads the flag when the CPU backend starts, so it must be set before jax is imported.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Run a test with float64 enabled (numerics against the float64 reference)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A tfds data directory shared by a test module's tiny runs."""
    return str(tmp_path_factory.mktemp("tfds"))
