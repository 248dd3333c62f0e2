"""A model family added from outside the package: a toy model and its Task, defined in this
file only and registered as tasks.TASKS["toy"], trains, evaluates, samples, and is reported
and drawn by the tools, with no package file edited. What differs between families lives in
the Task (DESIGN.md): the trainer, main's modes and the tools ask it, never the model class.
"""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from attention_jax import config as config_lib
from attention_jax import main, runs, tasks, train
from attention_jax.errors import ConfigError
from attention_jax.models import flops, losses
from attention_jax.tools import analysis, viz

VOCAB, SEQ = 16, 8  # tokens are the numbers 0..15, written as text "3 4 5"


# ====================================================================== the toy family
class Counting:
    """Random-access source: record i counts up mod VOCAB from i with stride 1 + i % 3."""

    def __init__(self, size: int, offset: int = 0):
        self.size, self.offset = size, offset

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        start, stride = self.offset + int(i), 1 + int(i) % 3
        return {"tokens": ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)}


def next_token(record, rng):
    del rng
    return {"inputs": record["tokens"][:-1], "targets": record["tokens"][1:]}


class ToyLM(nn.Module):
    """One causal self-attention over embeddings, then a linear head: ids [B, T] ->
    (logits [B, T, V], aux), aux["attention_weights"]["self"] [L=1, B, N=1, T, T] when
    asked, as the package's families return them."""
    width: int = 8

    @nn.compact
    def __call__(self, tokens, return_weights: bool = False):
        x = nn.Embed(VOCAB, self.width, name="embed")(tokens)  # [B, T, D]
        q = nn.Dense(self.width, use_bias=False, name="query")(x)
        k = nn.Dense(self.width, use_bias=False, name="key")(x)
        t = tokens.shape[1]
        scores = jnp.einsum("BTD,BSD->BTS", q, k) / np.sqrt(self.width)
        w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9), axis=-1)
        x = x + jnp.einsum("BTS,BSD->BTD", w, x)
        logits = nn.Dense(VOCAB, name="head")(x)
        return logits, ({"attention_weights": {"self": w[None, :, None]}} if return_weights else {})


def make_toy_task(config, workdir) -> tasks.Task:
    del workdir  # nothing to save or read back: the "tokenizer" is str(int)
    model = ToyLM(**config.model.to_dict())

    def loss(params, batch, rng, train):
        logits, _ = model.apply({"params": params}, batch["inputs"])
        return losses.cross_entropy(logits, batch["targets"])

    # Greedy continuation in a fixed window of SEQ (one compiled shape): the model is
    # causal, so the padding after the prompt does not change what it predicts.
    next_ids = jax.jit(lambda params, ids: jnp.argmax(model.apply({"params": params}, ids)[0], -1))

    def sample(params, rng):
        del rng  # greedy
        out = []
        for prompt in config.eval.sample_prompts:
            ids = [int(x) for x in prompt.split()]
            while len(ids) < SEQ:
                window = np.array([ids + [0] * (SEQ - len(ids))], np.int32)
                ids.append(int(np.asarray(next_ids(params, window))[0, len(ids) - 1]))
            out.append(" ".join(map(str, ids)))
        return out

    def attention_input(params, text=None, *, target=None, index=0):
        ids = [int(x) for x in (text or "0").split()]
        labels = [str(i) for i in ids]
        return tasks.AttentionInput(inputs=(np.array([ids], np.int32),),
                                    labels={"self": (labels, labels)}, info={"tokens": labels})

    return tasks.Task(
        model=model, init=lambda rng: model.init(rng, jnp.zeros((1, SEQ), jnp.int32))["params"],
        loss=loss, train_source=Counting(512), eval_source=Counting(64, offset=7),
        train_transform=next_token, eval_transform=next_token, unit="tokens",
        count=lambda b: int(b["inputs"].size), seq_len=SEQ, sample=sample,
        attention_input=attention_input, tokens_per_example=SEQ,
        # The package's FLOP formula serves any Transformer-like family.
        flops_per_unit=lambda params: flops.flops_per_token(
            flops.matmul_params(params), 1, SEQ, config.model.width))


def toy_config() -> ml_collections.ConfigDict:
    c = config_lib.base_config()
    c.task = "toy"
    c.model = ml_collections.ConfigDict({"width": 8})
    c.optim.lr, c.optim.warmup_steps = 3e-2, 1
    c.train.steps, c.train.batch_size, c.train.log_every = 6, 8, 3
    c.train.checkpoint_every, c.train.progress, c.train.async_checkpoint = 6, False, False
    c.eval.every, c.eval.steps, c.eval.batch_size = 0, 2, 8  # 0: at the end only
    c.eval.sample_prompts, c.eval.sample_tokens = ("1 2 3", "5"), 4
    c.mesh.num_devices = 1  # no sharding to wait for: the point is the Task
    return c


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """The toy task registered for this module (removed after), and a run of it."""
    assert "toy" not in tasks.TASKS
    tasks.TASKS["toy"] = make_toy_task
    try:
        workdir = str(tmp_path_factory.mktemp("toy"))
        summary = train.train_and_evaluate(toy_config(), workdir)
        yield workdir, summary
    finally:
        del tasks.TASKS["toy"]


# =========================================================================== the tests
def test_the_toy_family_trains(toy_run):
    workdir, summary = toy_run
    assert summary["step"] == 6 and summary["stopped_by"] is None
    assert np.isfinite(summary["eval"]["loss"]) and summary["losses"][-1] < summary["losses"][0]
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["task"] == "toy"


def test_the_toy_family_evaluates_and_samples(toy_run):
    workdir, summary = toy_run
    metrics = main.evaluate_checkpoint(toy_config(), workdir)
    assert metrics["step"] == 6
    assert metrics["loss"] == pytest.approx(summary["eval"]["loss"], rel=1e-5)
    texts = main.sample_checkpoint(toy_config(), workdir)
    assert texts[0].startswith("1 2 3 ") and texts[1].startswith("5 ")  # prompt, then more
    assert all(len(t.split()) == SEQ and all(0 <= int(x) < VOCAB for x in t.split())
               for t in texts)


def test_the_tools_report_and_draw_the_toy_family(toy_run, tmp_path):
    workdir, _ = toy_run
    out = str(tmp_path / "report" / "toy")
    rows = analysis.runs_report({"toy": workdir}, out, metric="loss")
    row = rows["toy"]
    assert row["task"] == "toy" and row["step"] == 6 and row["tokens"] == SEQ
    # embed 16·8 + query 8·8 + key 8·8 + head 8·16 + 16: all in matmuls.
    n = 16 * 8 + 64 + 64 + 8 * 16 + 16
    assert row["params"] == n and row["unit"] == "tokens"
    assert row["flops_per_unit"] == 6 * n + 12 * 1 * SEQ * 8
    assert "| toy | 8 | 400 | 6 |" in open(out + ".md").read()

    run = runs.open_run(workdir)
    maps = viz.maps_for_run(run, "3 4 5 6")
    assert maps["info"]["tokens"] == ["3", "4", "5", "6"]
    assert len(maps["self"].axes) == 1 + 1  # one panel and its colour bar


def test_an_entry_the_toy_lacks_is_named_with_the_tasks_that_have_it(toy_run):
    workdir, _ = toy_run
    with pytest.raises(ConfigError, match=r"task 'toy' cannot translate .*valid: "
                                          r"\['encdec', 'rnn_seq2seq'\]"):
        analysis.translate_split(workdir)


def test_register_checks_the_entries_a_family_declares():
    """tasks.register: the declared optional entries are what `need` lists for an error
    without building any task; a build that sets others is refused."""
    stub = lambda **entries: (lambda config, workdir: tasks.Task(
        model=None, init=None, loss=None, train_source=None, eval_source=None, **entries))
    try:
        tasks.register("declared", stub(sample=lambda p, r: []), provides=("sample",))
        tasks.register("undeclared", stub(sample=lambda p, r: []))
        assert tasks.tasks_with("sample") == ["declared", "encdec", "gpt", "rnn_seq2seq"]
        assert tasks.TASKS["declared"](None, "").sample is not None
        with pytest.raises(AssertionError,
                           match=r"'undeclared' sets \['sample'\] but declares \[\]"):
            tasks.TASKS["undeclared"](None, "")
        with pytest.raises(ValueError,
                           match=r"provides=\['smaple'\] are not optional Task entries"):
            tasks.register("typo", stub(), provides=("smaple",))
    finally:
        for name in ("declared", "undeclared", "typo"):
            tasks.TASKS.pop(name, None)
    task = stub()(None, "")
    with pytest.raises(ConfigError, match=r"^task 'x' cannot sample \(its Task has no sample\); "
                                          r"valid: \['encdec', 'gpt', 'rnn_seq2seq'\]$"):
        tasks.need(task, "sample", "x", "sample")


@pytest.mark.slow
def test_a_bert_mlm_run_leaves_its_untrained_heads_at_zero(data_dir, tmp_path):
    """The MLM loss trains neither BERT's pooler nor its NSP head (Task.untrained): a run
    starts them at zero and a step leaves them there, so the run exports as a
    BertForMaskedLM without them (it was a BertForPreTraining with a random NSP head). A
    warm start from that export, whose heads a warm start would fill at random, starts
    them at zero too; one from a checkpoint that holds them keeps its own (silently
    zeroing them would drop weights the run was asked to start from)."""
    from attention_jax import convert
    from helpers import shrink

    def run(workdir, **overrides):
        config = shrink(config_lib.load("bert_mlm"), data_dir)
        config.data.tokenizer = "wordpiece"  # the bundled vocabulary: nothing to train
        config.model.update(num_layers=1, d_model=8, num_heads=2, mlp_dim=16)
        config.train.update(overrides)
        train.train_and_evaluate(config, str(workdir))
        return runs.open_run(str(workdir))

    def zero(params):
        return not any(np.any(np.asarray(a)) for a in jax.tree.leaves(
            (params["pooler"], params["nsp"])))

    first = run(tmp_path / "first")
    assert zero(first.params) and np.any(np.asarray(first.params["mlm_transform"]["kernel"]))
    convert.export_hf(first.task.model, first.params, str(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["architectures"] == ["BertForMaskedLM"]
    second = run(tmp_path / "second", init_from=f"hf:{tmp_path / 'hf'}", steps=1)
    assert zero(second.params)
    # A checkpoint that holds the heads (a BertForPreTraining's, trained) keeps them.
    held = {**first.params, **{name: jax.tree.map(lambda a: np.full_like(a, 0.01),
                                                  first.params[name]) for name in ("pooler", "nsp")}}
    convert.export_hf(first.task.model, held, str(tmp_path / "pretraining"),
                      architecture="BertForPreTraining")
    third = run(tmp_path / "third", init_from=f"hf:{tmp_path / 'pretraining'}", steps=1)
    np.testing.assert_allclose(np.asarray(third.params["nsp"]["kernel"]), 0.01, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(third.params["pooler"]["kernel"]), 0.01, rtol=1e-3)


@pytest.mark.slow
def test_a_bert_task_embeds_and_a_gpt2_dir_is_refused_by_name(data_dir, tmp_path):
    """Sentence embeddings are bert_mlm's `embed` entry (main's --mode=embed asks the task);
    a Hugging Face dir is checked by its own model_type, not by the class built from it."""
    from attention_jax import convert
    from attention_jax.models import gpt
    from helpers import shrink
    config = shrink(config_lib.load("bert_mlm"), data_dir)
    config.data.tokenizer = "wordpiece"  # the bundled vocabulary: nothing to train
    config.model.update(num_layers=1, d_model=8, num_heads=2, mlp_dim=16)
    task = tasks.TASKS["bert_mlm"](config, str(tmp_path / "bert"))
    params = nn.meta.unbox(task.init(jax.random.PRNGKey(0)))
    emb = task.embed(params, ["a cat", "a dog", "stocks fell"])
    assert emb.shape == (3, 8) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, rtol=1e-5)

    model = gpt.GPT(gpt.GPTConfig.from_variant("gpt-tiny"))
    gpt_params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))
    convert.export_hf(model, gpt_params["params"], str(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match=r"model_type='gpt2'\); sentence embeddings need a "
                                         r"BERT; valid: model_type 'bert'"):
        convert.load_sentence_encoder(str(tmp_path / "gpt2"))


def test_a_run_of_a_task_a_config_file_registers_is_read_with_that_file(tmp_path, capsys):
    """A config file of one's own that registers its task (tasks.register in the file):
    its run's config.json names a task only that file registers, so reading the run
    (eval, sample) or continuing it without --config failed on an unknown task. Given
    the file, it runs for its registration (the run's own config.json is still the
    config); not given, the error says to give it."""
    import tiny
    config = tiny.tiny_config()
    config.task = "from_my_file"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(config.to_json_best_effort())
    with pytest.raises(ConfigError, match=r"^config.task='from_my_file' \(the run's config"
                                          r"\.json\) is no registered task; valid: \[.*\], or "
                                          r"give the config file that registers it \(tasks\."
                                          r"register\): --config=FILE.py \(it runs for that; "
                                          r"the run's own config.json stays the config\)$"):
        main.mode_config("eval", None, [], str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"--config=FILE.py, the config the run started "
                                          r"with$"):  # continuing it: the file is the config
        main.mode_config("train", None, [], str(tmp_path / "run"))
    mine = tmp_path / "mine.py"
    mine.write_text("import tiny\nfrom attention_jax import tasks\n\n"
                    "tasks.register('from_my_file', tiny.make_tiny_task)\n\n"
                    "def get_config(arg=None):\n    return tiny.tiny_config()\n")
    try:
        read = main.mode_config("eval", str(mine), [], str(tmp_path / "run"))
        assert read.task == "from_my_file"
        assert f"--config={mine} ran for its tasks.register only" in capsys.readouterr().err
    finally:
        tasks.TASKS.pop("from_my_file", None)
    other = tmp_path / "other.py"
    other.write_text("def get_config(arg=None):\n    return None\n")
    with pytest.raises(ConfigError, match=rf": {other} does not register it; valid: "):
        main.mode_config("sample", str(other), [], str(tmp_path / "run"))
