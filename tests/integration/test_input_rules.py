"""The library, HTTP and `embedsvc embed` refuse the same inputs with the same message.

The rules live in embedsvc/rules.py and the engine applies them to every caller; this runs
the same cases through all three on the real model.
"""

import orjson
import pytest

from embedsvc.api.wsgi import create_app
from embedsvc.cli import main
from embedsvc.errors import InvalidRequest
from embedsvc.service import Service
from embedsvc.settings import Settings

LIMITS = {"max_input_chars": 1000, "auto_truncate": False}
CASES = {
    "too many characters": ("x" * 1001, "has 1001 characters, more than MAX_INPUT_CHARS (1000)"),
    "empty": ("", "is an empty string; every input needs at least one character"),
    "too many tokens": ("a " * 300,  # 600 characters, 300 tokens: past the model's 256
                        "than this model's limit of 256; shorten it or ask for truncation"),
}


@pytest.fixture(scope="module")
def service():
    started = Service(Settings(device="cpu", **LIMITS))
    started.start(background=False)
    yield started
    started.drain(timeout=5)


def library(service, text: str) -> str:
    with pytest.raises(InvalidRequest) as info:
        service.ready().embed(["fine", text])
    return info.value.message


def http(service, text: str) -> str:
    client = create_app(service.settings, service=service).test_client()
    resp = client.post("/v1/embeddings", json={"input": ["fine", text]})
    assert resp.status_code == 400
    return resp.get_json()["error"]["message"]


def bulk(tmp_path, capsys, text: str) -> str:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"id": f"doc-{i}", "text": t}) + b"\n"
                                for i, t in enumerate(["fine", text])))
    flags = ["--max-input-chars", "1000", "--auto-truncate", "false", "--device", "cpu"]
    code = main(["embed", str(source), "-o", str(tmp_path / "out.jsonl"), *flags])
    assert code == 1
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("embedsvc:")]
    assert len(said) == 1 and "Traceback" not in err, err  # the progress bar aside
    return said[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_http_and_embed_refuse_alike(service, tmp_path, capsys, case):
    text, reason = CASES[case]
    from_library, from_http = library(service, text), http(service, text)
    assert from_library == from_http
    assert from_library.startswith("input 1 ") and reason in from_library
    from_embed = bulk(tmp_path, capsys, text)
    assert from_embed.endswith(f"record doc-1: the input {from_library[len('input 1 '):]}")
