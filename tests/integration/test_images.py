"""Images without PyTorch (issue 48): a tiny random CLIP and a tiny random SigLIP, built with
transformers and exported by ``embedsvc export``, served with PyTorch unimportable, in one
process and under ``--workers 2``. Every API shape that carries images (OpenAI with Jina's
items and content parts, Infinity's ``modality``, vLLM's ``messages``, Cohere's ``images`` and
``inputs``) answers the vectors of transformers' own ``get_image_features`` and
``get_text_features`` after its own processor and tokenizer; hostile images get a 4xx and the
server serves on."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from .. import loopback
from ..models import TEXT_LENGTH, build_image_text
from .conftest import pin_mtimes
from .servers import Server, running
from .test_lean import GUARD

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

PARITY = 0.9999
TEXTS = ["a photo of a cat", "x", "two dogs playing in the snow at night"]
SIZES = [(30, 30), (64, 40), (17, 90), (200, 120)]  # (width, height)


def images() -> list:
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


def data_uri(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    mime = "jpeg" if fmt == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def unit(rows) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def features(output):
    return (output if hasattr(output, "shape") else output.pooler_output).numpy()


def reference(path: Path, model_type: str) -> dict[str, np.ndarray]:
    """transformers' unit vectors of IMAGES and TEXTS, after its own processor and
    tokenizer (SigLIP's texts padded to max_length, as its processor is used)."""
    model = transformers.AutoModel.from_pretrained(path).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    padding = {"padding": "max_length", "max_length": TEXT_LENGTH} if model_type == "siglip" \
        else {"padding": True}
    with torch.no_grad():
        pixels = processor(images=images(), return_tensors="pt")["pixel_values"]
        image_rows = features(model.get_image_features(pixel_values=pixels))
        text_rows = features(model.get_text_features(
            **tokenizer(TEXTS, return_tensors="pt", **padding)))
    return {"images": unit(image_rows), "texts": unit(text_rows)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[Path, Path, dict[str, np.ndarray]]]:
    """Each model's directory, the cache `embedsvc export` wrote its record to, and
    transformers' vectors."""
    base = tmp_path_factory.mktemp("image-models")
    out = {}
    for model_type in ("clip", "siglip"):
        path, cache = base / model_type, base / f"{model_type}-cache"
        build_image_text(path, model_type)
        pin_mtimes(path)
        done = subprocess.run([str(Path(sys.executable).parent / "embedsvc"), "export",
                               "--model", str(path), "--cache-dir", str(cache)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        out[model_type] = (path, cache, reference(path, model_type))
    return out


@pytest.fixture(scope="module", params=[
    ("clip", []), ("clip", ["--workers", "2"]), ("siglip", []), ("siglip", ["--workers", "2"])],
    ids=["clip-one-process", "clip-workers-2", "siglip-one-process", "siglip-workers-2"])
def served(request, exported, tmp_path_factory) -> Iterator[tuple[Server, dict]]:
    model_type, launch = request.param
    path, cache, want = exported[model_type]
    where = tmp_path_factory.mktemp("image-serve")
    cmd = [*guarded(where), "serve", "--port", "0", "--model", str(path), "--cache-dir",
           str(cache), *launch]
    log = where / "serve.log"
    with running(cmd, log, env={"EMBEDSVC_IMAGE_URL_HOSTS": "127.0.0.1,localhost"}) as server:
        yield server, want


def guarded(where: Path) -> list[str]:
    """`embedsvc` with PyTorch and transformers unimportable, as a script, so that the
    engine and front processes it starts (the same script again) are guarded too."""
    script = where / "embedsvc_without_torch.py"
    script.write_text(GUARD, encoding="utf-8")
    return [sys.executable, str(script)]


def post(server: Server, route: str, body: dict) -> dict:
    resp = loopback.post(server.url + route, json=body, timeout=60)
    assert resp.status_code == 200, (route, resp.text)
    return resp.json()


def openai_rows(answer: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)


def same(got: np.ndarray, want: np.ndarray) -> None:
    cosines = (unit(got) * want).sum(axis=1)
    assert cosines.min() > PARITY, cosines


def test_every_api_shape_answers_transformers_vectors(served):
    server, want = served
    uris = [data_uri(image) for image in images()]
    pictures, texts = want["images"], want["texts"]

    # OpenAI's route: Jina's items and content parts, texts beside images, in order
    mixed = [{"image": uris[0]}, {"text": TEXTS[0]},
             {"type": "image_url", "image_url": {"url": uris[1]}},
             {"type": "image_url", "image_url": uris[2]}, TEXTS[1]]
    rows = openai_rows(post(server, "/v1/embeddings", {"input": mixed}))
    same(rows[[0, 2, 3]], pictures[:3])
    same(rows[[1, 4]], texts[:2])
    # Infinity's modality, and the same route without /v1
    same(openai_rows(post(server, "/embeddings", {"input": uris, "modality": "image"})),
         pictures)
    # vLLM's messages, one input each
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}]}
                for u in uris[:2]] + [{"role": "user", "content": TEXTS[2]}]
    rows = openai_rows(post(server, "/v1/embeddings", {"messages": messages}))
    same(rows[:2], pictures[:2])
    same(rows[2:], texts[2:])
    # text only: the text tower, as an embedding model's routes
    same(openai_rows(post(server, "/v1/embeddings", {"input": TEXTS})), texts)
    same(np.array(post(server, "/embed", {"inputs": TEXTS})), texts)
    # Cohere: images, and inputs of content parts
    answer = post(server, "/v2/embed", {"images": uris, "input_type": "image",
                                        "embedding_types": ["float"]})
    same(np.array(answer["embeddings"]["float"]), pictures)
    inputs = [{"content": [{"type": "text", "text": TEXTS[0]}]},
              {"content": [{"type": "image_url", "image_url": {"url": uris[3]}}]}]
    rows = np.array(post(server, "/v2/embed", {"inputs": inputs})["embeddings"]["float"])
    same(rows[:1], texts[:1])
    same(rows[1:], pictures[3:])
    answer = post(server, "/v1/embed", {"images": uris[:1]})
    same(np.array(answer["embeddings"]), pictures[:1])


def test_the_models_routes_say_which_modalities_it_takes(served):
    server, _ = served
    listed = loopback.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    about = loopback.get(server.url + "/info", timeout=10).json()
    assert listed["modalities"] == about["modalities"] == ["text", "image"]
    assert listed["kind"] == about["kind"] == "image-text"
    document = loopback.get(server.url + "/openapi.json", timeout=10).json()
    assert document["info"]["x-embedsvc-models"] == [
        {"name": about["model_id"], "kind": "image-text", "modalities": ["text", "image"]}]
    assert "without PyTorch" in server.output() and "unimportable" not in server.output()


def bomb() -> str:
    """A small PNG whose header declares 50,000 x 50,000 pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0)
    body = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(body).decode()


def rss_kib(pid: int) -> int:
    """The resident memory of ``pid`` and every process under it (the fronts, the engine)."""
    with open(f"/proc/{pid}/status") as f:
        own = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return own + sum(rss_kib(int(child)) for child in children)


def test_hostile_images_get_a_4xx_and_the_server_serves_on(served):
    server, want = served
    truncated = data_uri(images()[3], "JPEG")
    truncated = truncated[:len(truncated) // 2]
    truncated = truncated[:len(truncated) - len(truncated) % 4]
    svg = "data:image/svg+xml;base64," + base64.b64encode(
        b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>').decode()
    huge = "data:image/png;base64," + "A" * (20 * 1024 * 1024)
    hostile = {
        "bomb": ({"input": [{"image": bomb()}]}, "image_too_many_pixels"),
        "truncated": ({"input": [{"image": truncated}]}, None),
        "svg": ({"input": [{"image": svg}]}, None),
        "loopback": ({"input": [{"image": "http://127.0.0.1:9/cat.png"}]}, None),
        "not base64": ({"input": [{"image": "data:image/png;base64,%%%"}]}, None),
        "over the count": ({"input": [{"image": data_uri(images()[0])}] * 17}, None),
    }
    before = rss_kib(server.pid)
    for name, (body, code) in hostile.items():
        for _ in range(3):
            resp = loopback.post(server.url + "/v1/embeddings", json=body, timeout=60)
            assert 400 <= resp.status_code < 500, (name, resp.status_code, resp.text)
            error = resp.json()["error"]
            assert error["message"] and (code is None or error["code"] == code), (name, error)
    resp = loopback.post(server.url + "/v2/embed", json={"images": [huge]}, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
    # a refused image on Cohere's route too; each names which image it was
    resp = loopback.post(server.url + "/v2/embed", json={"images": [svg]}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "images", resp.text
    assert resp.json()["error"]["message"].startswith("images[0]: "), resp.text
    resp = loopback.post(server.url + "/v1/embeddings", json={"input": [
        {"image": data_uri(images()[0])}, "a text", {"image": svg}]}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input", resp.text
    assert resp.json()["error"]["message"].startswith("input[2]: "), resp.text
    assert rss_kib(server.pid) - before < 200 * 1024  # the stated bound: 200 MiB
    same(openai_rows(post(server, "/v1/embeddings", {"input": [{"image": data_uri(
        images()[0])}]})), want["images"][:1])


def test_fetching_is_off_unless_hosts_are_listed(exported, tmp_path):
    path, cache, _ = exported["clip"]
    cmd = [*guarded(tmp_path), "serve", "--port", "0", "--model", str(path), "--cache-dir",
           str(cache)]
    with running(cmd, tmp_path / "serve.log") as server:
        resp = loopback.post(server.url + "/v1/embeddings",
                             json={"input": [{"image": "https://example.com/cat.png"}]},
                             timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "image_url_disabled"


def test_a_text_model_refuses_images_in_one_line(served_alone):
    resp = loopback.post(served_alone.url + "/v1/embeddings",
                         json={"input": [{"image": "data:image/png;base64,AAAA"}]}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "not_supported"
    assert "text only" in resp.json()["error"]["message"]


def test_the_cohere_and_openai_clients_send_images(served):
    """The clients users run, as docs/clients.md calls them."""
    cohere = pytest.importorskip("cohere")
    openai = pytest.importorskip("openai")
    server, want = served
    uris = [data_uri(image) for image in images()[:2]]
    v2 = cohere.ClientV2(api_key="unused", base_url=server.url)
    result = v2.embed(images=uris, model="any", input_type="image", embedding_types=["float"])
    same(np.array(result.embeddings.float_), want["images"][:2])
    result = v2.embed(inputs=[{"content": [{"type": "image_url", "image_url": {"url": uris[1]}}]}],
                      model="any", input_type="search_document", embedding_types=["float"])
    same(np.array(result.embeddings.float_), want["images"][1:2])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model="any", input=[{"image": uris[0]}, TEXTS[0]])
    rows = np.array([item.embedding for item in answer.data], dtype=np.float32)
    same(rows[:1], want["images"][:1])
    same(rows[1:], want["texts"][:1])


def test_without_pillow_texts_serve_and_images_name_the_extra(exported, tmp_path):
    from .test_lean import BLOCKED

    path, cache, want = exported["clip"]
    script = tmp_path / "embedsvc_without_pillow.py"
    script.write_text(GUARD.replace(repr(BLOCKED), repr((*BLOCKED, "PIL"))), encoding="utf-8")
    cmd = [sys.executable, str(script), "serve", "--port", "0", "--model", str(path),
           "--cache-dir", str(cache)]
    with running(cmd, tmp_path / "serve.log") as server:
        same(openai_rows(post(server, "/v1/embeddings", {"input": TEXTS})), want["texts"])
        resp = loopback.post(server.url + "/v1/embeddings",
                             json={"input": [{"image": "data:image/png;base64,AAAA"}]},
                             timeout=30)
        log = server.output()
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"] == "images need Pillow: pip install 'embedsvc[image]'"
    assert "images need Pillow: pip install 'embedsvc[image]'; until then" in log
