"""`embedsvc embed` with a sparse model (the tiny SPLADE of tests/models.py): JSONL lines of
TEI's sparse elements equal to SparseEncoder.encode, in this process and through a server;
outputs other than JSONL and request/response kinds are refused."""

import numpy as np
import orjson
import pytest

from embedsvc.bulk.embedders import local_identity
from embedsvc.cli import main
from embedsvc.settings import Settings

from .servers import running
from .test_kinds import DOCS, TEXTS, assert_sparse_equal, reference_sparse

INPUTS = [*TEXTS, *DOCS, "SPLADE keeps a few hundred vocabulary entries per text."]


@pytest.fixture(scope="module")
def splade(kind_dirs):
    """The model directory and sentence-transformers' own SparseEncoder on it."""
    from sentence_transformers import SparseEncoder

    path = kind_dirs["sparse"]
    return path, SparseEncoder(str(path), device="cpu")


def read_sparse(path):
    """(ids, [(indices, values)]) of an output file; every line has exactly id and sparse."""
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert all(set(line) == {"id", "sparse"} for line in lines)
    rows = [(np.array([e["index"] for e in line["sparse"]]),
             np.array([e["value"] for e in line["sparse"]])) for line in lines]
    assert all(len(i) > 0 and np.all(np.diff(i) > 0) for i, _ in rows)  # indices ascending
    return [line["id"] for line in lines], rows


def write_text(path, texts):
    path.write_text("\n".join(texts) + "\n")
    return path


def test_jsonl_in_this_process_equals_sparse_encoder_encode(tmp_path, splade):
    model, reference = splade
    source, target = tmp_path / "docs.jsonl", tmp_path / "out.jsonl"
    ids = [f"doc-{i}" for i in range(len(INPUTS))]
    source.write_bytes(b"".join(orjson.dumps({"id": i, "body": t}) + b"\n"
                                for i, t in zip(ids, INPUTS, strict=True)))
    code = main(["embed", str(source), "-o", str(target), "--model", str(model),
                 "--text-field", "body", "--chunk-size", "3", "--part-size", "4",
                 "--device", "cpu"])
    assert code == 0
    got_ids, got = read_sparse(target)
    assert got_ids == ids
    assert_sparse_equal(got, reference_sparse(reference, INPUTS))
    assert not (tmp_path / "out.jsonl.parts").exists()


def test_url_to_a_sparse_server_gives_the_same_output(tmp_path, splade):
    model, reference = splade
    source = write_text(tmp_path / "corpus.txt", INPUTS)
    local, remote = tmp_path / "local.jsonl", tmp_path / "remote.jsonl"
    assert main(["embed", str(source), "-o", str(local), "--model", str(model),
                 "--device", "cpu", "--chunk-size", "5"]) == 0
    with running(["embedsvc", "serve", "--model", str(model), "--port", "0"],
                 tmp_path / "serve.log") as server:
        code = main(["embed", str(source), "-o", str(remote), "--url", server.url,
                     "--chunk-size", "4", "--concurrency", "3", "--part-size", "6"])
    assert code == 0
    local_ids, local_rows = read_sparse(local)
    remote_ids, remote_rows = read_sparse(remote)
    assert local_ids == remote_ids == list(range(1, len(INPUTS) + 1))  # line numbers
    assert_sparse_equal(remote_rows, local_rows)
    assert_sparse_equal(remote_rows, reference_sparse(reference, INPUTS))


@pytest.mark.parametrize("output", ["vectors.npy", "vectors.parquet"])
def test_a_sparse_model_refuses_npy_and_parquet_before_loading(tmp_path, splade, capsys,
                                                               monkeypatch, output):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("embedsvc.bulk.embedders.LocalEmbedder.__init__", no_load)
    source = write_text(tmp_path / "corpus.txt", TEXTS)
    code = main(["embed", str(source), "-o", str(tmp_path / output), "--model", str(splade[0])])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "a sparse model" in err and "use an --output ending in .jsonl" in err
    assert not (tmp_path / (output + ".parts")).exists()


def test_a_reranker_is_refused_as_a_request_response_job(tmp_path, kind_dirs, capsys):
    source = write_text(tmp_path / "corpus.txt", TEXTS)
    code = main(["embed", str(source), "-o", str(tmp_path / "out.jsonl"),
                 "--model", str(kind_dirs["reranker"])])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "a reranker model" in err and "request/response jobs" in err
    assert "POST /rerank" in err


def test_the_job_identity_names_the_kind(kind_dirs):
    sparse = local_identity(Settings(model=str(kind_dirs["sparse"])))
    dense = local_identity(Settings())
    assert sparse["kind"] == "sparse" and dense["kind"] == "embedding"
    forced = local_identity(Settings(model=str(kind_dirs["sparse"]), kind="embedding"))
    assert forced["kind"] == "embedding"


def test_url_to_a_reranker_server_is_refused(tmp_path, kind_dirs, capsys):
    source = write_text(tmp_path / "corpus.txt", TEXTS)
    with running(["embedsvc", "serve", "--model", str(kind_dirs["reranker"]), "--port", "0"],
                 tmp_path / "serve.log") as server:
        code = main(["embed", str(source), "-o", str(tmp_path / "out.jsonl"),
                     "--url", server.url])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{server.url} serves a reranker model" in err and "request/response jobs" in err
    assert not (tmp_path / "out.jsonl.parts").exists()
