"""An image-text model's record (image_export.py) and encoder (lean.py's LeanImageText): texts and
images in one batch come back in order, a SigLIP text's vector does not depend on its
batch-mates, a changed vision graph is refused; and images across the engine's socket."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from embedsvc.errors import InvalidRequest  # noqa: E402
from embedsvc.model.backend import load_encoder  # noqa: E402
from embedsvc.model.lean import open_record, record_path  # noqa: E402
from embedsvc.model.record import VISION, RecordError  # noqa: E402
from embedsvc.remote import wire  # noqa: E402
from embedsvc.settings import Settings  # noqa: E402
from embedsvc.work import ImageRef, Pixels  # noqa: E402

from ..models import IMAGE_SIZE, build_image_text  # noqa: E402


@pytest.fixture(scope="module", params=["clip", "siglip"])
def encoder(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(request.param)
    settings = Settings(model=str(build_image_text(base / "model", request.param)),
                        cache_dir=str(base / "cache"))
    return load_encoder(settings), settings


def pixels(n: int, seed: int = 0) -> list[Pixels]:
    rng = np.random.default_rng(seed)
    return [Pixels(rng.standard_normal((3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32), 26)
            for _ in range(n)]


def texts(enc, words):
    return [enc.wrap(ids) for ids in enc.tokenize(words)]


def test_texts_and_images_in_one_batch_come_back_in_order(encoder):
    enc, _ = encoder
    images, words = pixels(2), texts(enc, ["a cat", "a much longer text than the other"])
    mixed = enc.encode([images[0], words[0], images[1], words[1]])
    alone = np.concatenate([enc.encode(images), enc.encode(words)])
    assert np.allclose(mixed, alone[[0, 2, 1, 3]], atol=1e-5)
    assert enc.info.modalities == ("text", "image") and enc.info.kind == "image-text"


def test_a_texts_vector_does_not_depend_on_its_batch_mates(encoder):
    enc, _ = encoder
    short, long = texts(enc, ["cat", "a much longer text than the other one"])
    assert np.allclose(enc.encode([short]), enc.encode([short, long])[:1], atol=1e-5)


def test_the_towers_weights_are_stored_as_float16(encoder):
    from embedsvc.model.record import read_record

    _, settings = encoder
    path, _ = record_path(settings)
    assert read_record(path)["weights"] == "float16"


def test_a_changed_vision_graph_is_refused(encoder, tmp_path):
    _, settings = encoder
    path, _ = record_path(settings)
    copy = tmp_path / "record"
    import shutil

    shutil.copytree(path, copy)
    with open(copy / VISION, "r+b") as f:
        f.seek(-64, 2)
        f.write(b"\0" * 64)
    with pytest.raises(RecordError, match=VISION):
        open_record(copy, threads=1)


def test_images_cross_the_socket_at_their_positions():
    ids = [[101, 7, 102], *pixels(2, seed=3)]
    ids.insert(1, [101, 8, 102])
    rows, images = wire.pack_pixels(ids)
    frame = wire.decode_to_engine(wire.encode(wire.Submit(
        1, "image", *wire.pack_ids(rows), **images)))
    got = wire.unpack_ids(frame.ids, frame.lengths, frame.seconds)
    assert got == [[101, 7, 102], [101, 8, 102], [], []]
    wire.unpack_pixels(frame, got, (3, IMAGE_SIZE, IMAGE_SIZE), 26)
    assert [len(row) for row in got] == [3, 3, 26, 26]
    assert np.array_equal(got[3].array, ids[3].array)


@pytest.mark.parametrize("change", ["shape", "position", "bytes"])
def test_images_that_do_not_add_up_are_refused(change):
    ids = [[101, 7, 102], *pixels(1)]
    rows, fields = wire.pack_pixels(ids)
    shape = (3, IMAGE_SIZE, IMAGE_SIZE)
    if change == "shape":
        shape = (3, IMAGE_SIZE, IMAGE_SIZE + 1)
    elif change == "position":
        fields["images"] = (0).to_bytes(4, "little")  # a text's place
    else:
        fields["pixels"] = fields["pixels"][:-4]
    frame = wire.Submit(1, "image", *wire.pack_ids(rows), **fields)
    with pytest.raises(ValueError):
        wire.unpack_pixels(frame, wire.unpack_ids(frame.ids, frame.lengths), shape, 26)


@pytest.mark.parametrize("item,want", [
    ({"text": "a"}, "a"), ({"type": "text", "text": "a"}, "a"),
    ({"image": "data:x"}, ImageRef("data:x", "input", "input[2]")),
    ({"type": "image_url", "image_url": "data:x"}, ImageRef("data:x", "input", "input[2]")),
    ({"type": "image_url", "image_url": {"url": "data:x"}},
     ImageRef("data:x", "input", "input[2]")),
])
def test_content_items_of_every_client(item, want):
    """An image keeps which input it was, for its 400 to say (param: the field alone)."""
    from embedsvc.api.shapes import content_item

    assert content_item(item, "input[2]") == want


@pytest.mark.parametrize("item", [{"image": 3}, {"type": "audio", "audio": "x"}, {}, 1.5,
                                  {"image": "data:x", "text": "a"}])
def test_other_content_items_are_refused(item):
    from embedsvc.api.shapes import content_item

    with pytest.raises(InvalidRequest, match=r"'input\[0\]'"):
        content_item(item, "input[0]")


@pytest.mark.parametrize("extra,found", [
    ({"auto_map": {"AutoModel": "modeling_clip.JinaCLIPModel"}}, "modeling code of its own"),
    ({"model_type": "siglip2"}, "NaFlex"),
    ({}, "no preprocessor_config.json"),
])
def test_models_this_path_cannot_serve_are_refused_in_one_line(tmp_path, extra, found):
    import json

    from embedsvc.model.backend import serve_image_text

    config = {"model_type": "clip", "text_config": {}, "vision_config": {}, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    settings = Settings(model=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=found) as caught:
        serve_image_text(settings)
    assert "\n" not in str(caught.value)
