"""`embedsvc embed` memory follows the chunk size, not the longest row (issue 41): a 1 GB
line of text or JSONL, and a Parquet file of 1024 cells of 2 MB (a file of a few hundred
bytes), were held whole (3.2 GB; both others killed at 5.7 GB). Each is now refused, before it
is held, in one line that names the row, with the job's peak RSS under 1 GB.

The jobs run the real command on the fake encoder (tests/integration/fake_embed.py); the
inputs cost no disk: the long line is a hole in a sparse file, and the Parquet cells are one
dictionary value that 1024 rows refer to.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from .test_bulk_interrupt import FAKE, ROOT

GB = 1 << 30


def peak_rss(argv: list[str], log: Path) -> tuple[int, int, str]:
    """Run `embedsvc embed` with ``argv``: its exit code, its peak RSS (bytes), its last line.

    The peak is the job's own address space's (VmHWM, read until it exits): the rusage of a
    child also counts what it was before its exec, a fork of this test process, which holds
    PyTorch in some workers (2 GB)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([*FAKE, "embed", *argv], cwd=ROOT, stdout=out, stderr=out)
    status, peak = Path(f"/proc/{proc.pid}/status"), 0
    while proc.poll() is None:
        with contextlib.suppress(OSError):
            found = re.search(r"VmHWM:\s+(\d+) kB", status.read_text())
            if found:
                peak = max(peak, int(found.group(1)) * 1024)
        time.sleep(0.005)
    assert peak, "the job ended before its memory could be read"
    return proc.returncode, peak, log.read_text().strip().splitlines()[-1]


def one_long_line(path: Path, short: bytes, head: bytes, tail: bytes) -> Path:
    """A ``short`` line, then ``head``, a 1 GB hole (NUL bytes on reading) and ``tail`` on the
    second line, and ``short`` again."""
    with open(path, "wb") as f:
        f.write(short + b"\n" + head)
        f.seek(GB)
        f.write(tail + b"\n" + short + b"\n")
    return path


@pytest.mark.parametrize(("name", "short", "head", "tail", "says"), [
    ("in.txt", b"a short line", b"", b"",
     "in.txt: record 2: the input has more characters than MAX_INPUT_CHARS (200000)"),
    ("in.jsonl", b'{"text": "a short line"}', b'{"text": "short", "unused": [', b"]}",
     "in.jsonl:2: the row is longer than 3448576 bytes"),
])
def test_a_1_gb_line_is_refused_before_it_is_held(tmp_path, name, short, head, tail, says):
    source = one_long_line(tmp_path / name, short, head, tail)
    code, peak, last = peak_rss([str(source), "-o", str(tmp_path / "out.npy")],
                                tmp_path / "job.log")
    assert code == 1 and says in last, last
    assert peak < GB, peak  # 3.2 GB (text) and over 5.7 GB (JSONL) before


def test_a_parquet_file_of_1024_cells_of_2_mb_is_refused_within_1_gb(tmp_path):
    cell = "word " * (2 * (1 << 20) // 5)
    column = pa.DictionaryArray.from_arrays(pa.array([0] * 1024, pa.int32()), pa.array([cell]))
    source = tmp_path / "in.parquet"
    # without its Arrow schema the column reads back as plain strings: 2 GB of them
    pq.write_table(pa.table({"text": column}), source, compression="zstd", store_schema=False)
    assert source.stat().st_size < 100_000 and pq.ParquetFile(source).num_row_groups == 1
    code, peak, last = peak_rss([str(source), "-o", str(tmp_path / "out.npy")],
                                tmp_path / "job.log")
    assert code == 1 and "in.parquet: row 1: 'text' has more characters than MAX_INPUT_CHARS " \
                          "(200000)" in last, last
    assert peak < GB, peak  # killed at 5.7 GB before
