"""tools/analysis.py: bucketed translation metrics on hand-made examples, and the reports on
runs trained for a couple of steps."""

import json
import os

import numpy as np
import pytest

from attention_jax import config as config_lib
from attention_jax import train
from attention_jax.tools import analysis
from helpers import shrink


def test_bucket_index_is_right_closed():
    edges = (0, 8, 16)
    assert [analysis.bucket_index(n, edges) for n in (0, 1, 8, 9, 16, 17)] == [-1, 0, 0, 1, 1, -1]
    assert analysis.bucket_labels(edges) == ["1-8", "9-16"]


def test_bucketed_metrics_on_a_hand_made_example():
    lengths = [3, 5, 12, 14, 30]
    refs = ["un deux trois quatre", "cinq six sept huit", "neuf dix onze douze",
            "treize quatorze quinze seize", "dix-sept"]
    hyps = ["un deux trois quatre",  # exact
            "cinq six sept huit ",  # exact after stripping the space
            "neuf dix onze douze",  # exact
            "a b c d",  # nothing in common
            "dix-sept"]  # bucket 25-32
    rows = analysis.bucketed_translation_metrics(lengths, hyps, refs, edges=(0, 8, 16, 24, 32))
    by = {r["bucket"]: r for r in rows}
    assert [r["bucket"] for r in rows] == ["1-8", "9-16", "17-24", "25-32", "all"]
    assert by["1-8"]["n"] == 2 and by["1-8"]["exact_match"] == 100.0
    assert by["1-8"]["bleu"] == pytest.approx(100.0)
    assert by["9-16"]["n"] == 2 and by["9-16"]["exact_match"] == 50.0
    # Corpus BLEU of one perfect and one disjoint 4-word sentence: the clipped 4-gram
    # precision is 1 match of 2, 3-grams 2/4, 2-grams 3/6, 1-grams 4/8; BP = 1.
    assert by["9-16"]["bleu"] == pytest.approx(50.0, abs=1e-6)
    assert by["17-24"] == {"bucket": "17-24", "n": 0, "exact_match": None, "bleu": None}
    assert by["all"]["n"] == 5 and by["all"]["exact_match"] == 80.0


def test_bucketed_metrics_refuse_mismatched_lists():
    with pytest.raises(ValueError, match="differ in length: 2, 1, 1"):
        analysis.bucketed_translation_metrics([1, 2], ["a"], ["a"])


def test_translation_table_has_one_row_per_bucket():
    rows = analysis.bucketed_translation_metrics([1, 9], ["a b", "c"], ["a b", "d"],
                                                 edges=(0, 8, 16))
    table = analysis.translation_table({"x": rows, "y": rows})
    lines = table.strip().split("\n")
    assert lines[0] == "| source tokens | n | x exact % | x BLEU | y exact % | y BLEU |"
    assert lines[2].startswith("| 1-8 | 1 | 100.0 |") and lines[-1].startswith("| all | 2 |")


def _tiny_run(name, arg, data_dir, workdir, **model):
    config = shrink(config_lib.load(f"{name}:{arg}"), data_dir)
    config.train.steps = 2
    config.optim.warmup_steps = 1
    for k, v in model.items():
        config.model[k] = v
    train.train_and_evaluate(config, workdir)
    return workdir


@pytest.mark.slow
def test_translation_report_on_two_step_runs(tmp_path):
    data_dir = str(tmp_path / "tfds")
    runs = {m: _tiny_run("bottleneck", f"model={m}", data_dir, str(tmp_path / m),
                         **({"hidden_dim": 16, "embed_dim": 8} if m.startswith("rnn")
                            else {"d_model": 16, "mlp_dim": 32}))
            for m in ("rnn-bottleneck", "transformer")}
    out = str(tmp_path / "report" / "bottleneck")
    results = analysis.translation_report(runs, out, split="test", max_examples=12)
    for m in runs:
        assert sum(r["n"] for r in results[m][:-1]) == results[m][-1]["n"] == 12
    for suffix in (".json", ".md", ".png", "_examples.json"):
        assert os.path.getsize(out + suffix) > 0
    with open(out + ".json") as f:
        assert json.load(f)["edges"] == list(analysis.DEFAULT_EDGES)
    # Edges that hold no example, or a negative count: named, nothing written (it was
    # "min() arg is an empty sequence" after the tables).
    empty = str(tmp_path / "report2" / "b")
    with pytest.raises(ValueError, match=r"^--edges=40,50: none of run 'rnn-bottleneck'.s 12 "
                                         r"test examples has a source length in \(40, 50\], "
                                         r"so there is nothing to score; valid: edges that cover "
                                         r"the sources' lengths \(\d+ to \d+ tokens\)$"):
        analysis.translation_report(runs, empty, split="test", edges=(40, 50), max_examples=12)
    with pytest.raises(ValueError, match=r"^--max_examples=-5; valid: 0 \(the whole split\)"):
        analysis.translation_report(runs, empty, split="test", max_examples=-5)
    assert not os.path.exists(os.path.dirname(empty))


def test_runs_report_reads_no_corpus(tmp_path, capsys):
    """A report of runs needs their configs and metrics, not their corpus: it read the
    user's files again (stopping once they had moved) and said the training run's note
    on its sample prompts, twice."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in "ab":
        (corpus / f"{name}.txt").write_text("the cat sat on the mat. " * 40)
    config = config_lib.load("char_gpt", [
        "data.name=files", f"data.files={corpus}/*.txt", "data.seq_len=16",
        f"data.cache_dir={tmp_path}/cache", "model.num_layers=1", "model.d_model=16",
        "model.num_heads=2", "train.batch_size=8", "train.steps=1", "optim.warmup_steps=0",
        "eval.every=0", "eval.sample_prompts=()"])
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(config, workdir)
    with open(os.path.join(workdir, "config.json")) as f:  # as trained with the shipped ones
        saved = json.load(f)
    saved["eval"]["sample_prompts"] = list(config_lib.SHIPPED_PROMPTS["python_stdlib"])
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(saved, f)
    corpus.rename(tmp_path / "moved")
    capsys.readouterr()
    rows = analysis.runs_report({"a": workdir}, str(tmp_path / "report" / "r"), metric="loss")
    assert rows["a"]["step"] == 1 and rows["a"]["tokens"] == 16
    assert "note:" not in capsys.readouterr().err


@pytest.mark.slow
def test_runs_report_counts_every_test_image(tmp_path):
    data_dir = str(tmp_path / "tfds")
    runs = {f"p{p}": _tiny_run("vit_digits", f"patch={p}", data_dir, str(tmp_path / f"p{p}"),
                               d_model=8, num_layers=1, num_heads=2, mlp_dim=8)
            for p in (2, 4)}
    for w in runs.values():  # The trainer's eval metric, so the table has a loss column.
        with open(os.path.join(w, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": 2, "split": "eval", "accuracy": 0.1, "loss": 2.3}) + "\n")
    out = str(tmp_path / "report" / "vit")
    rows = analysis.runs_report(runs, out, x="tokens")
    assert rows["p2"]["tokens"] == 17 and rows["p4"]["tokens"] == 5  # patches + [CLS]
    assert rows["p2"]["eval"]["n"] == 359 and 0.0 <= rows["p2"]["eval"]["accuracy"] <= 1.0
    assert rows["p2"]["params"] > 0 and rows["p2"]["step"] == 2
    # Per image, 17 tokens of 6·N + 12·L·T·D each (Task.flops_per_unit, models/flops.py);
    # N: every parameter but the position table [17, D = 8].
    n = rows["p2"]["params"] - 17 * 8
    assert rows["p2"]["unit"] == "examples"
    assert rows["p2"]["flops_per_unit"] == 17 * (6 * n + 12 * 1 * 17 * 8)
    assert os.path.getsize(out + ".png") > 0
    assert "| p4 | 5 |" in open(out + ".md").read()
    assert "checkpoint of step" not in open(out + ".md").read()
    # A run killed after an eval its last checkpoint is older than: the whole split's
    # accuracy is the checkpoint's, and the table says which (it stood beside the later
    # eval's loss as that step's).
    with open(os.path.join(runs["p4"], "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 3, "split": "eval", "accuracy": 0.2, "loss": 2.2}) + "\n")
    again = analysis.runs_report({"p4": runs["p4"]}, str(tmp_path / "report3" / "vit"))
    assert again["p4"]["eval"]["accuracy_step"] == 2
    table = open(str(tmp_path / "report3" / "vit.md")).read()
    assert "% (checkpoint of step 2) | 2.2000 |" in table
    # An --x no run has: named with what is valid, before anything is written (it was
    # matplotlib's TypeError after the table).
    bogus = str(tmp_path / "report2" / "vit")
    with pytest.raises(ValueError, match=r"--x='bogus': run 'p2' has no such value; valid: "
                                         r"'tokens' \(where the task counts them\) or a model "
                                         r"field: \[.*'patch_size'"):
        analysis.runs_report(runs, bogus, x="bogus")
    assert not os.path.exists(bogus + ".md")
    # A misspelt --metric or --curves: one line with the valid ones (were a column of –
    # and an empty plot, written without a word).
    with pytest.raises(ValueError, match=r"--metric='acc': run 'p2'.s eval records have no "
                                         r"such metric; valid: \[.*'accuracy'"):
        analysis.runs_report(runs, bogus, metric="acc")
    with pytest.raises(ValueError, match=r"--curves='losss': no record of these runs has it; "
                                         r"valid: \[.*'loss'"):
        analysis.plot_curves(runs, bogus + "_curves.png", "losss")
    assert not os.path.exists(bogus + "_curves.png")


@pytest.mark.slow
def test_position_losses_past_the_training_length(tmp_path):
    data_dir = str(tmp_path / "tfds")
    workdir = _tiny_run("ablation_lm", "study=position,variant=learned", data_dir,
                        str(tmp_path / "learned"))
    loss, counts = analysis.position_losses(workdir, seq_len=64, batches=2, batch_size=4)
    assert loss.shape == counts.shape == (64,)
    assert counts[:32].sum() > 0 and counts[32:].sum() > 0  # rows longer than trained (32)
    assert np.all(np.isfinite(loss)) and np.all(loss[counts > 0] > 0)
    out = str(tmp_path / "report" / "positions")
    results = analysis.positions_report({"learned": workdir}, out, eval_len=64, train_len=32,
                                        batches=2, batch_size=4)
    assert set(results["learned"]) >= {"within_train_len", "beyond_train_len"}
    analysis.plot_curves({"learned": workdir}, out + "_curves.png")
    assert os.path.getsize(out + ".png") > 0 and os.path.getsize(out + "_curves.png") > 0
    # An eval length inside the training length: numpy's ZeroDivisionError before; one
    # past the position table names --eval_len (it named config.data.seq_len).
    with pytest.raises(ValueError, match=r"--eval_len=16 --train_len=32: .* valid: 0 < "
                                         r"train_len < eval_len"):
        analysis.positions_report({"learned": workdir}, out, eval_len=16)  # its own: 32
    # A training length that is not the run's drew the table's line in the wrong place.
    with pytest.raises(ValueError, match=r"^--train_len=64: the runs trained on data.seq_len "
                                         r"\{'learned': 32\}; valid: their own length"):
        analysis.positions_report({"learned": workdir}, out, eval_len=128, train_len=64)
    # A run of another task: positions and attention read language models only.
    from attention_jax import workdir as workdir_lib
    vit = str(tmp_path / "vit")  # its config is what the reports read first
    os.makedirs(vit)
    workdir_lib.write_config(vit, config_lib.load("vit_digits"))
    for report in (lambda: analysis.positions_report({"v": vit}, out, eval_len=64),
                   lambda: analysis.attention_report({"v": vit}, out)):
        with pytest.raises(ValueError, match=r"reads runs of task 'gpt'; run 'v' \(.*vit\) is "
                                             r"a 'vit' run"):
            report()
    with pytest.raises(ValueError, match=r"^--eval_len=4096 for run 'learned': "
                                         r"config.data.seq_len=4096 exceeds"):
        analysis.positions_report({"learned": workdir}, out, eval_len=4096, train_len=32)
    # No batch to read: named (it said "fewer than batch_size=16 rows; valid: <= 8037").
    for report in (lambda: analysis.positions_report({"learned": workdir}, out, 64, batches=0),
                   lambda: analysis.attention_report({"learned": workdir}, out, batches=0)):
        with pytest.raises(ValueError, match=r"^--batches=0; valid: an int >= 1$"):
            report()
    with pytest.raises(ValueError, match=r"^--batch_size=0; valid: an int >= 1$"):
        analysis.attention_report({"learned": workdir}, out, batch_size=0)
    # A run that stopped before its train.steps: the reports of its checkpoint say so
    # (they gave a normal table). This one trained every step, evaluating none
    # (eval.every=-1): finished, no note.
    analysis.attention_report({"learned": workdir}, out, batches=1, batch_size=2)
    assert "unfinished" not in open(out + ".md").read()
    config = json.loads(open(os.path.join(workdir, "config.json")).read())
    config["train"]["steps"] = 1000
    open(os.path.join(workdir, "config.json"), "w").write(json.dumps(config))
    analysis.attention_report({"learned": workdir}, out, batches=1, batch_size=2)
    assert ("note: run 'learned' (" + workdir + ") is unfinished: it logged step 2 of its "
            "train.steps=1000; this report reads its latest checkpoint") in \
        open(out + ".md").read()


def test_wall_time_spans_a_resumed_run_from_its_first_start(tmp_path, capsys):
    """Every start rewrites config.json: a resumed run's wall time was its last session's
    (or negative, when the last start failed before its first record). The first start
    is in the name of TensorBoard's first events file."""
    from attention_jax import workdir as workdir_lib
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1000.host").write_text("")
    (tmp_path / "tensorboard" / "events.out.tfevents.1500.host").write_text("")  # the resume
    for name, mtime in (("metrics.jsonl", 1600.0), ("config.json", 1700.0)):
        (tmp_path / name).write_text("{}")
        os.utime(tmp_path / name, (mtime, mtime))
    assert workdir_lib.wall_seconds(str(tmp_path)) == 600.0
    for f in (tmp_path / "tensorboard").iterdir():
        f.unlink()
    assert workdir_lib.wall_seconds(str(tmp_path)) == 0.0  # not -100
    # A run starting over from step 0 (its checkpoints moved away) sets the earlier run's
    # events aside: its own start is the one timed.
    (tmp_path / "tensorboard" / "events.out.tfevents.1000.host").write_text("")
    workdir_lib.MetricWriter(str(tmp_path), resume_step=0).close()
    assert "earlier run's TensorBoard files" in capsys.readouterr().out  # said, not silent
    assert (tmp_path / "tensorboard" / "earlier_run_1000" / "events.out.tfevents.1000.host").exists()
    (new,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    stamp = float(new.name.split(".")[3])
    writer = workdir_lib._tensorboard_writer_class()(str(tmp_path / "tensorboard"))
    writer.add_scalar("train/loss", 1.0, 1, walltime=stamp + 50)  # its last record
    writer.close()
    assert workdir_lib.wall_seconds(str(tmp_path)) == 50.0  # from this run's start, not 1000
    # A run copied elsewhere (cp, scp, gsutil: new modification times) keeps its wall
    # time: the events' own times, not the files' (a copy's was its copying's time).
    for f in [tmp_path / "metrics.jsonl", tmp_path / "config.json",
              *(tmp_path / "tensorboard").glob("events.out.tfevents.*")]:
        os.utime(f, (stamp + 5000, stamp + 5000))
    assert workdir_lib.wall_seconds(str(tmp_path)) == 50.0
    # A later start that logged nothing (main.py on the finished run) writes an events
    # file of its own whose only event is its file_version, stamped now: not the run's end.
    for f in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):
        f.unlink()
    writer = workdir_lib._tensorboard_writer_class()(str(tmp_path / "tensorboard"))
    writer.add_scalar("train/loss", 1.0, 1, walltime=1050.0)
    writer.close()
    (only,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    only.rename(tmp_path / "tensorboard" / "events.out.tfevents.1000.host")
    workdir_lib._tensorboard_writer_class()(str(tmp_path / "tensorboard")).close()  # the restart
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert workdir_lib.wall_seconds(str(tmp_path)) == 50.0


def test_runs_table_says_a_run_stopped_early_and_edges_are_checked_first(tmp_path):
    """A run killed at step 1276 of 5000 read as finished (its step 1000 eval as the
    result); --edges=8,4 wrote the report's files, then failed with min()'s message."""
    row = {"step": 1276, "steps": 5000, "params": 10, "eval": {"accuracy": 0.5}, "wall_s": 3}
    assert "| t | 10 | 1276 of 5000 (unfinished) | 50.0% |" in analysis.runs_table({"t": row})
    assert "| t | 10 | 5000 | 50.0% |" in analysis.runs_table({"t": {**row, "step": 5000}})
    for bad in ("8,4", "abc", "8", "-1,4"):
        with pytest.raises(SystemExit, match=rf"error: --edges='{bad}'; valid: two or more "
                                             rf"increasing ints >= 0"):
            analysis.main(["translation", f"--out={tmp_path / 't'}", f"--edges={bad}",
                           f"x={tmp_path}"])
    assert not os.listdir(tmp_path)


def test_each_report_s_help_says_what_it_does(capsys):
    """`analysis seeds --help` had no line on what the report is (the list of reports
    had), and its workdirs no help."""
    for name in ("translation", "runs", "positions", "attention", "scaling", "seeds",
                 "attention_cost"):
        with pytest.raises(SystemExit) as done:
            analysis.main([name, "--help"])
        assert done.value.code == 0
        usage, _, rest = capsys.readouterr().out.partition("\n\n")
        assert rest.split("\n\n")[0].strip() and not rest.startswith("positional"), name
    with pytest.raises(SystemExit):
        analysis.main(["seeds", "--help"])
    assert "the runs' workdirs" in capsys.readouterr().out


def test_positions_report_says_no_token_reached_past_the_training_length(tmp_path, monkeypatch):
    """Positions restart at each packed document: where every document is shorter than the
    training length, no token is counted past it, and the table gave its loss as 0.000;
    the curve averaged the 0 of each position no token reached into its neighbours'."""
    from attention_jax import workdir as workdir_lib
    run = str(tmp_path / "run")
    os.makedirs(run)
    workdir_lib.write_config(run, config_lib.load("gpt", ["data.seq_len=32"]))
    counts = np.zeros(64)
    counts[:20] = 10  # documents of 20 tokens

    def losses(workdir, seq_len, batches, batch_size):
        return np.where(counts > 0, 3.0, 0.0), counts

    monkeypatch.setattr(analysis, "position_losses", losses)
    out = str(tmp_path / "report" / "pos")
    with pytest.raises(ValueError, match=r"^run 'r': no token of the 8 validation batches read "
                                         r"is at a position >= train_len=32 .*; valid: "):
        analysis.positions_report({"r": run}, out, eval_len=64)
    assert not os.path.exists(out + ".md")
    # The curve: 3.0 wherever a token was counted in the window, no point where none was.
    smooth = analysis.smoothed_losses(np.where(counts > 0, 3.0, 0.0), counts)
    np.testing.assert_allclose(smooth[:20], 3.0)
    assert np.all(np.isnan(smooth[20:]))
    full = np.arange(16.0)
    np.testing.assert_allclose(analysis.smoothed_losses(full, np.ones(16)),
                               np.convolve(full, np.ones(8) / 8, mode="valid"))


def test_bucketed_metrics_all_row_counts_every_example():
    """A source longer than the last edge (a user's own pairs, data.source_len > 32) was
    left out of every bucket and of the 'all' row too: its n and BLEU were of a subset."""
    rows = analysis.bucketed_translation_metrics([3, 40, 50], ["a b", "x", "y"],
                                                 ["a b", "c", "d"], edges=(0, 8, 16))
    by = {r["bucket"]: r for r in rows}
    assert by["1-8"]["n"] == 1 and by["9-16"]["n"] == 0
    assert by["all"]["n"] == 3 and by["all"]["exact_match"] == pytest.approx(100 / 3)


def test_position_losses_and_attention_stats_read_stream_packed_rows(tmp_path):
    """A data.packing='stream' run's rows have no positions or segment ids (plain causal
    attention, positions 0..T-1): the positions and attention reports read them as its
    loss does (both were KeyErrors), the loss by position being each row's index, and
    the padding at the split's end (seen in the weights only) no query row."""
    from attention_jax.models.losses import token_cross_entropy
    config = shrink(config_lib.load("ablation_lm:study=position,variant=learned"),
                    str(tmp_path / "tfds"))
    config.train.steps, config.optim.warmup_steps, config.eval.every = 1, 1, -1
    config.data.packing = "stream"
    workdir = str(tmp_path / "stream")
    train.train_and_evaluate(config, workdir)
    t = config.data.seq_len
    loss, counts = analysis.position_losses(workdir, seq_len=t, batches=1, batch_size=2)
    _, task, params = analysis.restore_run(workdir)
    batch = next(analysis.eval_batches(task, 1, 2))
    assert "positions" not in batch and "segment_ids" not in batch
    logits, _ = task.model.apply({"params": params}, batch["inputs"])
    nll = np.asarray(token_cross_entropy(logits, batch["targets"]), np.float64)
    w = np.asarray(batch["weights"], np.float64)
    np.testing.assert_array_equal(counts, w.sum(0))
    seen = counts > 0
    np.testing.assert_allclose(loss[seen], (nll * w).sum(0)[seen] / counts[seen], rtol=1e-5)
    padded = dict(batch, weights=w.copy())
    padded["weights"][1, t // 2:] = 0  # row 1 ends the split: its tokens after t/2 + 1 pad
    real = np.ones(w.shape, bool)
    real[1, t // 2 + 1:] = False
    stats = analysis.attention_stats(task.model, params, padded)
    keys = np.broadcast_to(np.arange(1, t + 1), w.shape)  # a causal row's visible keys
    assert stats["uniform_entropy"] == pytest.approx(np.log(keys[real]).mean())
    assert 0 < stats["entropy"] <= stats["uniform_entropy"] + 1e-6
