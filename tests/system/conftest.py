"""Training-system tests: shared helpers for subprocess runs and a persistent XLA cache.

The tests compile the same tiny train step many times (one per mesh, per process, per
resumed run). JAX's persistent compilation cache turns every repeat into a disk read;
subprocesses get the same cache through the environment. Results never depend on it.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile

import jax
import pytest
from helpers import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(REPO, "tests", "system")
CACHE = os.path.join(tempfile.gettempdir(), f"attention_jax_test_xla_cache_{os.getuid()}")

jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def subprocess_env(devices: int = 8) -> dict:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=xla_flags(devices),
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=CACHE,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=os.pathsep.join([REPO, HERE, env.get("PYTHONPATH", "")]),
    )
    return env


def start_worker(overrides: dict, workdir: str, out: str, devices: int = 8, extra=()):
    """Starts `tests/system/tiny.py` training the tiny LM in a fresh process."""
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "tiny.py"), json.dumps(overrides), workdir, out,
         *extra], env=subprocess_env(devices), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout: float = 120) -> str:
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed (rc={proc.returncode}):\n{output[-4000:]}"
    return output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def read_json():
    def read(path):
        with open(path) as f:
            return json.load(f)
    return read
