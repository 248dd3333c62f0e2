"""Helpers the tests share: load a shipped experiment config, shrink its config to one tiny step.

Importable from every test directory (pytest puts tests/, where conftest.py lives, on
sys.path); the `data_dir` fixture is in conftest.py.
"""

import importlib
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite compiles hundreds of small programs and runs each for a moment, so LLVM's
# optimisation of the CPU code is much of its time and buys little. Level 0 is LLVM's
# codegen level, below the HLO: a GPT step's optimised HLO and memory analysis compiled
# with and without it are identical; only the machine code's speed changes. Measured on
# the 2-core host, each test alone, without and with it: the encoder-decoder's tests
# 93 -> 70 s, `bench ring`'s 45 -> 33, test_training.py 119 -> 109, the README's notebook
# snippet 52 -> 33 CPU-s; tests that train for a while (the notebooks, 51 -> 54 s, which
# run without it, as a user's kernel does) lose a little. Compiles for a GPU
# (json_from_cuda_plugin_child) leave it out.
# Tried and left out: XLA:CPU's older fusion emitters (--xla_cpu_use_fusion_emitters=false)
# halve a small compile (a tiny GPT step's 1.0 -> 0.5 s; its process's CPU time, the eager
# ops' many compiles included, 10 -> 6 s), but with them gelu_tanh's float32 gradient is 0
# in its far tail where autodiff through jax.nn.gelu gives -9e-6 (test_gelu_tanh), and a
# resumed run that compiles a different step program (skip mode on) no longer repeats the
# uninterrupted run's losses bit for bit (test_training): a user's compile has neither.
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def xla_flags(devices: int | None = None, before: str = "") -> str:
    """XLA_FLAGS for the test process or a child it starts: `before` (flags already set),
    `devices` fake CPU devices (None: the host's one, as a user runs), the fast flags."""
    count = [f"--xla_force_host_platform_device_count={devices}"] if devices else []
    return " ".join(filter(None, [before.strip(), *count, *FAST_COMPILE_XLA_FLAGS]))


def load(name):
    """The shipped config attention_jax/configs/<name>.py as a module."""
    return importlib.import_module(f"attention_jax.configs.{name}")


def shrink(c, data_dir):
    """One step at tiny size on small offline data (the 2k-pair translation set, six
    corpus files), so the test builds its datasets in seconds, on two of the 8 fake
    devices: still a data-parallel mesh (the batch split, the gradients' all-reduce).
    On the 2-core host the eight devices' replicated work (every device initialises and
    updates every parameter) and their larger compile cost made each run 0.6 s (ViT) to
    7.6 s (the RNN) longer; BERT's init ran 4.0 s on 8 devices, 0.8 s on 2 (measured
    2026-11-29). A test of the mesh itself sets mesh.num_devices after this."""
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
    c.eval.batch_size = 8  # divides the devices (a one-device eval batch may not).
    c.mesh.num_devices = 2
    c.train.progress = False
    c.eval.every = -1
    return c


def adam_losses(loss_fn, params, steps: int, lr: float) -> list[float]:
    """The loss at each of `steps` jitted Adam steps on loss_fn(params, rng) -> scalar
    (rng: a fresh key per step, for dropout)."""
    import jax
    import optax
    tx = optax.adam(lr)

    @jax.jit
    def step(params, opt_state, rng):
        loss, grads = jax.value_and_grad(loss_fn)(params, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, jax.random.key(i))
        losses.append(float(loss))
    return losses


def assert_loss_goes_down(losses, by: float) -> None:
    """Every loss finite, and the last lower than the first by more than `by`."""
    import numpy as np
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - by, losses


def json_from_cuda_plugin_child(script: str, timeout: float = 600):
    """Run `script` (Python that compiles for GPUs described to JAX's CUDA plugin, no GPU
    needed: tools/bench/gpu_hlo.py) in a child process on the CPU, where `make install`
    put the plugin, and parse the JSON of its last line of output."""
    import json
    import subprocess
    import sys

    from attention_jax.tools.bench import gpu_hlo, trainer
    env = trainer.child_env(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    # The kernels' PTX and the fusions' code as a user's GPU compile has them.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if f not in FAST_COMPILE_XLA_FLAGS)
    where = gpu_hlo.plugin_path()
    if where:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), where]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def children_outliving(script_path, env=None, timeout: float = 60) -> tuple[list[int], list[int]]:
    """Runs the Python script at `script_path` (it prints the pids of the processes it
    started on its first line of output, then sleeps), SIGKILLs it, and returns (those
    pids, the ones still running `timeout` seconds later). The wait ends as soon as all
    have ended: a long `timeout` costs a loaded host nothing where they do (a worker
    looks for its parent every second, then must be scheduled to exit)."""
    import signal
    import subprocess
    import sys
    import time
    parent = subprocess.Popen([sys.executable, str(script_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO, **(env or {})})
    children = [int(p) for p in parent.stdout.readline().split()]
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:  # a zombie has ended; init reaps it
                return f.read().split(") ")[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + timeout
    while any(alive(p) for p in children) and time.time() < deadline:
        time.sleep(0.1)
    return children, [p for p in children if alive(p)]


def pallas_calls(jaxpr):
    """The pallas_call equations of a jaxpr, in the order traced, looking into nested jits,
    custom_vjps and loops (not into the kernels themselves)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from pallas_calls(inner)


def all_eqns(jaxpr):
    """Every equation of a jaxpr, those inside its jits, loops, branches and kernels too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def assert_beam_finds_the_best(tokens, scores, teacher_forced, vocab: int, steps: int,
                               eos_id: int = 2, pad_id: int = 0) -> None:
    """A beam search that kept every prefix (W >= V^(steps-1)) returns, for each of its
    rows, the most probable of all V^steps sequences (after eos only padding, the form it
    returns), with that sequence's log-probability as its score (alpha 0), best first.
    teacher_forced(seqs [N, steps]) -> log-probs [rows, N, steps, V] of each sequence fed
    as the target."""
    import itertools

    import numpy as np
    seqs = np.array(list(itertools.product(range(vocab), repeat=steps)))  # [V^steps, steps]
    logp = np.asarray(teacher_forced(seqs))
    for row in range(logp.shape[0]):
        best, best_seq = -np.inf, None
        for k, seq in enumerate(seqs):
            eos = np.nonzero(seq == eos_id)[0]
            end = eos[0] + 1 if len(eos) else steps
            if np.any(seq[end:] != pad_id):
                continue
            score = sum(logp[row, k, t, seq[t]] for t in range(end))
            if score > best:
                best, best_seq = score, seq
        np.testing.assert_allclose(scores[row, 0], best, rtol=1e-5)
        np.testing.assert_array_equal(tokens[row, 0], best_seq)
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 1e-6)  # sorted best first
