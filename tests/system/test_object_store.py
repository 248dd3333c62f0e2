"""Workdirs in object storage: a training run with --workdir=gs://bucket/run against a GCS
emulator served on localhost (gcp-storage-emulator from PyPI, started and stopped here;
gcs_emulator.py says the one header it adds),
reached the way a real bucket is: epath/gcsfs for config.json, metrics and the tokenizer,
tensorboardX's google-cloud-storage writer for TensorBoard, and orbax's tensorstore gcs
driver for the checkpoints. The environment variables are the ones the README names.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from etils import epath

import tiny  # noqa: F401 - registers the tiny task
from conftest import REPO, free_port, subprocess_env
from attention_jax import checkpoint, main, runs, train, verify
from attention_jax import workdir as workdir_lib
from attention_jax.errors import UserError

BUCKET = "attention-jax-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A GCS emulator on a free localhost port (in memory, one bucket), and this
    process's environment pointed at it; both undone afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("gcs") / "emulator.log", "w")
    server = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "system", "gcs_emulator.py"), str(port),
         BUCKET], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}", timeout=1)
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail(f"the GCS emulator did not start: {open(log.name).read()[-2000:]}")
            time.sleep(0.1)
    env = emulator_env(url)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait(timeout=10)
        log.close()


def emulator_env(url: str) -> dict:
    """What points gcsfs, google-cloud-storage and tensorstore at an emulator (README)."""
    return {"STORAGE_EMULATOR_HOST": url,           # gcsfs (epath), google-cloud-storage
            "TENSORSTORE_GCS_HTTP_URL": url,         # tensorstore's gcs driver (orbax)
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore: no credential lookup
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # gcsfs: no bucket-type probe


def _losses(workdir) -> list[float]:
    return [r["loss"] for r in workdir_lib.read_metrics(workdir) if r["split"] == "train"]


def test_training_in_a_bucket_resumes_and_reads_back(gcs, tmp_path, monkeypatch, capsys):
    """A run in gs:// writes config, metrics, TensorBoard and checkpoints there (nothing
    under ./gs:), resumes from the bucket's checkpoint with the losses of an
    uninterrupted local run, and --mode=eval, runs.open_run and verify read it."""
    monkeypatch.chdir(tmp_path)
    cfg = {"train.log_every": 1, "train.checkpoint_every": 4}
    local = train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 8, **cfg}),
                                     str(tmp_path / "local"))
    run = f"gs://{BUCKET}/run"
    first = train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 4, **cfg}), run)
    assert first["losses"] == local["losses"][:4]
    # A save that did not finish (no commit marker): orbax deletes it as the manager
    # opens; it was first copied "aside" beside it, and that copy was deleted too.
    (epath.Path(run) / "checkpoints" / "6" / "part").write_text("x")
    capsys.readouterr()
    second = train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 8, **cfg}), run)
    assert second["step"] == 8 and second["losses"] == local["losses"][4:]
    captured = capsys.readouterr()
    assert f"resumed from {run}/checkpoints at step 4" in captured.out
    said = [line for line in captured.err.splitlines() if line.startswith("warning: ")]
    assert not os.path.exists(tmp_path / "gs:")  # never made into a local path
    assert _losses(run) == _losses(tmp_path / "local")

    bucket = epath.Path(run)
    assert {p.name for p in bucket.iterdir()} >= {"config.json", "metrics.jsonl",
                                                  "tensorboard", "checkpoints"}
    assert json.loads((bucket / "config.json").read_text())["train"]["steps"] == 8
    assert [p.name for p in (bucket / "tensorboard").iterdir()
            if p.name.startswith("events.out.tfevents")], "no TensorBoard events in the bucket"
    assert sorted(p.name for p in (bucket / "checkpoints").iterdir()) == ["4", "8"]
    assert any("deleted as orbax deletes unfinished saves in an object store" in m
               for m in said), said
    assert not any("moved aside" in m for m in said), said
    ckpt = checkpoint.Checkpointer(f"{run}/checkpoints", read_only=True)
    assert ckpt.committed_steps() == [4, 8]
    ckpt.close()

    # --mode=eval's code path: the run's own config read from the bucket, the record
    # appended (rewritten) to evals.jsonl there.
    config = main.mode_config("eval", None, [], run)
    record = main.evaluate_checkpoint(config, run)
    assert record["step"] == 8
    assert workdir_lib.read_records(f"{run}/evals.jsonl")[-1]["step"] == 8
    assert runs.open_run(run).step == 8

    # The verifier's command line, in a fresh process: every step intact, newest first.
    out = subprocess.run([sys.executable, "-m", "attention_jax.verify", run], cwd=REPO,
                         env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    rows = out.stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["8", "4"] and all(" ok" in r for r in rows), out.stdout


def test_tokenizer_goes_to_the_bucket_and_back(gcs, tmp_path):
    """A task's assets (a real trained BPE tokenizer) are saved into the bucket and read
    back from a local copy that encodes the same."""
    from attention_jax import data
    texts = ["the cat sat on the mat", "a dog and a cat", "the mat is red"] * 20
    tok = data.get_tokenizer("bpe", texts=texts, vocab_size=300)
    run = f"gs://{BUCKET}/tok"
    workdir_lib.save_assets(lambda w: tok.save(workdir_lib.path(w, workdir_lib.TOKENIZER)), run)
    assert (epath.Path(run) / "tokenizer" / "tokenizer_meta.json").exists()
    back = data.load_tokenizer(workdir_lib.local_dir(run, workdir_lib.TOKENIZER))
    assert back.encode("the red cat") == tok.encode("the red cat")
    assert workdir_lib.local_dir(f"gs://{BUCKET}/none", workdir_lib.TOKENIZER) is None

    # A process's copy goes when the process does (each run once left one in the temp dir).
    out = subprocess.run([sys.executable, "-c", "from attention_jax import workdir as w; "
                          f"print(w.local_dir({run!r}, w.TOKENIZER))"], cwd=REPO,
                         env={**subprocess_env(1), **gcs}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    copy = out.stdout.strip().splitlines()[-1]
    assert "attention_jax_copy_" in copy and not os.path.exists(copy), copy


def test_an_export_goes_to_the_bucket(gcs, tmp_path, monkeypatch, capsys):
    """export_hf to gs:// wrote a local folder ./gs:/bucket/... and returned as if done."""
    import jax
    import jax.numpy as jnp
    from attention_jax import convert, data
    from attention_jax.models import gpt
    monkeypatch.chdir(tmp_path)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=320, num_layers=1, num_heads=2, d_model=16,
                                  max_len=16))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    out = f"gs://{BUCKET}/export/hf"
    assert convert.export_hf(model, params, out, tokenizer=data.get_tokenizer("byte")) == out
    names = {p.name for p in epath.Path(out).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not os.path.exists(tmp_path / "gs:")
    local = tmp_path / "copy"  # what transformers would download: the same model
    local.mkdir()
    for name in names:
        (local / name).write_bytes((epath.Path(out) / name).read_bytes())
    back = convert.load_hf(str(local))
    np.testing.assert_array_equal(back.params["token_embedding"]["embedding"],
                                  params["token_embedding"]["embedding"].value)
    convert.export_hf(model, params, out)  # without a tokenizer: the earlier one's go
    assert not (epath.Path(out) / "tokenizer.json").exists()
    assert "tokenizer.json" in capsys.readouterr().err
    (epath.Path(f"gs://{BUCKET}/export/run/checkpoints")).mkdir(parents=True, exist_ok=True)
    (epath.Path(f"gs://{BUCKET}/export/run/checkpoints/0")).write_text("x")
    with pytest.raises(convert.ConversionError, match=r"holds a training run"):
        convert.export_hf(model, params, f"gs://{BUCKET}/export/run")


def test_missing_remote_runs_are_one_line(gcs):
    """--mode=eval of a run that is not in the bucket: one line from the command line
    (no traceback); a missing bucket and verify of a missing run likewise."""
    out = subprocess.run([sys.executable, "-m", "attention_jax.main", "--mode=eval",
                          f"--workdir=gs://{BUCKET}/never"], cwd=REPO, env=subprocess_env(1),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"gs://{BUCKET}/never/config.json does not exist" in lines[0], \
        out.stderr[-2000:]
    with pytest.raises(workdir_lib.RunPathError) as e:
        workdir_lib.check_readable("gs://no-such-bucket/run")
    assert "bucket gs://no-such-bucket does not exist" in str(e.value)
    assert "\n" not in str(e.value)
    assert verify.main([f"gs://{BUCKET}/never"]) == 2


def test_a_store_that_refuses_the_metrics_stops_the_run_in_one_line(gcs):
    """The metrics writer's upload refused by the store (a bucket gone: the emulator's
    404, which gcsfs does not retry; a store gone entirely fails the same way after
    gcsfs's retries): one line naming the file, the workdir and what is kept, and
    closing the writer neither raises again nor retries."""
    workdir = "gs://attention-jax-gone/run"
    writer = workdir_lib.MetricWriter(workdir)
    with pytest.raises(workdir_lib.RunPathError) as e:
        writer.write(1, "train", {"loss": 1.0})
    message = str(e.value)
    assert message.startswith(f"writing metrics.jsonl to --workdir={workdir} failed: ")
    assert message.endswith("the same command resumes from its last checkpoint once the "
                            "store can be reached") and "\n" not in message
    writer.close()  # said once: no second upload, no second error


def test_gcsfs_giving_up_is_left_to_the_caller_s_one_line(caplog):
    """Around an upload, gcsfs's own record of giving up (a traceback at ERROR, its
    message formatted before logging) is dropped: the caller says the error in one line.
    Its other records, and the same record outside the block, stay."""
    import logging

    from attention_jax import quiet
    log = logging.getLogger("gcsfs")

    def gave_up():
        try:
            raise ConnectionRefusedError(111, "Connect call failed")
        except ConnectionRefusedError as e:
            log.exception(f"_request out of retries on exception: {e}")
    with caplog.at_level(logging.DEBUG, logger="gcsfs"):
        with quiet.drop_gcsfs():
            gave_up()
            log.warning("something else gcsfs says")
        gave_up()
        # A rename's moveTo refused (the emulator's 501; a checkpoint moved aside): gcsfs
        # copies and deletes instead, after a traceback an object, dropped there.
        with quiet.drop_gcsfs(quiet.GCSFS_MOVE_FALLBACK):
            log.warning("Failed to move file using moveTo API: , 501. Falling back to "
                        "copy/delete.", exc_info=True)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["something else gcsfs says",
                    "_request out of retries on exception: [Errno 111] Connect call failed"]


def test_orbax_errors_come_as_one_line_each(caplog):
    """A save failing as the store went away logged a dozen tracebacks of orbax's
    threads (600 lines) before the run's one line said what failed. Within the block
    (the training loop) orbax's ERROR records keep their first line only; another
    library's, a warning, and the same record outside the block are untouched."""
    import logging

    from absl import logging as absl_logging

    from attention_jax import quiet
    log = logging.getLogger("absl")

    def failed(pathname):
        try:
            raise ConnectionRefusedError(111, "Connect call failed")
        except ConnectionRefusedError:
            record = log.makeRecord("absl", logging.ERROR, pathname, 387,
                                    "[process=0] Save Finalize thread failed: %s\nmore", ("x",),
                                    sys.exc_info())
        log.handle(record)
    orbax = "/site-packages/orbax/checkpoint/_src/futures/future.py"
    with caplog.at_level(logging.INFO, logger="absl"):
        with quiet.storage_errors_in_one_line():
            failed(orbax)
            failed("/site-packages/somebody/else.py")
            absl_logging.warning("a warning\nof two lines")
            try:  # gcsfs's own, out of retries
                raise ConnectionRefusedError(111, "Connect call failed")
            except ConnectionRefusedError as e:
                logging.getLogger("gcsfs").exception(f"_request out of retries on exception: "
                                                     f"{e}\nand a second line")
        failed(orbax)
    said = [(r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert said == [("[process=0] Save Finalize thread failed: x", False),
                    ("[process=0] Save Finalize thread failed: x\nmore", True),
                    ("a warning\nof two lines", False),
                    ("_request out of retries on exception: [Errno 111] Connect call failed",
                     False),
                    ("[process=0] Save Finalize thread failed: x\nmore", True)]


def test_a_failing_run_s_close_does_not_replace_its_error(gcs):
    """The trainer closes its writer with the store's error on its way out (upload=False):
    the event files are not uploaded then, so a store that is gone cannot hold the run
    through a second round of retries and replace the first error with its own."""
    writer = workdir_lib.MetricWriter(f"gs://{BUCKET}/closing")
    writer.write(1, "train", {"loss": 1.0})
    listed = sorted(p.name for p in epath.Path(f"gs://{BUCKET}/closing/tensorboard").iterdir())
    writer._tb.add_scalar("train/loss", 0.5, 2)  # a record after the last upload
    writer.close(upload=False)  # the store had failed the run
    uploaded = epath.Path(f"gs://{BUCKET}/closing/tensorboard", listed[0]).read_bytes()
    writer = workdir_lib.MetricWriter(f"gs://{BUCKET}/closing2")
    writer.write(1, "train", {"loss": 1.0})
    writer._tb.add_scalar("train/loss", 0.5, 2)
    writer.close()
    closed = [p for p in epath.Path(f"gs://{BUCKET}/closing2/tensorboard").iterdir()]
    assert len(closed[0].read_bytes()) > len(uploaded)  # a normal close uploads the rest


def test_remote_paths_are_never_made_absolute():
    assert workdir_lib.resolve("gs://bucket/run1") == "gs://bucket/run1"
    assert workdir_lib.resolve("s3://bucket/run1") == "s3://bucket/run1"
    assert workdir_lib.path("gs://bucket/run1", "config.json") == "gs://bucket/run1/config.json"
    assert workdir_lib.resolve("run1") == os.path.join(os.getcwd(), "run1")
    assert not workdir_lib.is_remote("/tmp/gs://x")
    # A URL of another scheme, or a slash short, was made a local folder ./gs:/bucket/x
    # (gcs://, a KeyError inside epath)
    for typo in ("gs:/bucket/x", "gcs://bucket/x", "az://c/x"):
        with pytest.raises(workdir_lib.RunPathError, match=rf"^--workdir={typo} reads as a URL "
                                                           rf"of a scheme this does not know"):
            workdir_lib.resolve(typo)
    assert workdir_lib.resolve("C:/x").endswith("C:/x")  # (a one-letter scheme: a path)


def test_s3_checkpoints_are_one_line():
    """orbax hands tensorstore only gs:// and local paths: an s3:// checkpoints folder is
    refused before anything is written."""
    with pytest.raises(checkpoint.CheckpointLocationError) as e:
        checkpoint.Checkpointer("s3://bucket/run/checkpoints")
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert "not s3://" in str(e.value)
    with pytest.raises(workdir_lib.RunPathError) as e:  # a run stops before writing
        workdir_lib.prepare_for_writing("s3://bucket/run")
    assert "--workdir=s3://bucket/run: orbax writes checkpoints only to gs://" in str(e.value)


def test_listings_see_what_another_writer_added(gcs):
    """gcsfs's listing cache would hide a step folder written by tensorstore (or another
    process) after a first listing: workdir.fresh_listings turns it off."""
    import tensorstore as ts
    folder = workdir_lib.epath_of(f"gs://{BUCKET}/listing")
    (folder / "1" / "a").write_text("a")
    assert [p.name for p in folder.iterdir()] == ["1"]
    store = ts.KvStore.open({"driver": "gcs", "bucket": BUCKET, "path": "listing/"}).result()
    store.write("2/b", b"b").result()
    assert sorted(p.name for p in folder.iterdir()) == ["1", "2"]


def test_the_records_cache_may_be_in_a_bucket(gcs, tmp_path, monkeypatch):
    """data.cache_dir=gs://...: what a pass over every record found is kept there (a
    small .npz) and read back on the next start, with no record read again."""
    from attention_jax.data import files
    from attention_jax.tasks.base import complete_records
    (tmp_path / "t.jsonl").write_text("".join(
        json.dumps({"text": f"t {i}", "label": "ab"[i % 2]}) + "\n" for i in range(20)))
    files._splits.cache_clear()
    split = files.file_splits(str(tmp_path / "t.jsonl"), fields=("text", "label"),
                              fields_hint="the keys")["train"]
    cache = f"gs://{BUCKET}/cache"
    first = complete_records(split, ["text", "label"], labels_of="label", cache=cache)
    assert len(list(epath.Path(cache, "records").iterdir())) == 1
    reads = []
    document = files.Corpus.document
    monkeypatch.setattr(files.Corpus, "document",
                        lambda self, n: reads.append(n) or document(self, n))
    again = complete_records(split, ["text", "label"], labels_of="label", cache=cache)
    assert reads == [] and (again.digest, again.labels, again.count) == (
        first.digest, ("a", "b"), first.count)


def test_a_run_from_step_0_sets_an_earlier_run_s_events_aside_in_a_bucket(gcs):
    """A run that starts at step 0 in a bucket folder that held an earlier run (its
    checkpoints moved away) left that run's events files beside its own, as a local
    workdir no longer does: wall_seconds took the earlier run's start, and a sweep's
    wall time counted the earlier run and the pause after it (32.6 s for a 3 s run)."""
    run = f"gs://{BUCKET}/aside"
    writer = workdir_lib.MetricWriter(run)
    writer.write(1, "train", {"loss": 2.0})
    writer.close()
    tb = epath.Path(run) / "tensorboard"
    earlier = [p.name for p in tb.iterdir()]
    assert len(earlier) == 1 and earlier[0].startswith("events.out.tfevents."), earlier
    time.sleep(1.1)  # (the events file's name has the start time in whole seconds)
    writer = workdir_lib.MetricWriter(run, resume_step=0)
    writer.write(1, "train", {"loss": 1.0})
    writer.close()
    top = sorted(p.name for p in tb.iterdir() if p.name.startswith("events.out.tfevents."))
    assert len(top) == 1 and top != earlier, top
    aside = [p for p in tb.iterdir() if p.name.startswith("earlier_run_")]
    assert [p.name for p in aside[0].iterdir()] == earlier, aside


def test_a_tokenizer_s_meta_file_goes_up_last(gcs, monkeypatch):
    """save_assets uploaded a tokenizer's files in the listing's order (the filesystem's
    hash order): where tokenizer_meta.json came first and the upload of the vocabulary
    failed (a kill, the store gone), the bucket held a tokenizer folder without its
    vocabulary, and every later start failed with a traceback until it was deleted."""
    from attention_jax import data
    tok = data.get_tokenizer("bpe", texts=["the cat sat on the mat"] * 20, vocab_size=300)
    walk = os.walk
    monkeypatch.setattr(workdir_lib.os, "walk", lambda top: (
        (root, dirs, sorted(files, reverse=True)) for root, dirs, files in walk(top)))
    write_bytes = epath.Path.write_bytes

    def fail_on_vocabulary(self, data_):
        if self.name == "tokenizer.json":
            raise OSError("the store is gone")
        return write_bytes(self, data_)
    monkeypatch.setattr(type(epath.Path(f"gs://{BUCKET}/x")), "write_bytes", fail_on_vocabulary)
    run = f"gs://{BUCKET}/tok_cut"
    with pytest.raises(OSError):
        workdir_lib.save_assets(lambda w: tok.save(workdir_lib.path(w, workdir_lib.TOKENIZER)),
                                run)
    assert not (epath.Path(run) / "tokenizer" / "tokenizer_meta.json").exists()
