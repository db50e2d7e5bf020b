"""`embedsvc embed` killed with SIGKILL at random points resumes to the uninterrupted output.

Small inputs and tiny chunks and parts (2 inputs, 4 rows) make a job slow enough to kill
many times. What is tested is the checkpoint, so the five kills of each format run the real
command on the fake encoder (tests/integration/fake_embed.py); one round, killed once, runs
the real model, and one goes through --url to a real server.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from embedsvc.bulk.checkpoint import parts_dir
from embedsvc.cli import main

from .conftest import cosine
from .test_bulk import WORDS

ROOT = Path(__file__).resolve().parents[2]
EMBEDSVC = str(Path(sys.executable).with_name("embedsvc"))
FAKE = [sys.executable, "-m", "tests.integration.fake_embed"]
SLOW = ["--chunk-size", "2", "--concurrency", "1", "--part-size", "4"]
KILLS = 5


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(n)]


def write_sources(tmp_path: Path, n: int) -> dict[str, Path]:
    """The same job three ways: text -> .npy, JSONL -> JSONL, Parquet -> Parquet."""
    lines = texts(n, seed=7)
    text, jsonl, table = tmp_path / "in.txt", tmp_path / "in.jsonl", tmp_path / "in.parquet"
    text.write_text("\n".join(lines) + "\n")
    jsonl.write_bytes(b"".join(orjson.dumps({"id": f"j{i}", "text": t}) + b"\n"
                               for i, t in enumerate(lines)))
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(n)], "text": lines}), table,
                   row_group_size=50)
    return {".npy": text, ".jsonl": jsonl, ".parquet": table}


def done_rows(target: Path) -> int:
    try:
        return orjson.loads((parts_dir(target) / "manifest.json").read_bytes())["done"]["records"]
    except (FileNotFoundError, orjson.JSONDecodeError):
        return 0


def start(argv: list[str], log: Path, command: list[str] | None = None,
          **env: str) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([*(command or [EMBEDSVC]), "embed", *argv], stdout=out,
                                stderr=out, start_new_session=True, cwd=ROOT,
                                env={**os.environ, **env})


def run_fake(argv: list[str]) -> None:
    """The fake job run to the end, in a process of its own."""
    done = subprocess.run([*FAKE, "embed", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def kill_after_progress(jobs: dict[str, tuple[subprocess.Popen, Path, int]],
                        rng: random.Random) -> dict[str, int]:
    """SIGKILL each job at a random moment after it committed a part; the rows done then.

    The jobs run side by side and are watched together, so none runs on unwatched.
    """
    kill_at: dict[str, float] = {}
    done: dict[str, int] = {}
    deadline = time.monotonic() + 180
    while len(done) < len(jobs):
        assert time.monotonic() < deadline, f"no progress in 180 s: {jobs}"
        for name, (proc, target, before) in jobs.items():
            if name in done:
                continue
            assert proc.poll() is None, f"{name} exited with {proc.returncode} before the kill"
            if name not in kill_at and done_rows(target) > before:
                kill_at[name] = time.monotonic() + rng.uniform(0, 0.4)  # mid-chunk, -part...
            if kill_at.get(name, float("inf")) <= time.monotonic():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
                done[name] = done_rows(target)
        time.sleep(0.01)
    return done


def read_output(path: Path) -> tuple[list | None, np.ndarray]:
    if path.suffix == ".npy":
        return None, np.load(path)
    if path.suffix == ".jsonl":
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        return [r["id"] for r in rows], np.array([r["embedding"] for r in rows])
    table = pq.read_table(path)
    return (table.column("id").to_pylist(),
            np.stack(table.column("embedding").to_numpy(zero_copy_only=False)))


def assert_same_output(got: Path, want: Path) -> None:
    got_ids, got_rows = read_output(got)
    want_ids, want_rows = read_output(want)
    assert got_ids == want_ids  # same ids, same order: no row lost or doubled
    assert got_rows.shape == want_rows.shape
    assert (cosine(got_rows, want_rows) > 0.99999).all()


def test_killed_five_times_resumes_to_the_uninterrupted_output(tmp_path):
    n = 360
    sources = write_sources(tmp_path, n)
    rng = random.Random(os.getpid())
    targets = {suffix: tmp_path / f"out{suffix}" for suffix in sources}
    argv = {s: [str(sources[s]), "-o", str(targets[s]), *SLOW] for s in sources}
    log = tmp_path / "embed.log"
    done = dict.fromkeys(sources, 0)
    for _ in range(KILLS):  # the three jobs run side by side, each killed once a round
        jobs = {s: (start(argv[s], log, FAKE, FAKE_EMBED_DELAY_S="0.02"), targets[s], done[s])
                for s in sources}
        after = kill_after_progress(jobs, rng)
        assert all(done[s] < after[s] < n for s in sources), (done, after)
        done = after
    for suffix, target in targets.items():
        run_fake(argv[suffix])
        assert not parts_dir(target).exists()
        whole = tmp_path / f"whole{suffix}"
        run_fake([str(sources[suffix]), "-o", str(whole)])
        assert_same_output(target, whole)
    assert "Traceback" not in log.read_text(errors="replace")


def test_the_real_model_killed_once_resumes_to_the_uninterrupted_output(tmp_path):
    n = 120
    sources = write_sources(tmp_path, n)
    target, whole = tmp_path / "out.parquet", tmp_path / "whole.parquet"
    argv = [str(sources[".parquet"]), "-o", str(target), "--device", "cpu", *SLOW]
    job = (start(argv, tmp_path / "embed.log"), target, 0)
    done = kill_after_progress({"real": job}, random.Random())["real"]
    assert 0 < done < n
    assert main(["embed", *argv]) == 0
    assert not parts_dir(target).exists()
    assert main(["embed", str(sources[".parquet"]), "-o", str(whole), "--device", "cpu"]) == 0
    assert_same_output(target, whole)


def test_url_mode_killed_resumes_to_the_uninterrupted_output(tmp_path, served):
    sources = write_sources(tmp_path, 200)
    target, whole = tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    argv = [str(sources[".jsonl"]), "-o", str(target), "--url", served.url, *SLOW]
    job = (start(argv, tmp_path / "embed.log"), target, 0)
    done = kill_after_progress({"url": job}, random.Random())["url"]
    assert 0 < done < 200
    assert main(["embed", *argv]) == 0
    assert main(["embed", str(sources[".jsonl"]), "-o", str(whole), "--url", served.url]) == 0
    assert_same_output(target, whole)
