# The project's commands. Everything installs itself: a fresh machine needs only Python.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Test-suite parallelism: pytest-xdist workers (the suite is compile-bound on 2 cores).
TEST_WORKERS ?= 2

.PHONY: install test demo bench bench-quick clean

install: $(VENV)/.installed

# Re-install when the dependency list changes. The `torch` extra is the PyTorch peer
# for benchmarks and parity tests, pinned to the local CPU wheel (see pyproject.toml).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev,torch]'
	# JAX's CUDA plugin, of the installed JAX's version, beside the environment rather
	# than in it (this process's JAX stays on the CPU): `bench gpu-hlo` compiles a step
	# for an H100 with it, no GPU needed. Optional: a JAX without such a plugin skips it.
	v=$$($(BIN)/python -c 'import jax; print(jax.__version__)') && \
	  $(BIN)/pip install -q --no-deps --target $(VENV)/gpu-aot "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" \
	  || echo "no CUDA plugin for jax $$v: bench gpu-hlo and its test are skipped"
	touch $@

test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -q

# The main job: a short GPT run on the offline corpus (Python's own standard library),
# with a progress bar, checkpoints and metrics in DEMO_WORKDIR, then samples from it.
# Run it again and it resumes from the last checkpoint.
DEMO_WORKDIR ?= /tmp/attention_jax_demo
demo: install
	$(BIN)/python -m attention_jax.main --config=gpt --workdir=$(DEMO_WORKDIR) \
		--config.train.steps=200 --config.eval.every=100

bench: install
	$(BIN)/python -m attention_jax.tools.bench attention

bench-quick: install
	$(BIN)/python -m attention_jax.tools.bench attention --quick

# The test suite's persistent XLA cache (tests/system/conftest.py: CACHE) lives in the
# temp dir, outside the repository.
TEST_XLA_CACHE = $${TMPDIR:-/tmp}/attention_jax_test_xla_cache_$$(id -u)

clean:
	rm -rf $(VENV) .pytest_cache "$(TEST_XLA_CACHE)"
