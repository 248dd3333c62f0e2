"""The records cache (data/records_cache.py): what a pass over every record of a split
found (the records kept, their digest, their labels), kept by the split's identity so a
restart reads none of them; a damaged entry or a root that cannot be written costs time,
said, never a wrong result."""

import hashlib
import json

import numpy as np
import pytest

from attention_jax.data import files, loaders, records_cache
from attention_jax.data.sources import Subset
from attention_jax.tasks.base import complete_records


def _split(tmp_path, write: bool = True):
    if not write:  # the file as it is now, indexed afresh (a new process)
        files._splits.cache_clear()
        return files.file_splits(str(tmp_path / "t.jsonl"), fields=("text", "label"),
                                 fields_hint="the keys", integer_fields=("label",),
                                 eval_fraction=0.2)["train"]
    records = [{"text": f"text {i}", "label": ["neg", " pos", 3][i % 3]} for i in range(30)]
    lines = [json.dumps(r) for r in records]
    lines[4] = json.dumps({"text": "   ", "label": "neg"})  # spaces only: left out
    lines[7] = "not json"  # a bad record: reads as empty, left out
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    files._splits.cache_clear()
    return files.file_splits(str(tmp_path / "t.jsonl"), fields=("text", "label"),
                             fields_hint="the keys", integer_fields=("label",),
                             eval_fraction=0.2)["train"]


def _same(a, b) -> bool:
    return ((a.count, a.digest, a.labels) == (b.count, b.digest, b.labels)
            and np.array_equal(a.dropped, b.dropped))


def _counted(monkeypatch):
    reads = []
    document = files.Corpus.document
    monkeypatch.setattr(files.Corpus, "document",
                        lambda self, n: reads.append(n) or document(self, n))
    return reads


def test_a_second_pass_reads_nothing_and_finds_the_same(tmp_path, monkeypatch, capsys):
    split = _split(tmp_path)
    reads = _counted(monkeypatch)
    cache = str(tmp_path / "cache")
    first = complete_records(split, ["text", "label"], labels_of="label", cache=cache)
    assert len(reads) == len(split)
    uncached = complete_records(split, ["text", "label"], labels_of="label")
    assert _same(first, uncached)
    assert first.labels == ("3", "neg", "pos") and first.kept < first.count
    reads.clear()
    again = complete_records(split, ["text", "label"], labels_of="label", cache=cache)
    assert reads == []
    assert _same(again, first)
    assert [split[i] for i in again.indices()][:3] == [split[i] for i in first.indices()][:3]
    # Another pass over the same records (no labels listed) is another entry, read.
    reads.clear()
    other = complete_records(split, ["text", "label"], cache=cache)
    assert len(reads) == len(split) and other.labels == () and other.digest == first.digest
    assert capsys.readouterr().err.count("skipped (bad record") == 1  # said once, when read


def test_a_damaged_entry_is_read_again_and_said(tmp_path, capsys):
    split = _split(tmp_path)
    cache = str(tmp_path / "cache")
    first = complete_records(split, ["text", "label"], labels_of="label", cache=cache)
    [entry] = (tmp_path / "cache" / "records").glob("*.npz")
    entry.write_bytes(entry.read_bytes()[:40])  # a truncated write, a disk error
    capsys.readouterr()
    again = complete_records(split, ["text", "label"], labels_of="label", cache=cache)
    assert _same(again, first)
    assert "the records cache could not be read (BadZipFile" in capsys.readouterr().err
    assert entry.stat().st_size > 40  # written whole again


def test_a_root_that_cannot_be_written_is_said_and_the_result_is_right(tmp_path, capsys):
    split = _split(tmp_path)
    (tmp_path / "blocked").write_text("a file where the cache's folder would go")
    found = complete_records(split, ["text", "label"], labels_of="label",
                             cache=str(tmp_path / "blocked"))
    assert _same(found, complete_records(split, ["text", "label"], labels_of="label"))
    err = capsys.readouterr().err
    assert "the records cache could not be written" in err and "config.data.cache_dir" in err
    complete_records(split, ["text"], cache=str(tmp_path / "blocked"))  # another entry
    assert "could not be written" not in capsys.readouterr().err  # said once per cache


def test_records_in_memory_have_no_identity_and_are_not_kept(tmp_path):
    records = [{"text": "a"}, {"text": ""}]
    found = complete_records(records, ["text"], cache=str(tmp_path))
    assert found.kept == 1 and list(found.indices()) == [0]
    assert not (tmp_path / "records").exists()
    assert records_cache.identity(records) is None


def test_a_subset_s_identity_is_the_one_saved_runs_hold():
    """Subset keeps its indices as an int64 array now (a list of millions of Python ints
    was gigabytes); its identity, which saved loader states hold, is unchanged."""
    class Split(list):
        fingerprint = "tfds x/1.0.0 train: 4 records, contents abc"
    picked = Subset(Split([0, 1, 2, 3]), [0, 2])
    digest = hashlib.sha256(np.asarray([0, 2], np.int64).tobytes()).hexdigest()[:8]
    assert loaders.source_id(picked) == f"tfds x/1.0.0 train: 4 records, contents abc, records {digest}"
    assert picked[1] == 2 and len(picked) == 2


def test_an_edit_that_restores_size_and_mtime_is_read_again(tmp_path):
    """cp -p, rsync -t or os.utime give an edited file its old size and mtime: its ctime
    (and inode, for a replaced file) still differ, so the pass reads it again and the
    digest (the resume's check) sees the edit."""
    import os
    split = _split(tmp_path)
    cache = str(tmp_path / "cache")
    first = complete_records(split, ["text", "label"], labels_of="label", cache=cache)
    path = tmp_path / "t.jsonl"
    st = os.stat(path)
    path.write_text(path.read_text().replace('"neg"', '"gen"'))  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    edited = complete_records(_split(tmp_path, write=False), ["text", "label"],
                              labels_of="label", cache=cache)
    assert edited.digest != first.digest and "gen" in edited.labels


def test_max_bad_records_holds_at_every_start(tmp_path):
    """The splits of a user's files share one count of bad records: a start whose
    training split came from the cache counts its bad records again, so a limit the
    first start exceeded stops the second one too."""
    lines = [json.dumps({"text": f"text {i}", "label": "ab"[i % 2]}) for i in range(40)]
    for i in range(0, 40, 4):
        lines[i] = "not json"  # 10 bad records, over both splits
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    cache = str(tmp_path / "cache")

    def start(limit):
        files._splits.cache_clear()  # a new process
        found = files.file_splits(str(tmp_path / "t.jsonl"), fields=("text", "label"),
                                  fields_hint="the keys", eval_fraction=0.5,
                                  max_bad_records=limit, arg="config.data.")
        return [complete_records(found[s], ["text", "label"], cache=cache)
                for s in ("train", "validation")]
    train, held = start(100)
    train_bad, held_bad = len(train.dropped), len(held.dropped)
    assert train_bad + held_bad == 10 and train_bad and held_bad
    limit = max(train_bad, held_bad)  # each split alone passes; both do not
    with pytest.raises(files.FilesError, match=r"more than config\.data\.max_bad_records="
                                               rf"{limit}"):
        start(limit)
    with pytest.raises(files.FilesError, match=r"more than config\.data\.max_bad_records="
                                               rf"{limit}"):
        start(limit)  # the training split's pass now from the cache
    start(10)


def test_the_same_file_under_another_name_is_another_entry(tmp_path):
    """A record's id (the file's name under its glob, and the line) is part of what the
    digest reads: the same file reached by another glob is another entry, whose digest
    is its own, not the first glob's."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "t.jsonl").write_text("".join(
        json.dumps({"text": f"t {i}", "label": "ab"[i % 2]}) + "\n" for i in range(20)))
    cache = str(tmp_path / "cache")

    def digest(spec, cache):
        files._splits.cache_clear()
        found = files.file_splits(spec, fields=("text", "label"), fields_hint="the keys")
        return complete_records(found["train"], ["text", "label"], cache=cache).digest
    narrow, wide = str(tmp_path / "a" / "*.jsonl"), str(tmp_path / "*" / "t.jsonl")
    assert digest(narrow, cache) != digest(wide, None)
    assert digest(wide, cache) == digest(wide, None)
