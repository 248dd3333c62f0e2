"""GPT trained with its sequence split over the mesh (mesh.sequence, ring attention):
the same losses as on one device, and checkpoints that restore across sequence sizes."""

import logging
import shutil

import numpy as np
import pytest

from attention_jax import main, train
from attention_jax.errors import ConfigError
from helpers import load, shrink


def _config(data_dir, **overrides):
    c = shrink(load("gpt").get_config(), data_dir)
    c.mesh.num_devices = 0  # all 8 devices: the tests split the sequence 4 or 2 ways
    c.data.seq_len = 32  # 2 chunks of 4 tokens on each of 4 sequence devices
    c.train.steps = 4
    c.train.batch_size = 8
    c.train.checkpoint_every = 2
    c.train.log_every = 1
    c.optim.warmup_steps = 1
    c.optim.decay_steps = 4  # the schedule of the 4-step run, so 2 + 2 steps resume it
    for key, value in overrides.items():
        group, name = key.split(".")
        c[group][name] = value
    return c


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, data_dir):
    """The reference: 4 steps on one device."""
    workdir = str(tmp_path_factory.mktemp("one"))
    return train.train_and_evaluate(_config(data_dir, **{"mesh.num_devices": 1}), workdir)["losses"]


def test_gpt_on_sequence_4_trains_like_one_device(one_device, data_dir, tmp_path):
    assert len(one_device) == 4 and one_device[-1] < one_device[0]
    summary = train.train_and_evaluate(_config(data_dir, **{"mesh.sequence": 4}), str(tmp_path))
    np.testing.assert_allclose(summary["losses"], one_device, rtol=1e-5)


def test_fused_pair_kernel_in_the_ring_trains_like_one_device(one_device, data_dir, tmp_path,
                                                             caplog):
    """model.ring_inner="pallas": every chunk pair through the Pallas kernels (interpret
    mode here, as on a GPU compiled), forward and backward; 2 steps as one device's."""
    config = _config(data_dir, **{"mesh.sequence": 4, "model.ring_inner": "pallas",
                                  "train.steps": 2})
    summary = train.train_and_evaluate(config, str(tmp_path / "pallas"))
    np.testing.assert_allclose(summary["losses"], one_device[:2], rtol=1e-5)
    # Sampling on the same mesh: the cached prompt (3 tokens) and each new token are no
    # sequence a ring splits, and the forced kernel refused them ("T ... must be divisible
    # by 2 × mesh.sequence"); decoding takes auto's choice.
    config.eval.sample_prompts, config.eval.sample_tokens = ("def",), 3
    with caplog.at_level(logging.WARNING, logger="attention_jax.layers.attention"):
        (text,) = main.sample_checkpoint(config, str(tmp_path / "pallas"))
    assert text.startswith("def") and len(text) > 3
    assert [r.getMessage() for r in caplog.records] == [  # said, once
        "decoding with the KV cache takes implementation='auto' (ring_inner='auto'), not "
        "implementation='auto', ring_inner='pallas': a cached step is no sequence to split "
        "over a ring"]
    # The key reaches the ring: splash, forced, refuses chunks of 4 tokens (it tiles by 128).
    config.model.ring_inner = "splash"
    with pytest.raises(ValueError, match="ring_inner='splash' needs chunks"):
        train.train_and_evaluate(config, str(tmp_path / "splash"))


def test_ring_asked_for_by_name_trains_like_one_device(one_device, data_dir, tmp_path):
    """model.implementation="ring" (listed valid) refused at the model's init, which ran
    outside the mesh: "needs a mesh with a 'sequence' axis" under mesh.sequence=4."""
    config = _config(data_dir, **{"mesh.sequence": 4, "model.implementation": "ring",
                                  "train.steps": 2})
    summary = train.train_and_evaluate(config, str(tmp_path))
    np.testing.assert_allclose(summary["losses"], one_device[:2], rtol=1e-5)


def test_checkpoint_restores_across_sequence_sizes(one_device, data_dir, tmp_path):
    """Saved at step 2 on (data=2, sequence=4); resumed on (data=4, sequence=2) and on one
    device: steps 3-4 give the uninterrupted run's losses."""
    base = str(tmp_path / "base")
    saved = train.train_and_evaluate(_config(data_dir, **{"mesh.sequence": 4, "train.steps": 2}),
                                     base)
    np.testing.assert_allclose(saved["losses"], one_device[:2], rtol=1e-5)
    for name, mesh in (("sequence2", {"mesh.sequence": 2}), ("one", {"mesh.num_devices": 1})):
        workdir = str(tmp_path / name)
        shutil.copytree(base, workdir)
        resumed = train.train_and_evaluate(_config(data_dir, **mesh), workdir)
        assert resumed["step"] == 4 and len(resumed["losses"]) == 2, name
        np.testing.assert_allclose(resumed["losses"], one_device[2:], rtol=1e-5, err_msg=name)


def test_seq_len_must_split_into_two_chunks_per_sequence_device(data_dir, tmp_path):
    config = _config(data_dir, **{"mesh.sequence": 4, "data.seq_len": 36})
    with pytest.raises(ConfigError, match=r"config.data.seq_len=36 is not divisible by "
                                                 r"2 × mesh.sequence = 8.*mesh.sequence in"):
        train.train_and_evaluate(config, str(tmp_path))
