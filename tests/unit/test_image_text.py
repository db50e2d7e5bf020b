"""A tiny random CLIP and SigLIP, exported to two ONNX towers and served without torch: image
and text vectors equal transformers' get_image_features / get_text_features (cosine > 0.9999)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from embedsvc.image.preprocess import Preprocessor  # noqa: E402
from embedsvc.model.image_export import export_towers, features  # noqa: E402
from embedsvc.model.image_text import ImageTextTowers  # noqa: E402

TOWER = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
TEXT = dict(TOWER, vocab_size=99, max_position_embeddings=16, eos_token_id=98, pad_token_id=1,
            bos_token_id=97)
VISION = dict(TOWER, image_size=30, patch_size=6)
LENGTH = 16  # SigLIP's fixed text length: its max_position_embeddings


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "clip":
        config = transformers.CLIPConfig(text_config=TEXT, vision_config=VISION,
                                         projection_dim=24)
        model = transformers.CLIPModel(config)
        processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 30},
                                                       crop_size=30)
    else:
        config = transformers.SiglipConfig(text_config=TEXT, vision_config=VISION)
        model = transformers.SiglipModel(config)
        processor = transformers.SiglipImageProcessorPil(size={"height": 30, "width": 30})
    return model.eval(), processor


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.fixture(params=["clip", "siglip"])
def served(request, tmp_path):
    model, processor = tiny(request.param)
    export_towers(model, tmp_path, image_size=30, text_length=7)
    processor.save_pretrained(tmp_path)
    fixed = LENGTH if request.param == "siglip" else None
    return model, processor, ImageTextTowers(tmp_path, text_length=fixed, pad_id=1), tmp_path


def images() -> list[Image.Image]:
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for w, h in [(30, 30), (64, 40), (17, 90)]]


def test_image_vectors_equal_transformers(served):
    model, processor, towers, record = served
    pixels = processor(images=images(), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = features(model.get_image_features(pixel_values=pixels)).numpy()
    got = towers.embed_images(Preprocessor.from_dir(record)(images()))
    assert got.shape == expected.shape
    assert cosines(got, expected).min() > 0.9999


def test_text_vectors_equal_transformers(served):
    model, _, towers, _ = served
    ids = np.array([[97, 5, 6, 7, 98, 1, 1], [97, 9, 10, 11, 12, 13, 98]])
    mask = (np.arange(7)[None, :] < np.array([[5], [7]])).astype(np.int64)
    length = towers.text_length or 7
    padded = np.pad(ids, ((0, 0), (0, length - 7)), constant_values=1)
    padded_mask = np.pad(mask, ((0, 0), (0, length - 7)))
    with torch.no_grad():
        expected = features(model.get_text_features(
            input_ids=torch.tensor(padded), attention_mask=torch.tensor(padded_mask))).numpy()
    got = towers.embed_tokens(ids, mask)
    assert cosines(got, expected).min() > 0.9999
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


def test_a_texts_vector_does_not_depend_on_its_batch_mates(served):
    _, _, towers, _ = served
    alone = towers.embed_tokens(np.array([[97, 5, 98]]), np.ones((1, 3)))
    ids = np.array([[97, 5, 98, 1, 1, 1], [97, 5, 6, 7, 8, 98]])
    mask = np.array([[1, 1, 1, 0, 0, 0], [1] * 6])
    assert cosines(alone, towers.embed_tokens(ids, mask)[:1]).min() > 0.9999
