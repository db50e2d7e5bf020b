"""`embedsvc embed --ray`: a local Ray started here, two actors, a Parquet dataset.

One job is killed (SIGKILL of the driver) once a shard is written, refused while an input
differs, then resumed; its shards equal the in-process run of the same rows.
"""

import os
import signal
import subprocess
import time

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedsvc.bulk import BulkOptions
from embedsvc.bulk.cluster import embed_dataset
from embedsvc.cli import main
from embedsvc.settings import Settings

from .conftest import cosine
from .test_bulk_resume import EMBEDSVC, texts

FILES, ROWS = 8, 20


@pytest.fixture(scope="module")
def ray_address():
    import ray

    # Logical CPUs: two one-CPU actors, and room for the light read tasks beside them.
    context = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                       _node_ip_address="127.0.0.1")  # traffic stays on loopback
    yield context.address_info["address"]
    ray.shutdown()


def write_dataset(directory):
    directory.mkdir()
    lines = texts(FILES * ROWS, seed=3)
    for f in range(FILES):
        rows = lines[f * ROWS:(f + 1) * ROWS]
        ids = [f"f{f}-{i}" for i in range(ROWS)]
        pq.write_table(pa.table({"id": ids, "text": rows}), directory / f"part-{f}.parquet")
    return lines


def shards_done(out):
    try:
        return len(orjson.loads((out / "manifest.json").read_bytes())["shards"])
    except (FileNotFoundError, orjson.JSONDecodeError):
        return 0


def kill_after_a_shard(argv: list[str], out, log_path) -> int:
    """Start the job, SIGKILL its driver once a shard is written; how many were."""
    with open(log_path, "wb") as log:
        driver = subprocess.Popen([EMBEDSVC, *argv], stdout=log, stderr=log,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while shards_done(out) == 0:
            assert driver.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no shard written in 240 s"
            time.sleep(0.05)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(30)
    return shards_done(out)


def test_killed_ray_job_resumes_to_the_in_process_output(tmp_path, ray_address, capsys):
    lines = write_dataset(tmp_path / "docs")
    for attempt in range(3):
        # Ray may hand the driver every shard at once, and all are written before the kill
        # lands (a CI run): then nothing is left to resume, and the job starts over afresh.
        out = tmp_path / f"vectors-{attempt}"
        argv = ["embed", str(tmp_path / "docs"), "-o", str(out), f"--ray={ray_address}",
                "--actors", "2", "--chunk-size", "4", "--device", "cpu"]
        killed_at = kill_after_a_shard(argv, out, tmp_path / f"driver-{attempt}.log")
        if killed_at < FILES:
            break
    assert 0 < killed_at < FILES

    # A changed input file is refused, before Ray is even asked for anything.
    first = tmp_path / "docs" / "part-0.parquet"
    stat = first.stat()
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds an unfinished job with a different inputs" in err and "--restart" in err
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    summary = embed_dataset(BulkOptions(str(tmp_path / "docs"), str(out), ray="", actors=2,
                                        chunk_size=4), Settings(device="cpu"))
    assert summary.resumed == killed_at * ROWS and summary.inputs == (FILES - killed_at) * ROWS
    shards = [pq.read_table(out / f"part-{f:05d}.parquet") for f in range(FILES)]
    got_ids = [i for s in shards for i in s.column("id").to_pylist()]
    got = np.concatenate([np.stack(s.column("embedding").to_numpy(zero_copy_only=False))
                          for s in shards])

    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.concat_tables(pq.read_table(tmp_path / "docs" / f"part-{f}.parquet")
                                    for f in range(FILES)), whole.with_name("all.parquet"))
    assert main(["embed", str(whole.with_name("all.parquet")), "-o", str(whole),
                 "--device", "cpu"]) == 0
    want = pq.read_table(whole)
    assert got_ids == want.column("id").to_pylist()  # no row lost, doubled or moved
    assert len(got_ids) == len(lines)
    want_rows = np.stack(want.column("embedding").to_numpy(zero_copy_only=False))
    assert (cosine(got, want_rows) > 0.9999).all()
