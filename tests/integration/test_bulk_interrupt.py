"""Ctrl-C and SIGTERM on `embedsvc embed` keep the rows computed, say how to continue, and
exit within 2 s; the rerun computes only the rest and ends equal to an uninterrupted run.

The job processes run the real command on the fake encoder (tests/integration/fake_embed.py:
it counts what it computed, so "half done" and "only the rest" are exact); one round runs
the real model, in-process and through --url.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from embedsvc.bulk.checkpoint import parts_dir

from .test_bulk_resume import EMBEDSVC, assert_same_output, done_rows, texts

ROOT = Path(__file__).resolve().parents[2]
FAKE = [sys.executable, "-m", "tests.integration.fake_embed"]
EXIT_S = 2.0


class Job:
    """One `embedsvc embed` process; ``computed`` counts the inputs its encoder computed."""

    def __init__(self, argv: list[str], tmp_path: Path, name: str, command: list[str] = FAKE,
                 **env: str) -> None:
        self.count = tmp_path / f"{name}.count"
        self.log = tmp_path / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*command, "embed", *argv], cwd=ROOT, stdout=out, stderr=out,
                env={**os.environ, "FAKE_EMBED_COUNT": str(self.count), **env})

    @property
    def computed(self) -> int:
        try:
            return sum(int(n) for n in self.count.read_text().split())
        except FileNotFoundError:
            return 0

    def wait_until(self, ready, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}: {self.output}"
            assert time.monotonic() < deadline, self.output
            time.sleep(0.01)

    def signal_and_wait(self, sig: int) -> float:
        """Send ``sig``; the seconds until the process exited."""
        sent = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(30)
        return time.monotonic() - sent

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def last_line(self) -> str:
        return self.output.strip().splitlines()[-1]


def fake_run(argv: list[str], tmp_path: Path, name: str) -> Job:
    job = Job(argv, tmp_path, name)
    assert job.proc.wait(300) == 0, job.output
    return job


def write_input(tmp_path: Path, n: int, suffix: str) -> Path:
    lines = texts(n, seed=n)
    if suffix == ".txt":
        source = tmp_path / "in.txt"
        source.write_text("\n".join(lines) + "\n")
    else:
        source = tmp_path / "in.jsonl"
        source.write_bytes(b"".join(orjson.dumps({"id": f"d{i}", "text": t}) + b"\n"
                                    for i, t in enumerate(lines)))
    return source


def saved_and_command(line: str, sig: str) -> tuple[int, list[str]]:
    """The rows the one line says were saved, and the command it says continues."""
    prefix = f"embedsvc: interrupted by {sig}: "
    assert line.startswith(prefix), line
    saved = int(line[len(prefix):].split(" of ", 1)[0])
    command = shlex.split(line.split("to continue, run: ", 1)[1])
    assert command[:2] == ["embedsvc", "embed"], line
    return saved, command[2:]


def assert_equal_outputs(got: Path, want: Path) -> None:
    if got.suffix == ".npy":
        assert np.array_equal(np.load(got), np.load(want))
    elif got.suffix == ".parquet":
        assert pq.read_table(got).equals(pq.read_table(want))
    else:
        assert got.read_bytes() == want.read_bytes()


@pytest.mark.parametrize(("n", "suffix", "output", "chunk", "sig", "code"), [
    (200, ".txt", ".npy", 10, signal.SIGINT, 130),
    (9_000, ".jsonl", ".parquet", 100, signal.SIGINT, 130),
    (200, ".jsonl", ".jsonl", 10, signal.SIGTERM, 143),
    (9_000, ".txt", ".npy", 100, signal.SIGTERM, 143),
], ids=["200-sigint", "9000-sigint", "200-sigterm", "9000-sigterm"])
def test_an_interrupt_keeps_the_rows_computed_and_the_rerun_does_the_rest(
        tmp_path, n, suffix, output, chunk, sig, code):
    source = write_input(tmp_path, n, suffix)
    target = tmp_path / f"out{output}"
    # The default cadence commits a part after 2 s, then as the run grows; the signal
    # commits the part open at that moment too.
    argv = [str(source), "-o", str(target), "--chunk-size", str(chunk), "--concurrency", "2"]
    job = Job(argv, tmp_path, "first", FAKE_EMBED_DELAY_S=str(0.1 * chunk / 100 * 2))
    job.wait_until(lambda: job.computed >= n // 2)
    computed = job.computed
    seconds = job.signal_and_wait(sig)
    assert seconds < EXIT_S and job.proc.returncode == code, (seconds, job.output)
    saved, again = saved_and_command(job.last_line(), signal.Signals(sig).name)
    assert "Traceback" not in job.output
    # What was computed is kept: all but the chunks still in flight at the signal.
    assert computed - 2 * chunk <= saved < n and done_rows(target) == saved
    assert again == argv

    rerun = fake_run(again, tmp_path, "rerun")
    assert rerun.computed == n - saved  # only the rest
    assert f"{n - saved} inputs" in rerun.last_line()
    assert f"{saved} done by an earlier run" in rerun.last_line()
    assert not parts_dir(target).exists()
    whole = tmp_path / f"whole{output}"
    fake_run([str(source), "-o", str(whole)], tmp_path, "whole")
    assert_equal_outputs(target, whole)


def test_a_second_signal_exits_at_once_and_corrupts_nothing(tmp_path):
    n = 200
    source = write_input(tmp_path, n, ".txt")
    target = tmp_path / "out.npy"
    argv = [str(source), "-o", str(target), "--chunk-size", "10", "--concurrency", "2"]
    # Each commit waits 30 s first: without the second signal the first would take that long.
    job = Job(argv, tmp_path, "first", FAKE_EMBED_DELAY_S="0.02",
              FAKE_EMBED_SLOW_COMMIT_S="30")
    job.wait_until(lambda: job.computed >= n // 2)
    job.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert job.proc.poll() is None  # inside the (slow) commit of what was computed
    seconds = job.signal_and_wait(signal.SIGINT)
    assert seconds < EXIT_S and job.proc.returncode == -signal.SIGINT, (seconds, job.output)
    done_rows(target)  # the manifest still reads whole
    fake_run(argv, tmp_path, "rerun")
    whole = tmp_path / "whole.npy"
    fake_run([str(source), "-o", str(whole)], tmp_path, "whole")
    assert_equal_outputs(target, whole)


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "url"])
def test_the_real_model_interrupted_resumes_to_the_uninterrupted_output(tmp_path, remote,
                                                                        request):
    n = 200
    source = write_input(tmp_path, n, ".jsonl")
    target, whole = tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    where = ["--url", request.getfixturevalue("served").url] if remote else ["--device", "cpu"]
    # Parts of 20 rows: once one is committed the job is well under way, on any machine.
    argv = [str(source), "-o", str(target), "--chunk-size", "5", "--concurrency", "1",
            "--part-size", "20", *where]
    job = Job(argv, tmp_path, "first", command=[EMBEDSVC])
    job.wait_until(lambda: done_rows(target) >= 20)
    seconds = job.signal_and_wait(signal.SIGINT)
    assert seconds < EXIT_S and job.proc.returncode == 130, (seconds, job.output)
    saved, again = saved_and_command(job.last_line(), "SIGINT")
    assert 20 <= saved < n and done_rows(target) == saved
    rerun = subprocess.run([EMBEDSVC, "embed", *again], capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{n - saved} inputs" in rerun.stderr and f"{saved} done by an earlier" in rerun.stderr
    whole_run = subprocess.run([EMBEDSVC, "embed", str(source), "-o", str(whole), *where],
                               capture_output=True, text=True, timeout=600)
    assert whole_run.returncode == 0, whole_run.stderr
    assert_same_output(target, whole)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_a_job_stopped_at_half_keeps_half_of_what_it_computed(tmp_path, sig):
    """Issue 41: with the defaults (chunks of 256, four in flight, parts of 10,000 rows or
    30 s), a 2,000-line job stopped at half kept nothing: half of it was in flight, and chunks
    sent together come back together. A small job's chunks now hold at most an eighth of it
    in flight, so Ctrl-C keeps at least half of what was computed; and a run's first part is
    committed after 2 s and each later one after as long as the run had taken, so a kill (a
    crash, a second Ctrl-C) keeps half of it too, but for a chunk being written."""
    n = 2000
    source = write_input(tmp_path, n, ".txt")
    target = tmp_path / "out.npy"
    argv = [str(source), "-o", str(target)]  # the defaults
    job = Job(argv, tmp_path, "first", FAKE_EMBED_DELAY_S="1")  # a device batch a second
    job.wait_until(lambda: job.computed >= n // 2)
    computed = job.computed
    job.proc.send_signal(sig)
    job.proc.wait(30)
    kept = done_rows(target)
    assert kept >= computed // 2 - (256 if sig == signal.SIGKILL else 0), (kept, computed)
    rerun = fake_run(argv, tmp_path, "rerun")
    assert rerun.computed == n - kept  # only the rest
    whole = tmp_path / "whole.npy"
    fake_run([str(source), "-o", str(whole)], tmp_path, "whole")
    assert_equal_outputs(target, whole)


def test_a_signal_as_the_job_finishes_says_the_output_is_complete(tmp_path):
    """Issue 41: a Ctrl-C that landed once the output was in place (here while the engine
    drains) said "nothing was computed yet". The job ends as it would have, and says so."""
    n = 200
    source = write_input(tmp_path, n, ".txt")
    target = tmp_path / "out.npy"
    job = Job([str(source), "-o", str(target), "--chunk-size", "10"], tmp_path, "first",
              FAKE_EMBED_SLOW_CLOSE_S="3")
    job.wait_until(lambda: target.exists() and not parts_dir(target).exists())
    job.proc.send_signal(signal.SIGINT)
    assert job.proc.wait(30) == 0, job.output
    assert job.last_line().endswith(f"-> {target} (SIGINT came as the job finished: the output "
                                    "is complete)"), job.output
    assert f"embedsvc: {n} inputs" in job.last_line() and np.load(target).shape[0] == n
