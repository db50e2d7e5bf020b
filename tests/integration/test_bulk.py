"""`embedsvc embed`: a whole file in this process, or through a running server."""

import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from embedsvc.cli import main

from .conftest import cosine

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon")


def corpus(path: Path, lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 20))) for _ in range(lines)]
    path.write_text("\n".join(texts) + "\n")
    return texts


def test_a_thousand_lines_to_npy_equal_the_models_vectors(tmp_path, reference):
    source, target = tmp_path / "corpus.txt", tmp_path / "vectors.npy"
    texts = corpus(source, 1_000)
    exe = Path(sys.executable).with_name("embedsvc")
    result = subprocess.run([str(exe), "embed", str(source), "--output", str(target)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1000 inputs" in result.stderr and "inputs/s" in result.stderr
    vectors = np.load(target)
    assert vectors.shape == (1_000, 384) and vectors.dtype == np.float32
    sample = random.Random(1).sample(range(1_000), 64)
    assert (cosine(vectors[sample], reference.encode([texts[i] for i in sample])) > 0.9999).all()


def test_parquet_in_and_out_keeps_ids_and_order(tmp_path, reference):
    source, target = tmp_path / "docs.parquet", tmp_path / "out.parquet"
    texts = [f"document {i} about {WORDS[i % len(WORDS)]}" for i in range(40)]
    ids = [f"doc-{i}" for i in range(40)]
    pq.write_table(pa.table({"key": ids, "body": texts}), source, row_group_size=16)
    code = main(["embed", str(source), "-o", str(target), "--text-field", "body",
                 "--id-field", "key", "--chunk-size", "8", "--part-size", "16",
                 "--device", "cpu"])
    assert code == 0
    table = pq.read_table(target)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert table.column("id").to_pylist() == ids
    got = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    assert (cosine(got, reference.encode(texts)) > 0.9999).all()


def test_jsonl_in_and_out_keeps_ids_and_skips_blank_lines(tmp_path, reference):
    source, target = tmp_path / "docs.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": f"doc-{i}", "body": f"document number {i} about {WORDS[i]}"} for i in range(7)]
    source.write_bytes(b"\n".join(orjson.dumps(r) for r in rows[:3]) + b"\n\n" +
                       b"\n".join(orjson.dumps(r) for r in rows[3:]) + b"\n")
    code = main(["embed", str(source), "-o", str(target), "--text-field", "body",
                 "--chunk-size", "2", "--device", "cpu"])
    assert code == 0
    out = [orjson.loads(line) for line in target.read_bytes().splitlines()]
    assert [o["id"] for o in out] == [r["id"] for r in rows]
    got = np.array([o["embedding"] for o in out])
    assert (cosine(got, reference.encode([r["body"] for r in rows])) > 0.9999).all()


def test_url_mode_sends_to_a_running_server(tmp_path, served, reference):
    source, target = tmp_path / "corpus.txt", tmp_path / "vectors.npy"
    texts = corpus(source, 300, seed=2)
    code = main(["embed", str(source), "-o", str(target), "--url", served.url,
                 "--chunk-size", "64", "--concurrency", "3"])
    assert code == 0
    vectors = np.load(target)
    assert (cosine(vectors, reference.encode(texts)) > 0.9999).all()


def test_url_mode_writes_an_input_without_records_at_the_servers_width(tmp_path, served):
    source, target = tmp_path / "empty.txt", tmp_path / "vectors.parquet"
    source.write_text("\n")
    assert main(["embed", str(source), "-o", str(target), "--url", served.url]) == 0
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(target)  # the width /info names, as a full run's file has
    assert table.num_rows == 0
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)


def test_bad_jsonl_names_the_line(tmp_path, served, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    code = main(["embed", str(source), "-o", str(tmp_path / "o.jsonl"), "--url", served.url])
    assert code == 1
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_an_unreachable_server_is_one_line_and_exit_1(tmp_path, capsys):
    source = tmp_path / "corpus.txt"
    corpus(source, 5)
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["embed", str(source), "-o", str(tmp_path / "o.npy"),
                 "--url", f"http://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith(f"embedsvc: cannot reach http://127.0.0.1:{port} (")
    assert err[-1].endswith("start the server (embedsvc serve) or fix --url")
    assert not any("Traceback" in line for line in err)


def test_url_mode_halves_a_chunk_over_the_body_limit_and_names_a_line_over_it(tmp_path,
                                                                              capsys):
    from embedsvc.model.fake import FakeEncoder

    from .fake_server import fake_server

    encoder = FakeEncoder()
    source, target = tmp_path / "corpus.txt", tmp_path / "out.jsonl"
    texts = [f"line {i} " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(12))
             for i in range(40)]
    source.write_text("\n".join(texts) + "\n")
    with fake_server(encoder, max_body_bytes=2048) as server:
        # 40 lines of about 100 bytes: a chunk is twice the limit, each line far under it
        code = main(["embed", str(source), "-o", str(target), "--url", server.url,
                     "--chunk-size", "40"])
        assert code == 0, capsys.readouterr().err
        rows = [orjson.loads(line) for line in target.read_bytes().splitlines()]
        assert [r["id"] for r in rows] == list(range(1, 41))
        for row, text in zip(rows, texts, strict=True):
            np.testing.assert_allclose(row["embedding"], encoder.expected(text), rtol=1e-5)

        source.write_text("\n".join([*texts[:6], "word " * 600, *texts[6:]]) + "\n")
        capsys.readouterr()
        code = main(["embed", str(source), "-o", str(tmp_path / "big.jsonl"),
                     "--url", server.url, "--chunk-size", "40"])
    err = capsys.readouterr().err.strip().splitlines()  # the progress bar, then one line
    assert code == 1 and not any("Traceback" in line for line in err)
    assert err[-1].startswith(f"embedsvc: {source}: record 7: the input is "), err[-1]
    assert (f"bytes as a request body, more than {server.url} accepts (it answered 413): "
            "raise the server's body limit (embedsvc serve: MAX_BODY_BYTES) above that, or "
            "shorten the input") in err[-1]
    assert "split the request" not in err[-1]
