"""bench data's memory figures: what the first-batch row's columns say they measure."""

import json
import subprocess
import sys

from attention_jax.tools.bench import data_speed

# A parent that has held `MIB` MiB starts a child, as the bench starts each row's process,
# and the child reports its memory_mib() beside its ru_maxrss.
_PARENT = r"""
import json, resource, subprocess, sys
held = bytearray({mib} << 20)
held[::4096] = b"\1" * len(held[::4096])  # touched: resident
del held
child = ("import json, resource; from attention_jax.tools.bench.data_speed import memory_mib; "
         "print(json.dumps({{**memory_mib(), "
         "'ru_maxrss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))")
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                     check=True).stdout)
"""


def test_a_rows_peak_rss_is_its_own_not_the_parents():
    """The row's "peak RSS" was ru_maxrss, which Linux carries from a parent over fork and
    exec: a child of a bench that had held 400 MiB said 400 MiB. VmHWM is the child's."""
    mib = 400
    done = subprocess.run([sys.executable, "-c", _PARENT.format(mib=mib)], capture_output=True,
                          text=True, check=True, timeout=120)
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["ru_maxrss_mib"] >= mib  # the figure the row used to print: the parent's
    assert 0 < child["peak_rss_mib"] < mib / 4, child
    assert child["anon_mib"] > 0 and child["file_mib"] > 0
    assert child["anon_mib"] + child["file_mib"] <= child["peak_rss_mib"] + 1, child


def test_the_table_says_which_figure_is_the_peak():
    row = lambda peak, anon, file: {"total_s": 1.0, "data_s": 0.2, "import_s": 0.8,  # noqa: E731
                                    "peak_rss_mib": peak, "anon_mib": anon,
                                    "file_mib": file, "tokens": 26e6}
    out = {"machine": "m", "seq_len": 1024, "batch": 32, "load": [1.0, 1.0], "prepare": {},
           "loader": {}, "first_batch": {100: row(257, 112, 140), 1000: row(260, 110, 130)}}
    text = data_speed.table(out)
    assert ("| first batch, 100 MB corpus (26M tokens) | 1.00 s (0.200 s after imports); "
            "peak RSS 257 MiB; RSS at the batch 112 private + 140 mapped files | |") in text
    assert "| 1000 MB vs 100 MB | 1.00x time; -2 MiB private, +3 MiB peak RSS |" in text
