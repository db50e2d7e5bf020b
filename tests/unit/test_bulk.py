"""The bulk package through its injectable parts: a fake embedder, real files, no model."""

import decimal
import json
import os
import zlib

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedsvc.bulk import BulkError, BulkOptions, JobChanged, UsageError, embed_file
from embedsvc.bulk.checkpoint import Checkpoint, parts_dir
from embedsvc.bulk.embedders import image_uri
from embedsvc.bulk.kinds import served_kind
from embedsvc.bulk.options import OUTPUT_DTYPES
from embedsvc.bulk.records import Position, count_images, image_files, read_images, read_records
from embedsvc.cli import main
from embedsvc.model import quantize
from embedsvc.rules import InputRefused
from embedsvc.work import elements


class HashEmbedder:
    """Deterministic unit vectors from the text; fails on call ``fail_at``, or on the chunk
    that holds the input ``fail_on`` (a crash mid-job). A job has several chunks in flight,
    in threads: the chunk of the ninth call is not always the ninth chunk, so a test that
    says where the job stops names the input."""

    identity = {"model": "hash"}
    max_chars = 200_000
    dimension, row_type = 8, "<f4"

    def __init__(self, fail_at=None, fail_on=None):
        self.calls, self.fail_at, self.fail_on = 0, fail_at, fail_on

    def __call__(self, texts):
        self.calls += 1
        if self.calls == self.fail_at or (self.fail_on is not None
                                          and self.fail_on in self.names(texts)):
            raise BulkError("the device fell over")
        return self.rows(texts), len(texts)

    def names(self, texts):
        return texts

    def rows(self, texts):
        rows = np.stack([np.random.default_rng(zlib.crc32(t.encode())).standard_normal(8)
                         for t in texts]).astype(np.float32)
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def run_job(source, target, embedder, **options):
    return embed_file(BulkOptions(str(source), str(target), **options), embedder)


def write_inputs(tmp_path, n=50):
    texts = [f"line {i} with some words" for i in range(n)]
    text = tmp_path / "in.txt"
    text.write_text("\n".join(texts[:10]) + "\n\n" + "\n".join(texts[10:]) + "\n")
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_bytes(b"".join(orjson.dumps({"id": f"d{i}", "text": t}) + b"\n"
                               for i, t in enumerate(texts)))
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts, "id": [f"d{i}" for i in range(n)]}), table,
                   row_group_size=7)
    return texts, {"txt": text, "jsonl": jsonl, "parquet": table}


def read_output(path):
    if path.suffix == ".npy":
        return None, np.load(path)
    if path.suffix == ".jsonl":
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        return [r["id"] for r in rows], np.array([r["embedding"] for r in rows], np.float32)
    table = pq.read_table(path)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 8)
    return table.column("id").to_pylist(), np.stack(table.column("embedding").to_numpy(
        zero_copy_only=False))


@pytest.mark.parametrize("source", ["txt", "jsonl", "parquet"])
@pytest.mark.parametrize("suffix", [".npy", ".jsonl", ".parquet"])
def test_a_job_that_failed_midway_resumes_to_the_uninterrupted_output(tmp_path, source, suffix):
    texts, inputs = write_inputs(tmp_path)
    whole, resumed = tmp_path / f"whole{suffix}", tmp_path / f"resumed{suffix}"
    run_job(inputs[source], whole, HashEmbedder(), chunk_size=3, part_size=6)
    with pytest.raises(BulkError, match="fell over"):
        # the ninth chunk of 3 fails: the one that holds the 25th input
        run_job(inputs[source], resumed, HashEmbedder(fail_on=texts[24]), chunk_size=3,
                part_size=6)
    manifest = orjson.loads((parts_dir(resumed) / "manifest.json").read_bytes())
    assert manifest["done"]["records"] == 24  # 8 chunks of 3 done, in 4 committed parts of 6
    assert [p["end"] for p in manifest["parts"]] == [6, 12, 18, 24]
    embedder = HashEmbedder()
    summary = run_job(inputs[source], resumed, embedder, chunk_size=4, part_size=5)
    assert (summary.inputs, summary.resumed, embedder.calls) == (26, 24, 7)
    assert not parts_dir(resumed).exists()
    ids, rows = read_output(resumed)
    want_ids, want = read_output(whole)
    assert ids == want_ids and np.array_equal(rows, want)


@pytest.mark.parametrize("suffix", [".npy", ".jsonl", ".parquet"])
def test_an_input_without_records_gives_an_empty_output_of_the_models_width(tmp_path, suffix):
    """A shard with no records (an empty file, blank lines) is an empty output the next step
    reads: Parquet raised ArrowInvalid (a list of width 0), .npy had shape (0, 0)."""
    source = tmp_path / "empty.txt"
    source.write_text("\n\n")
    target = tmp_path / f"out{suffix}"
    summary = run_job(source, target, HashEmbedder())
    assert summary.inputs == 0 and not parts_dir(target).exists()
    if suffix == ".parquet":
        table = pq.read_table(target)
        assert table.num_rows == 0
        assert table.schema.field("embedding").type == pa.list_(pa.float32(), 8)
    elif suffix == ".npy":
        rows = np.load(target)
        assert rows.shape == (0, 8) and rows.dtype == np.float32
    else:
        assert target.read_bytes() == b""


def test_an_input_without_records_from_a_server_that_does_not_say_its_width(tmp_path):
    source = tmp_path / "empty.txt"
    source.write_text("")
    untold = HashEmbedder()
    untold.dimension = None
    with pytest.raises(BulkError, match="the input has no records, and the embedder does not "
                                        "say how wide its vectors are"):
        run_job(source, tmp_path / "out.parquet", untold)
    assert not (tmp_path / "out.parquet").exists()
    run_job(source, tmp_path / "out.jsonl", untold)  # lines need no width
    assert (tmp_path / "out.jsonl").read_bytes() == b""


@pytest.mark.parametrize("ids", [
    pa.array([None] * 6 + [f"d{i}" for i in range(6, 12)], pa.string()),  # null first
    pa.array([*range(6), *(2**63 + i for i in range(6))], pa.uint64()),  # large only later
    pa.array([decimal.Decimal(f"{i}.5") for i in range(6)]
             + [decimal.Decimal(f"{1000 + i}.25") for i in range(6)], pa.decimal128(8, 2)),
], ids=["nullable", "uint64", "decimal"])
def test_a_parquet_output_keeps_the_id_type_of_its_parquet_input(tmp_path, ids):
    """Each chunk's ids were typed by their values: a column whose first chunk was null, or
    unsigned ids large only later, or decimals wider later, changed type along the output,
    and the job failed midway ("the ids change type along the input")."""
    texts = [f"line {i} with some words" for i in range(12)]
    source, target = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"text": texts, "id": ids}), source, row_group_size=3)
    run_job(source, target, HashEmbedder(), chunk_size=3, part_size=3)
    table = pq.read_table(target)
    assert table.schema.field("id").type == ids.type
    assert table.column("id").to_pylist() == ids.to_pylist()
    assert np.array_equal(np.stack(table.column("embedding").to_numpy(zero_copy_only=False)),
                          HashEmbedder().rows(texts))


def test_a_resumed_job_casts_the_parts_written_before_the_ids_took_the_inputs_type(
        tmp_path, monkeypatch):
    """Parts committed by a run that typed ids by their values (before this change) join
    those typed by the input's column: int64 parts of small ids, then uint64 ones."""
    from embedsvc.bulk import job

    texts = [f"line {i} with some words" for i in range(12)]
    ids = pa.array([*range(6), *(2**63 + i for i in range(6))], pa.uint64())
    source, target = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"text": texts, "id": ids}), source, row_group_size=3)
    with monkeypatch.context() as old:
        old.setattr(job, "id_type", lambda *args: None)
        with pytest.raises(BulkError, match="fell over"):
            run_job(source, target, HashEmbedder(fail_on=texts[7]), chunk_size=3, part_size=3)
    first = pq.read_table(sorted(parts_dir(target).glob("part-*.parquet"))[0])
    assert first.schema.field("id").type == pa.int64()  # as the values typed it
    run_job(source, target, HashEmbedder(), chunk_size=3, part_size=3)
    table = pq.read_table(target)
    assert table.schema.field("id").type == pa.uint64()
    assert table.column("id").to_pylist() == ids.to_pylist()


def test_an_empty_parquet_input_gives_ids_of_its_columns_type(tmp_path):
    source, target = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string()),
                             "id": pa.array([], pa.string())}), source)
    run_job(source, target, HashEmbedder())
    assert pq.read_table(target).schema.field("id").type == pa.string()  # not null


def test_an_embedder_that_does_not_say_its_width_or_row_type_still_runs(tmp_path):
    """``dimension`` and ``row_type`` are an embedder's to give, not to owe: a library
    caller's embedder written before them runs as it did."""

    class Plain:
        identity, max_chars = {"model": "plain"}, 200_000

        def __call__(self, texts):
            return HashEmbedder().rows(texts), len(texts)

    texts, inputs = write_inputs(tmp_path, n=5)
    run_job(inputs["txt"], tmp_path / "out.npy", Plain())
    assert np.array_equal(np.load(tmp_path / "out.npy"), HashEmbedder().rows(texts))


def test_ids_are_line_numbers_row_numbers_or_the_id_field(tmp_path):
    _, inputs = write_inputs(tmp_path, n=12)
    text_ids = [r.id for r, _ in read_records(inputs["txt"])]
    assert text_ids == [*range(1, 11), *range(12, 14)]  # line 11 is blank
    assert [r.id for r, _ in read_records(inputs["jsonl"])][:2] == ["d0", "d1"]
    with pytest.raises(BulkError, match="in.jsonl:1: no 'nope' field, which --id-field names"):
        next(read_records(inputs["jsonl"], id_field="nope"))  # a named field, never the line
    assert [r.id for r, _ in read_records(inputs["parquet"], id_field=None)][:2] == ["d0", "d1"]


@pytest.mark.parametrize("source", ["txt", "jsonl", "parquet"])
def test_reading_from_a_position_continues_exactly_after_it(tmp_path, source):
    _, inputs = write_inputs(tmp_path)
    everything = list(read_records(inputs[source]))
    for cut in (0, 1, 9, 10, 21, 49, 50):
        start = everything[cut - 1][1] if cut else Position()
        rest = [r for r, _ in read_records(inputs[source], start=start)]
        assert rest == [r for r, _ in everything[cut:]]


def test_a_changed_input_is_refused_until_restart(tmp_path):
    _, inputs = write_inputs(tmp_path)
    source, target = inputs["txt"], tmp_path / "out.npy"
    with pytest.raises(BulkError):
        run_job(source, target, HashEmbedder(fail_at=3), chunk_size=4, part_size=4)
    with open(source, "a") as f:
        f.write("one more line\n")
    with pytest.raises(JobChanged, match=r"different input \(.*size .*--restart"):
        run_job(source, target, HashEmbedder(), chunk_size=4)
    run_job(source, target, HashEmbedder(), chunk_size=4, restart=True)
    assert np.load(target).shape == (51, 8)


def test_a_changed_model_or_field_is_refused(tmp_path):
    _, inputs = write_inputs(tmp_path)
    target = tmp_path / "out.jsonl"
    with pytest.raises(BulkError):
        run_job(inputs["jsonl"], target, HashEmbedder(fail_at=3), chunk_size=4, part_size=4)
    other = HashEmbedder()
    other.identity = {"model": "another"}
    with pytest.raises(JobChanged, match="different model"):
        run_job(inputs["jsonl"], target, other)
    with pytest.raises(JobChanged, match="different fields"):
        run_job(inputs["jsonl"], target, HashEmbedder(), id_field="text")


def test_a_touched_file_of_the_same_content_counts_as_changed(tmp_path):
    # mtime is part of the fingerprint: cheap on huge files, and safe (refusing, never mixing)
    _, inputs = write_inputs(tmp_path)
    target = tmp_path / "out.npy"
    with pytest.raises(BulkError):
        run_job(inputs["txt"], target, HashEmbedder(fail_at=3), chunk_size=4, part_size=4)
    stat = inputs["txt"].stat()
    os.utime(inputs["txt"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(JobChanged, match="mtime_ns"):
        run_job(inputs["txt"], target, HashEmbedder())


class ImageHashEmbedder(HashEmbedder):
    """An image job's embedder: its inputs are image paths, hashed relative to ``root``."""

    images = True

    def __init__(self, root, fail_on=None, fail_at=None):
        super().__init__(fail_at, fail_on)
        self.root = root

    def names(self, texts):
        return [os.path.relpath(t, self.root) for t in texts]

    def rows(self, texts):
        return super().rows(self.names(texts))


def write_images(tmp_path, n=20):
    """A folder of ``n`` image files (never decoded here), some in a subfolder and in upper
    case, beside what it skips; the same paths in a JSONL column (relative, and one absolute)
    and a Parquet column."""
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    names = [f"sub/s{i:02d}.JPG" if i % 3 == 0 else f"p{i:02d}.png" for i in range(n)]
    for name in names:
        (folder / name).write_bytes(name.encode())
    for skipped in ("notes.txt", "._p00.png", ".cache/x.png", "sub/.hidden.png", "noext"):
        (folder / skipped).parent.mkdir(exist_ok=True)
        (folder / skipped).write_bytes(b"not an input")
    paths = [f"photos/{name}" for name in sorted(names)]
    paths[1] = str(tmp_path / paths[1])  # absolute: taken as it is
    jsonl = tmp_path / "images.jsonl"
    jsonl.write_bytes(b"".join(orjson.dumps({"key": f"k{i}", "path": path}) + b"\n"
                               for i, path in enumerate(paths)))
    table = tmp_path / "images.parquet"
    pq.write_table(pa.table({"path": paths, "key": [f"k{i}" for i in range(n)]}), table,
                   row_group_size=7)
    return sorted(names), {"folder": folder, "jsonl": jsonl, "parquet": table}


def test_a_folders_images_are_its_image_files_sorted_and_a_column_names_them(tmp_path):
    names, sources = write_images(tmp_path)
    assert image_files(sources["folder"]) == names  # "sub/s00.JPG" after "p19.png"
    records = [r for r, _ in read_images(sources["folder"], None)]
    assert [r.id for r in records] == names
    want = [str(sources["folder"] / name) for name in names]
    assert [r.text for r in records] == want
    for source in ("jsonl", "parquet"):
        rows = [r for r, _ in read_images(sources[source], "path", "key")]
        assert [r.id for r in rows] == [f"k{i}" for i in range(len(names))]
        assert [os.path.normpath(r.text) for r in rows] == want  # from the file's folder
        assert count_images(sources[source]) == len(names)
    assert count_images(sources["folder"]) == len(names)
    rest = [r.id for r, _ in read_images(sources["folder"], None, start=Position(7))]
    assert rest == names[7:]


@pytest.mark.parametrize("source", ["folder", "jsonl", "parquet"])
@pytest.mark.parametrize("suffix", [".npy", ".jsonl", ".parquet"])
def test_an_image_job_that_failed_midway_resumes_to_the_uninterrupted_output(tmp_path, source,
                                                                            suffix):
    names, sources = write_images(tmp_path, n=26)
    fields = {} if source == "folder" else {"image_field": "path", "id_field": "key"}
    whole, resumed = tmp_path / f"whole{suffix}", tmp_path / f"resumed{suffix}"
    run_job(sources[source], whole, ImageHashEmbedder(tmp_path), chunk_size=3, part_size=6,
            **fields)
    with pytest.raises(BulkError, match="fell over"):
        # the ninth chunk of 3 fails: the one that holds the 25th image
        run_job(sources[source], resumed, ImageHashEmbedder(tmp_path, f"photos/{names[24]}"),
                chunk_size=3, part_size=6, **fields)
    embedder = ImageHashEmbedder(tmp_path)
    summary = run_job(sources[source], resumed, embedder, chunk_size=4, part_size=5, **fields)
    assert (summary.inputs, summary.resumed, embedder.calls) == (2, 24, 1)
    ids, rows = read_output(resumed)
    want_ids, want = read_output(whole)
    assert ids == want_ids and np.array_equal(rows, want)
    if ids is not None:
        assert ids == (names if source == "folder" else [f"k{i}" for i in range(26)])


def test_a_changed_folder_is_refused_until_restart(tmp_path):
    _, sources = write_images(tmp_path)
    folder, target = sources["folder"], tmp_path / "out.npy"
    with pytest.raises(BulkError):
        run_job(folder, target, ImageHashEmbedder(tmp_path, fail_at=3), chunk_size=4,
                part_size=4)
    (folder / "notes.txt").write_text("not an image: the folder's images are the same")
    run_job(folder, tmp_path / "other.npy", ImageHashEmbedder(tmp_path))  # unrelated output
    with pytest.raises(BulkError):
        run_job(folder, target, ImageHashEmbedder(tmp_path, fail_at=2), chunk_size=4,
                part_size=4)  # continued: it failed later, and its parts are kept
    for change in (lambda: (folder / "new.webp").write_bytes(b"x"),
                   lambda: os.utime(folder / "p01.png", ns=(1, 1))):
        change()
        with pytest.raises(JobChanged, match=r"different input \(images|listing_sha256"):
            run_job(folder, target, ImageHashEmbedder(tmp_path))
    run_job(folder, target, ImageHashEmbedder(tmp_path), restart=True)
    assert np.load(target).shape == (21, 8)


def test_an_image_job_needs_an_image_embedder_and_a_text_job_a_text_one(tmp_path):
    _, sources = write_images(tmp_path, n=3)
    _, inputs = write_inputs(tmp_path, n=3)
    with pytest.raises(UsageError, match="images=True"):
        run_job(sources["folder"], tmp_path / "a.npy", HashEmbedder())
    with pytest.raises(UsageError, match="images=True"):
        run_job(inputs["jsonl"], tmp_path / "b.npy", HashEmbedder(), image_field="path")
    with pytest.raises(UsageError, match="only an image job"):
        run_job(inputs["txt"], tmp_path / "c.npy", ImageHashEmbedder(tmp_path))


def test_an_image_file_is_read_here_within_max_image_bytes_or_refused_by_its_index(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(bytes(range(14)))
    uri = image_uri(str(image), 0, 14)
    assert uri == "data:application/octet-stream;base64,AAECAwQFBgcICQoLDA0="
    os.mkfifo(tmp_path / "fifo.png")  # read, it would block the job
    (tmp_path / "dangling.png").symlink_to(tmp_path / "gone.png")
    cases = {str(image): (14 - 1, "has 14 bytes, more than MAX_IMAGE_BYTES (13)"),
             str(tmp_path / "fifo.png"): (100, "is not a regular file"),
             str(tmp_path): (100, "is a folder"),
             str(tmp_path / "dangling.png"): (100, "does not exist"),
             "": (100, "names no image file (its path is empty)")}
    for path, (most, why) in cases.items():
        with pytest.raises(InputRefused) as refused:
            image_uri(path, 3, most)
        assert refused.value.index == 3 and why in refused.value.detail, refused.value.detail


def test_a_kill_between_a_part_and_the_manifest_rewrites_that_part(tmp_path):
    _, inputs = write_inputs(tmp_path)
    target = tmp_path / "out.parquet"
    with pytest.raises(BulkError):
        run_job(inputs["txt"], target, HashEmbedder(fail_at=5), chunk_size=4, part_size=8)
    directory = parts_dir(target)
    (directory / "part-000002.parquet").write_bytes(b"not listed in the manifest")
    (directory / "part-000002.parquet.tmp").write_bytes(b"cut short")
    run_job(inputs["txt"], target, HashEmbedder(), chunk_size=4, part_size=8)
    whole = tmp_path / "whole.parquet"
    run_job(inputs["txt"], whole, HashEmbedder(), chunk_size=50)
    assert pq.read_table(target).equals(pq.read_table(whole))


def test_mixed_id_types_cannot_go_into_parquet(tmp_path):
    source = tmp_path / "mixed.jsonl"
    source.write_text('{"id": 1, "text": "a"}\n{"id": "two", "text": "b"}\n')
    with pytest.raises(BulkError, match="ids mix types"):
        run_job(source, tmp_path / "out.parquet", HashEmbedder())


class SparseHashEmbedder(HashEmbedder):
    """Each text's elements from its hash, as a sparse model's embedder gives them."""

    identity = {"model": "hash", "kind": "sparse"}

    def rows(self, texts):
        rows = []
        for t in texts:
            rng = np.random.default_rng(zlib.crc32(t.encode()))
            indices = np.sort(rng.choice(1000, size=5, replace=False))
            rows.append(elements(indices, rng.random(5).astype(np.float32)))
        return rows


def test_a_sparse_job_resumes_to_the_uninterrupted_jsonl(tmp_path):
    _, inputs = write_inputs(tmp_path)
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    run_job(inputs["jsonl"], whole, SparseHashEmbedder(), chunk_size=3, part_size=6)
    with pytest.raises(BulkError, match="fell over"):
        run_job(inputs["jsonl"], resumed, SparseHashEmbedder(fail_at=9), chunk_size=3,
                   part_size=6)
    run_job(inputs["jsonl"], resumed, SparseHashEmbedder(), chunk_size=4, part_size=5)
    assert resumed.read_bytes() == whole.read_bytes()
    lines = [orjson.loads(line) for line in whole.read_bytes().splitlines()]
    assert [line["id"] for line in lines] == [f"d{i}" for i in range(50)]
    assert all(set(line) == {"id", "sparse"} and len(line["sparse"]) == 5 for line in lines)
    assert set(lines[0]["sparse"][0]) == {"index", "value"}


def test_a_dense_jobs_parts_are_never_continued_by_a_sparse_run(tmp_path):
    _, inputs = write_inputs(tmp_path)
    target = tmp_path / "out.jsonl"
    dense = HashEmbedder(fail_at=3)
    dense.identity = {"model": "hash", "kind": "embedding"}
    with pytest.raises(BulkError):
        run_job(inputs["jsonl"], target, dense, chunk_size=4, part_size=4)
    with pytest.raises(JobChanged, match="different model .kind 'embedding' then, 'sparse' now"):
        run_job(inputs["jsonl"], target, SparseHashEmbedder())


def test_sparse_rows_cannot_go_into_npy_or_parquet(tmp_path):
    _, inputs = write_inputs(tmp_path, n=3)
    for name in ("out.npy", "out.parquet"):
        with pytest.raises(BulkError, match="sparse vectors are written as JSONL only"):
            run_job(inputs["txt"], tmp_path / name, SparseHashEmbedder())


class Answer:
    def __init__(self, status, body):
        self.status_code, self._body = status, body

    def json(self):
        if isinstance(self._body, Exception):
            raise self._body
        return self._body


@pytest.mark.parametrize(("status", "info", "kind"), [
    (200, {"kind": "sparse", "model_type": {"embedding": {"pooling": "splade"}}}, "sparse"),
    (200, {"kind": "reranker"}, "reranker"),
    (200, {"model_type": {"embedding": {"pooling": "splade"}}}, "sparse"),  # TEI
    (200, {"model_type": {"embedding": {"pooling": "cls"}}}, "embedding"),
    (200, {"model_type": {"classifier": {"id2label": {"0": "a", "1": "b"}}}}, "classifier"),
    (404, {"error": "not found"}, "embedding"),  # an OpenAI-compatible server without /info
    (200, ValueError("not JSON"), "embedding"),
    (200, ["a list"], "embedding"),
])
def test_the_served_kind_comes_from_get_info(status, info, kind):
    assert served_kind(Answer(status, info)) == kind


class NoModel:
    def __init__(self, *args, **kwargs):
        raise AssertionError("the model was loaded before the command was checked")


@pytest.mark.parametrize(("argv", "message"), [
    (["embed", "{tmp}/missing.txt", "-o", "{tmp}/o.npy"],
     "input file '{tmp}/missing.txt' not found"),
    (["embed", "{tmp}/dangling.txt", "-o", "{tmp}/o.npy"],
     "input file '{tmp}/dangling.txt' not found (a symbolic link to nothing)"),
    (["embed", "{tmp}/loop.txt", "-o", "{tmp}/o.npy"],
     "input file '{tmp}/loop.txt' cannot be opened: Too many levels of symbolic links"),
    (["embed", "{tmp}/fifo.txt", "-o", "{tmp}/o.npy"],
     "input '{tmp}/fifo.txt' is a named pipe (FIFO), not a file: the job reads its input twice"),
    (["embed", "/dev/zero", "-o", "{tmp}/o.npy"],
     "input '/dev/zero' is a character device, not a file"),
    (["embed", "{tmp}/truncated.parquet", "-o", "{tmp}/o.npy"],
     "{tmp}/truncated.parquet: not a whole Parquet file (Parquet magic bytes not found in "
     "footer."),
    (["embed", "{tmp}/damaged.parquet", "-o", "{tmp}/o.npy"],
     "{tmp}/damaged.parquet: damaged Parquet data, which does not decode past its first"),
    (["embed", "{txt}", "-o", "{tmp}/taken.npy"],
     "--output '{tmp}/taken.npy' is a directory: name a file, such as "
     "'{tmp}/taken.npy/vectors.npy'"),
    (["embed", "{txt}", "-o", "/proc/o.npy"], "cannot write in the output's directory '/proc' ("),
    (["embed", "{tmp}/taken.npy", "-o", "{tmp}/o.npy"],
     "no image files (.bmp, .gif, .jpeg, .jpg, .png, .webp) in the folder '{tmp}/taken.npy' (a "
     "folder of Parquet or JSONL files needs --ray)"),
    (["embed", "{photos}", "-o", "{tmp}/o.npy"],
     "MODEL is a text embedding model, which embeds no images: a folder of images or "
     "--image-field needs an image-text model (CLIP, SigLIP); name one with --model"),
    (["embed", "{jsonl}", "-o", "{tmp}/o.npy", "--image-field", "path", "--model", "{sparse}"],
     "MODEL is a sparse model, which embeds no images"),
    (["embed", "{photos}", "-o", "{tmp}/o.npy", "--url", "http://127.0.0.1:9"],
     "--url embeds texts; images (a folder of images, or --image-field) are embedded in this "
     "process: drop --url"),
    (["embed", "{jsonl}", "-o", "{tmp}/out", "--image-field", "path", "--ray"],
     "--ray embeds texts"),
    (["embed", "{photos}", "-o", "{tmp}/o.npy", "--id-field", "key"],
     "a folder's ids are its images' paths, relative to it: drop --id-field"),
    (["embed", "{photos}", "-o", "{tmp}/o.npy", "--image-field", "path"],
     "is a folder, whose image files are the inputs: drop --image-field"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--image-field", "path"],
     "--image-field names a field of a JSONL, Parquet or Arrow file, not of 'in.txt'"),
    (["embed", "{jsonl}", "-o", "{tmp}/o.npy", "--image-field", "path", "--text-field", "body"],
     "an image job reads no text: drop --text-field"),
    (["embed", "{parquet}", "-o", "{tmp}/o.npy", "--image-field", "path"],
     "has no column 'path' (it has text, id): name the image path column with --image-field"),
    (["embed", "{photos}", "-o", "{tmp}/o.npy", "--model", "{clip}", "--output-dtype", "int8"],
     "--output-dtype int8 quantizes texts' embeddings; images are written as float vectors, as "
     "the server answers them: drop --output-dtype"),
    (["embed", "{txt}", "-o", "{tmp}/o.csv"], "--output must end in .npy, .jsonl or .parquet"),
    (["embed", "{txt}", "-o", "{tmp}/nowhere/o.npy"], "does not exist"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--chunk-size", "32",
      "--max-inputs-per-request", "8", "--max-queue", "16"],
     "--chunk-size (32) is larger than MAX_INPUTS_PER_REQUEST (8)"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--url", "http://127.0.0.1:9", "--model", "x"],
     "--model shapes the in-process model"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--api-key", "k"], "--api-key is sent to the server"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--url", "http://127.0.0.1:9", "--ray"],
     "--url and --ray exclude each other"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--actors", "2"], "--actors applies to --ray only"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--ray"], "--output is a directory of Parquet"),
    (["embed", "{parquet}", "-o", "{tmp}/o.npy", "--text-field", "body"],
     "has no column 'body' (it has text, id): name the text column with --text-field"),
    (["embed", "{parquet}", "-o", "{tmp}/o.npy", "--id-field", "key"], "has no column 'key'"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--chunk-size", "0"],
     "argument --chunk-size: must be greater than 0 (see 'embedsvc embed --help')"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--port", "80"], "unrecognized arguments: --port"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--model", "{sparse}"],
     "MODEL is a sparse model, whose vectors are written as JSONL"),
    (["embed", "{txt}", "-o", "{tmp}/o.parquet", "--model", "{sparse}"],
     "not as .parquet: use an --output ending in .jsonl"),
    (["embed", "{txt}", "-o", "{tmp}/out", "--ray", "--model", "{sparse}"],
     "--ray writes dense vectors to Parquet shards; drop --ray"),
    (["embed", "{txt}", "-o", "{tmp}/o.jsonl", "--model", "{classifier}"],
     "MODEL is a classifier model: embedsvc embed writes embeddings; reranking and "
     "classification are request/response jobs (serve the model and POST /rerank or /predict)"),
    (["embed", "{txt}", "-o", "{tmp}/o.jsonl", "--kind", "sparse"],
     "KIND=sparse needs a model with a masked-language-model head, but MODEL is an embedding "
     "model (the bundled model)"),
    (["embed", "{txt}", "-o", "{tmp}/o.jsonl", "--url", "http://127.0.0.1:9", "--kind",
      "sparse"], "--kind shapes the in-process model"),
    (["embed", "{txt}", "-o", "{tmp}/out", "--ray", "--output-dtype", "int8"],
     "--output-dtype quantizes in this process"),
    (["embed", "{txt}", "-o", "{tmp}/o.jsonl", "--model", "{sparse}", "--output-dtype", "int8"],
     "--output-dtype int8 quantizes dense embeddings and MODEL is a sparse model"),
    (["embed", "{txt}", "-o", "{tmp}/o.npy", "--output-dtype", "int4"],
     "argument --output-dtype: invalid choice: 'int4'"),
])
def test_usage_errors_are_one_line_exit_2_and_load_no_model(tmp_path, monkeypatch, capsys,
                                                           argv, message):
    monkeypatch.setattr("embedsvc.bulk.embedders.LocalEmbedder.__init__", NoModel.__init__)
    _, inputs = write_inputs(tmp_path, n=3)
    write_bad_files(tmp_path)
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.png").write_bytes(b"never decoded: the command stops first")
    names = {"tmp": tmp_path, "txt": inputs["txt"], "parquet": inputs["parquet"],
             "jsonl": inputs["jsonl"], "photos": tmp_path / "photos",
             **config_only_models(tmp_path)}
    argv = [a.format(**names) for a in argv]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("embedsvc: ") and err.count("\n") == 1, err
    assert message.format(**names) in err


def config_only_models(tmp_path):
    """Directories whose config files say sparse, classifier and image-text (the command
    reads the kind from them before any model loads)."""
    configs = {"sparse": {"architectures": ["BertForMaskedLM"]},
               "classifier": {"architectures": ["BertForSequenceClassification"],
                              "id2label": {"0": "a", "1": "b", "2": "c"}},
               "clip": {"model_type": "clip", "text_config": {}, "vision_config": {}}}
    for kind, config in configs.items():
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps(config))
    return {kind: tmp_path / kind for kind in configs}


def write_bad_files(tmp_path):
    """Inputs that are no regular readable file, Parquet cut short or damaged, an output
    that is a directory."""
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    (tmp_path / "loop.txt").symlink_to(tmp_path / "loop.txt")
    os.mkfifo(tmp_path / "fifo.txt")
    (tmp_path / "taken.npy").mkdir()
    texts = [f"row {i} of a table with a few words in it" for i in range(5000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "whole.parquet", row_group_size=1000)
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "truncated.parquet").write_bytes(data[: len(data) // 2])
    middle = len(data) // 3
    damaged = data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 200])
    (tmp_path / "damaged.parquet").write_bytes(damaged + data[middle + 200:])


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


def test_embed_help_shows_defaults_and_no_server_flags(capsys):
    with pytest.raises(SystemExit):
        main(["embed", "--help"])
    out = capsys.readouterr().out
    assert "inputs per call to the model or server (default: 256)" in out
    assert "chunks in flight (default: 4)" in out
    for flag in ("--host", "--port", "--threads", "--drain-timeout-s", "--max-body-bytes",
                 "--request-timeout-s"):
        assert flag not in out
    assert "--model" in out and "--max-queue" in out


def test_a_dataset_is_its_sorted_files_of_one_kind(tmp_path):
    from embedsvc.bulk.dataset import list_dataset

    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("b.parquet", "a.parquet", "sub/c.parquet"):
        pq.write_table(pa.table({"text": ["x"]}), tmp_path / "d" / name)
    (tmp_path / "d" / "_SUCCESS").write_text("")
    names = [f.path.rsplit("/", 1)[1] for f in list_dataset(str(tmp_path / "d")).files]
    assert names == ["a.parquet", "b.parquet", "c.parquet"]
    assert len(list_dataset(str(tmp_path / "d" / "*.parquet")).files) == 2
    (tmp_path / "d" / "e.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(BulkError, match="mixes Parquet and JSONL"):
        list_dataset(str(tmp_path / "d"))


def test_a_ray_read_task_reads_like_the_in_process_reader(tmp_path):
    from embedsvc.bulk.dataset import list_dataset, read_files

    _, inputs = write_inputs(tmp_path, n=20)
    for kind in ("jsonl", "parquet"):
        dataset = list_dataset(str(inputs[kind]))
        tables = list(read_files({"path": [dataset.files[0].path]}, dataset.filesystem,
                                 "text", None, rows=6, max_chars=200_000))
        assert [t.num_rows for t in tables] == [6, 6, 6, 2]
        ids = [i for t in tables for i in t.column("id").to_pylist()]
        assert ids == [r.id for r, _ in read_records(inputs[kind])]
    nullable = tmp_path / "nullable.parquet"  # each task's ids of the column's type
    pq.write_table(pa.table({"text": [f"t{i}" for i in range(8)],
                             "id": pa.array([None] * 4 + ["a", "b", "c", "d"], pa.string())}),
                   nullable)
    dataset = list_dataset(str(nullable))
    tables = list(read_files({"path": [dataset.files[0].path]}, dataset.filesystem, "text",
                             None, rows=4, max_chars=200_000))
    assert [t.schema.field("id").type for t in tables] == [pa.string(), pa.string()]


def test_shards_are_written_per_input_file_and_listed_when_whole(tmp_path):
    from embedsvc.bulk.parts import vectors_table
    from embedsvc.bulk.shards import ShardDirectory, ShardStream

    shards = ShardDirectory(str(tmp_path / "out"), {"job": 1}, restart=False)
    stream = ShardStream(shards, {"/a": 0, "/b": 1, "/empty": 2})

    def batch(paths, first_id):
        table = vectors_table(list(range(first_id, first_id + len(paths))),
                              np.ones((len(paths), 4), np.float32))
        return table.append_column("path", pa.array(paths, pa.string()))

    stream.write(batch(["/a", "/a", "/b"], 0))
    assert list(shards.manifest["shards"]) == ["/a"]  # /b may still get rows
    stream.write(batch(["/b"], 3))
    assert stream.close() == 4
    assert shards.manifest["shards"] == {"/a": {"file": "part-00000.parquet", "rows": 2},
                                         "/b": {"file": "part-00001.parquet", "rows": 2},
                                         "/empty": {"file": None, "rows": 0}}
    assert pq.read_table(tmp_path / "out" / "part-00001.parquet").column("id").to_pylist() == [
        2, 3]
    with pytest.raises(JobChanged, match="different job"):
        ShardDirectory(str(tmp_path / "out"), {"job": 2}, restart=False)


@pytest.mark.parametrize(("assigned", "setting", "threads"), [
    ({"CPU": 1.0}, 0, 1),  # a one-CPU actor: one ONNX Runtime thread, not every core
    ({"CPU": 4.0}, 0, 4),
    ({"CPU": 0.5}, 0, 1),
    ({"CPU": 1.0}, 3, 3),  # ONNX_THREADS set: kept
    ({}, 0, 0),  # no CPU share known: the default (this process's CPUs)
])
def test_a_ray_actor_runs_onnx_on_its_own_share_of_cpus(monkeypatch, assigned, setting, threads):
    import ray

    from embedsvc.bulk.cluster import _own_share
    from embedsvc.settings import Settings

    class Context:
        def get_assigned_resources(self):
            return assigned

    monkeypatch.setattr(ray, "get_runtime_context", Context)
    assert _own_share(Settings(onnx_threads=setting)).onnx_threads == threads


def test_integer_ids_beyond_64_bits_stay_exact_in_jsonl(tmp_path):
    import json

    ids = [2**64 + 1, 10**30 + 7, -(2**70) - 3, 2**63, 5]
    source = tmp_path / "big.jsonl"
    source.write_bytes(b"".join(b'{"id": %d, "text": "text %d"}\n' % (v, i)
                                for i, v in enumerate(ids)))
    assert [r.id for r, _ in read_records(source)] == ids
    for name, key in (("dense.jsonl", "embedding"), ("sparse.jsonl", "sparse")):
        embedder = HashEmbedder() if key == "embedding" else SparseHashEmbedder()
        run_job(source, tmp_path / name, embedder, chunk_size=2, part_size=3)
        lines = [json.loads(line) for line in (tmp_path / name).read_bytes().splitlines()]
        assert [line["id"] for line in lines] == ids  # exact: the stdlib reads big integers
        assert all(set(line) == {"id", key} for line in lines)


def test_parquet_ids_hold_64_bits_and_refuse_more_in_one_line(tmp_path):
    source = tmp_path / "ids.jsonl"
    source.write_bytes(b'{"id": %d, "text": "a"}\n{"id": %d, "text": "b"}\n' % (2**63, 2**64 - 1))
    run_job(source, tmp_path / "out.parquet", HashEmbedder())
    assert pq.read_table(tmp_path / "out.parquet").column("id").to_pylist() == [2**63, 2**64 - 1]
    source.write_bytes(b'{"id": %d, "text": "a"}\n' % 2**64)
    with pytest.raises(BulkError, match="an id is an integer beyond 64 bits, which a Parquet "
                       "integer column cannot hold: write JSONL"):
        run_job(source, tmp_path / "big.parquet", HashEmbedder())


class SlowHashEmbedder(HashEmbedder):
    def __call__(self, texts):
        import time

        time.sleep(0.05)
        return super().__call__(texts)


def test_a_part_is_committed_after_part_seconds_even_below_part_size(tmp_path):
    _, inputs = write_inputs(tmp_path)
    target = tmp_path / "out.npy"
    with pytest.raises(BulkError, match="fell over"):
        run_job(inputs["txt"], target, SlowHashEmbedder(fail_at=9), chunk_size=3,
                concurrency=1, part_size=10_000, part_seconds=0.01)
    manifest = orjson.loads((parts_dir(target) / "manifest.json").read_bytes())
    # A part opens with a chunk's rows; the next chunk comes 50 ms later, past the 10 ms, and
    # is committed with it: parts of two chunks, though 10,000 rows were never reached.
    assert [p["end"] for p in manifest["parts"]] == [6, 12, 18, 24]
    run_job(inputs["txt"], target, HashEmbedder(), chunk_size=7)
    whole = tmp_path / "whole.npy"
    run_job(inputs["txt"], whole, HashEmbedder())
    assert np.array_equal(np.load(target), np.load(whole))


def test_options_refuse_what_cannot_cut_a_job():
    for name in ("chunk_size", "concurrency", "part_size", "part_seconds"):
        with pytest.raises(BulkError, match=f"--{name.replace('_', '-')} must be greater"):
            BulkOptions("in.txt", "out.npy", **{name: 0})


def test_output_dtypes_are_the_quantizers_and_only_those():
    assert OUTPUT_DTYPES == quantize.DTYPES
    with pytest.raises(BulkError, match="--output-dtype must be one of float, int8, uint8, "):
        BulkOptions("in.txt", "out.npy", output_dtype="int4")
    with pytest.raises(BulkError, match="--output-dtype quantizes in this process"):
        BulkOptions("in.txt", "out.npy", output_dtype="int8", url="http://127.0.0.1:9")


def test_only_the_in_process_model_gives_quantized_rows(tmp_path):
    _, inputs = write_inputs(tmp_path, n=3)
    with pytest.raises(BulkError, match="quantizes with the model in this process"):
        run_job(inputs["txt"], tmp_path / "o.npy", HashEmbedder(), output_dtype="int8")


@pytest.mark.parametrize("suffix", [".npy", ".parquet"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_integer_rows_keep_their_type_across_parts(tmp_path, suffix, dtype):
    target = tmp_path / f"codes{suffix}"
    rows = np.random.default_rng(0).integers(0, 120, (10, 6)).astype(dtype)
    records = list(read_records(write_inputs(tmp_path, n=10)[1]["txt"], "text", None))
    checkpoint = Checkpoint.open(target, suffix, {"job": 1}, part_size=4)
    for at in range(0, 10, 2):  # parts of 4, 4 and 2 rows
        chunk = records[at:at + 2]
        checkpoint.write([r for r, _ in chunk], rows[at:at + 2], chunk[-1][1])
    assert checkpoint.finish() == 10
    if suffix == ".npy":
        back = np.load(target)
    else:
        back = np.stack(pq.read_table(target).column("embedding").to_numpy(zero_copy_only=False))
    assert back.dtype == dtype and np.array_equal(back, rows)


def test_lines_are_counted_a_block_at_a_time_as_they_are_read(tmp_path, monkeypatch):
    from embedsvc.bulk import records

    monkeypatch.setattr(records, "_COUNT_BLOCK", 7)  # lines and blanks across blocks
    data = b"one\n\n  \t\ntwo words here\r\n   x\nlong line without blanks\n \n\nlast"
    source = tmp_path / "in.txt"
    source.write_bytes(data)
    assert records.count_records(source) == sum(1 for line in data.splitlines() if line.strip())
    assert records.count_records(source) == len(list(read_records(source)))


@pytest.mark.parametrize("suffix", [".txt", ".parquet", ".arrow"])
def test_an_input_past_max_chars_is_refused_as_it_is_read(tmp_path, suffix):
    """A UTF-8 character is at most 4 bytes: 40 bytes may be 10 characters, 41 cannot."""
    texts = ["short", "é" * 20, "x" * 41, "never read"]  # 40 bytes, then 41
    source = tmp_path / f"in{suffix}"
    if suffix == ".txt":
        source.write_text("\n".join(texts) + "\n")
    elif suffix == ".parquet":
        pq.write_table(pa.table({"text": texts}), source)
    else:
        with pa.ipc.new_file(source, pa.schema([("text", pa.string())])) as writer:
            writer.write_table(pa.table({"text": texts}))
    where = "record 3: the input" if suffix == ".txt" else "row 3: 'text'"
    with pytest.raises(BulkError, match=f"{where} has more characters than MAX_INPUT_CHARS "
                                        r"\(10\)"):
        list(read_records(source, max_chars=10))
    # 40 bytes pass: whether they are 10 characters or more is the engine's to judge
    assert [r.text for r, _ in read_records(source, max_chars=11)][:2] == texts[:2]


def test_a_jsonl_row_longer_than_its_text_and_other_fields_need_is_refused(tmp_path):
    source = tmp_path / "in.jsonl"
    row = orjson.dumps({"text": "short", "unused": [1] * (1 << 19 | 100)})  # over 1 MiB
    source.write_bytes(b'{"text": "first"}\n' + row + b"\n")
    read = read_records(source, max_chars=10)
    assert next(read)[0].text == "first"
    with pytest.raises(BulkError, match=r"in.jsonl:2: the row is longer than 1048696 bytes"):
        next(read)


def test_a_large_row_group_is_read_a_few_rows_at_a_time(tmp_path, monkeypatch):
    from embedsvc.bulk import records

    monkeypatch.setattr(records, "_BATCH_BYTES", 4000)  # rows of about 1000 bytes: 4 a batch
    texts = [f"{i:04d}" + "x" * 996 for i in range(50)]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts}), source)  # one row group
    with open(source, "rb") as f:
        batches = records._batches(source, records.PARQUET, ["text"], 0, lambda: f)
        sizes = [batch.num_rows for _, batch in batches]
    assert sizes[0] == records._PROBE_ROWS and max(sizes[1:]) <= 4 and sum(sizes) == 50
    assert [r.text for r, _ in read_records(source)] == texts
    assert [r.text for r, _ in read_records(source, start=Position(13))] == texts[13:]


def test_an_interrupt_while_the_first_chunk_computes_commits_no_row_past_it(tmp_path):
    """The first chunk in flight is slow, those after it finish: an interrupt while the job
    waits for the first took it off the queue unwritten, then committed the later ones and
    moved the resume point past it. The rerun left that chunk's rows out (and under .npy,
    every later row belonged to another input), yet renamed the short file into place."""
    import signal
    import threading
    import time

    from embedsvc.bulk.interrupt import Interrupted, StopSignals

    class SlowFirst(HashEmbedder):
        def __call__(self, texts):
            if "t1" in texts:
                time.sleep(1.0)
            return super().__call__(texts)

    source = tmp_path / "in.txt"
    source.write_text("".join(f"t{i}\n" for i in range(1, 41)))
    whole, resumed = tmp_path / "whole.npy", tmp_path / "resumed.npy"
    run_job(source, whole, HashEmbedder(), chunk_size=4, concurrency=4)
    options = BulkOptions(str(source), str(resumed), chunk_size=4, concurrency=4)
    threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGINT)).start()
    with StopSignals() as stop, pytest.raises(Interrupted):
        embed_file(options, SlowFirst(), stop=stop)
    manifest = orjson.loads((parts_dir(resumed) / "manifest.json").read_bytes())
    assert manifest["done"]["records"] == 0 and manifest["parts"] == []  # nothing past a gap
    summary = run_job(source, resumed, HashEmbedder(), chunk_size=4, concurrency=4)
    assert (summary.inputs, summary.resumed) == (40, 0)
    assert np.array_equal(np.load(resumed), np.load(whole))


def test_parts_short_of_the_rows_done_are_never_put_in_place(tmp_path):
    """The output is renamed into place only when its parts hold every row done."""
    _, inputs = write_inputs(tmp_path, n=12)
    target = tmp_path / "out.npy"
    checkpoint = Checkpoint.open(target, ".npy", {"job": "t"}, part_size=100, part_seconds=60,
                                 restart=False)
    records = list(read_records(inputs["txt"]))
    rows = HashEmbedder().rows([r.text for r, _ in records])
    checkpoint.write([r for r, _ in records[:6]], rows[:6], records[5][1])
    checkpoint.commit()
    manifest = parts_dir(target) / "manifest.json"
    data = orjson.loads(manifest.read_bytes())
    data["done"]["records"] = 12  # the manifest says more than the parts hold
    manifest.write_bytes(orjson.dumps(data))
    again = Checkpoint.open(target, ".npy", {"job": "t"}, part_size=100, part_seconds=60,
                            restart=False)
    with pytest.raises(BulkError, match="hold 6 rows where 12 inputs were done"):
        again.finish()
    assert not target.exists() and parts_dir(target).exists()
    assert not target.with_name(target.name + ".tmp").exists()  # no half file left aside


def test_a_job_resumed_on_another_graph_is_refused_and_an_old_job_still_resumes(tmp_path):
    """A job begun in float and resumed with QUANTIZE=int8 mixed two graphs' vectors in one
    file (cosine down to 0.986): the graph is part of the job's identity where it is not the
    default's, and a default one adds nothing (a job begun before it was recorded)."""
    from embedsvc.bulk.embedders import local_identity
    from embedsvc.settings import Settings

    default = local_identity(Settings())
    assert set(default) == {"model", "device", "dtype", "kind"}
    _, inputs = write_inputs(tmp_path, n=6)
    target = tmp_path / "out.npy"
    begun = Checkpoint.open(target, ".npy", {"job": default}, part_size=100, part_seconds=60,
                            restart=False)
    records = list(read_records(inputs["txt"]))
    begun.write([r for r, _ in records], HashEmbedder().rows([r.text for r, _ in records]),
                records[-1][1])
    begun.commit()  # a part committed: from now on the job is this one
    Checkpoint.open(target, ".npy", {"job": local_identity(Settings())}, part_size=100,
                    part_seconds=60, restart=False)  # the same job resumes
    for changed in (Settings(quantize="int8"), Settings(backend="torch")):
        with pytest.raises(JobChanged):
            Checkpoint.open(target, ".npy", {"job": local_identity(changed)}, part_size=100,
                            part_seconds=60, restart=False)


def test_ids_json_has_no_form_for_are_one_line_and_decimals_are_exact(tmp_path):
    """Decimal ids (a warehouse's export) were a traceback on JSONL output, as were bytes
    and durations: a decimal is written as the exact number it is, the others refused."""
    import datetime
    from decimal import Decimal

    texts = ["one", "two"]
    for ids, want in ((pa.array([Decimal("12345678901234567890"), Decimal("2.50")],
                                pa.decimal128(22, 2)), None),
                      (pa.array([b"a", b"b"]), "has no JSON form"),
                      (pa.array([datetime.timedelta(1), datetime.timedelta(2)]),
                       "has no JSON form")):
        source = tmp_path / "in.parquet"
        pq.write_table(pa.table({"text": texts, "key": ids}), source)
        target = tmp_path / "out.jsonl"
        if want is None:
            run_job(source, target, HashEmbedder(), id_field="key", restart=True)
            lines = target.read_bytes().splitlines()
            assert [line.split(b",")[0] for line in lines] == [
                b'{"id":12345678901234567890.00', b'{"id":2.50']
        else:
            with pytest.raises(BulkError, match=want):
                run_job(source, target, HashEmbedder(), id_field="key", restart=True)


def test_a_parquet_text_column_that_is_not_utf8_is_one_line(tmp_path):
    """A string column another writer filled with other bytes: a UnicodeDecodeError's
    traceback, after the model had loaded."""
    values = [b"good", b"\xff\xfebad", b"fine"]
    offsets = np.cumsum([0, *map(len, values)]).astype(np.int32)
    column = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets.tobytes()),
                                                    pa.py_buffer(b"".join(values))])
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": column}), source)
    with pytest.raises(BulkError, match="in.parquet: a row of 'text' from row 1 on, in a batch "
                                        "of 3, is not UTF-8 text"):
        list(read_records(source))


def test_a_servers_answer_is_read_by_index_and_a_wrong_one_is_one_line(monkeypatch):
    """--url took the rows in the order listed, not by their ``index``; floats where base64
    was asked, an HTML page with 200, or a Retry-After given as a date were tracebacks."""
    import base64

    import httpx

    from embedsvc.bulk.embedders import RemoteEmbedder

    rows = np.arange(6, dtype="<f4").reshape(3, 2)
    answers: list = []
    waits = served_by(monkeypatch, lambda request: httpx.Response(
        200, json={"kind": "embedding"}) if request.url.path == "/info" else answers.pop(0))
    embedder = RemoteEmbedder("http://embed.test")
    listed = [{"index": i, "embedding": base64.b64encode(rows[i].tobytes()).decode()}
              for i in (2, 0, 1)]
    usage = {"prompt_tokens": 9}
    answers.append(httpx.Response(200, json={"data": listed, "usage": usage}))
    got, tokens = embedder(["a", "b", "c"])
    assert np.array_equal(got, rows) and tokens == 9
    floats = [{"index": i, "embedding": rows[i].tolist()} for i in range(3)]
    answers.extend([httpx.Response(503, headers={"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}),
                    httpx.Response(200, json={"data": floats, "usage": usage})])
    assert np.array_equal(embedder(["a", "b", "c"])[0], rows) and waits == [1.0]
    for wrong in (httpx.Response(200, text="<html>a proxy's page</html>"),
                  httpx.Response(200, json={"data": listed[:2], "usage": usage})):
        answers.append(wrong)
        with pytest.raises(BulkError, match="answered something other than one vector for "
                                            "each of 3 inputs"):
            embedder(["a", "b", "c"])
    embedder.close()


def served_by(monkeypatch, handler) -> list:
    """httpx's clients answered by ``handler`` (no server); the seconds slept meanwhile."""
    import httpx

    real, waits = httpx.Client, []
    monkeypatch.setattr(httpx, "Client", lambda **kwargs: real(
        transport=httpx.MockTransport(handler), **kwargs))
    monkeypatch.setattr("embedsvc.bulk.embedders.time.sleep", waits.append)
    return waits


def test_a_server_still_loading_is_asked_again_for_its_kind(monkeypatch):
    """An embedsvc still loading names no kind yet: read as a dense model's, a sparse
    server's chunks went to /v1/embeddings and the job failed."""
    import httpx

    from embedsvc.bulk.embedders import RemoteEmbedder

    infos = [{"kind": None, "state": "loading"}, {"kind": None, "state": "loading"},
             {"kind": "sparse", "state": "ready"}]
    waits = served_by(monkeypatch, lambda request: httpx.Response(200, json=infos.pop(0)))
    embedder = RemoteEmbedder("http://embed.test")
    assert embedder.kind == "sparse" and waits == [1.0, 1.0]
    embedder.close()
