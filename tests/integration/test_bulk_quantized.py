"""`embedsvc embed --output-dtype`: quantized rows in .npy and Parquet, with their integer type,
equal to the codes of the float rows under the model's calibration."""

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedsvc.bulk import BulkOptions, embed_file
from embedsvc.bulk.embedders import local_identity
from embedsvc.cli import main
from embedsvc.model import quantize
from embedsvc.settings import Settings

from .test_bulk import corpus


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One corpus, and its float rows as `embedsvc embed` writes them."""
    base = tmp_path_factory.mktemp("quantized")
    source = base / "corpus.txt"
    corpus(source, 120, seed=3)
    floats = base / "floats.npy"
    assert main(["embed", str(source), "-o", str(floats), "--device", "cpu"]) == 0
    return source, np.load(floats)


def run(source: Path, target: Path, dtype: str, *more: str) -> int:
    return main(["embed", str(source), "-o", str(target), "--device", "cpu",
                 "--output-dtype", dtype, "--chunk-size", "16", "--part-size", "32", *more])


def test_int8_npy_and_parquet_hold_the_codes_of_the_float_rows(job, tmp_path):
    source, floats = job
    assert run(source, tmp_path / "codes.npy", "int8") == 0
    codes = np.load(tmp_path / "codes.npy")
    assert codes.dtype == np.int8 and codes.shape == floats.shape
    # the calibration the command used, read back from the cache it wrote
    [cached] = Path(os.environ["EMBEDSVC_CACHE_DIR"]).glob("all-MiniLM-L6-v2-*.calibration.npy")
    scale = quantize.Calibration(np.load(cached)).scale()
    off = np.abs(codes.astype(int) - quantize.quantize(floats, "int8", scale).astype(int))
    assert off.max() <= 1 and (off == 0).mean() > 0.99
    assert run(source, tmp_path / "codes.parquet", "uint8") == 0
    table = pq.read_table(tmp_path / "codes.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.uint8(), 384)
    column = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    assert np.array_equal(column.astype(int) - 128, codes.astype(int))


def test_ubinary_is_the_packed_signs_of_the_float_rows(job, tmp_path):
    source, floats = job
    assert run(source, tmp_path / "bits.npy", "ubinary") == 0
    bits = np.load(tmp_path / "bits.npy")
    assert bits.dtype == np.uint8 and bits.shape == (120, 48)
    assert np.array_equal(bits, np.packbits(floats > 0, axis=1))


def test_an_unfinished_float_job_is_not_resumed_as_int8(job, tmp_path, capsys):
    source, _ = job
    target = tmp_path / "codes.npy"

    class Crashing:  # a float run that committed one part, then died
        identity = local_identity(Settings(device="cpu"))
        kind, calls, max_chars = "embedding", 0, 200_000
        dimension, row_type = 384, "<f4"

        def __call__(self, texts):
            self.calls += 1
            if self.calls > 2:
                raise KeyboardInterrupt
            return np.ones((len(texts), 384), np.float32), 1

    with pytest.raises(KeyboardInterrupt):
        embed_file(BulkOptions(str(source), str(target), chunk_size=16, part_size=16,
                               concurrency=1), Crashing())
    assert run(source, target, "int8") == 2
    err = capsys.readouterr().err
    assert "different output dtype (None then, 'int8' now)" in err and "--restart" in err
    assert run(source, target, "int8", "--restart") == 0
    assert np.load(target).dtype == np.int8


def test_output_dtype_needs_the_model_in_this_process(job, tmp_path, capsys):
    source, _ = job
    code = main(["embed", str(source), "-o", str(tmp_path / "x.npy"), "--output-dtype", "int8",
                 "--url", "http://127.0.0.1:9"])
    assert code == 2
    assert "--output-dtype quantizes in this process" in capsys.readouterr().err
