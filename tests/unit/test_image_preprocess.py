"""Preprocessing without torch against transformers' own image processors, within TOLERANCE."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from embedsvc.image.decode import decode_bytes  # noqa: E402
from embedsvc.image.preprocess import TOLERANCE, Preprocessor  # noqa: E402

SIZES = [(224, 224), (1, 1), (3, 500), (500, 3), (1024, 768), (640, 481), (97, 131), (200, 100)]
MODES = ["RGB", "RGBA", "LA", "L", "P", "PA", "CMYK", "I;16", "1"]


def generated(mode: str, size: tuple[int, int], seed: int) -> Image.Image:
    """Noise with structure (a gradient), so that resampling and cropping both show."""
    rng = np.random.default_rng(seed)
    w, h = size
    grad = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    rgba = (rng.integers(0, 256, (h, w, 4)) * 0.5 + grad * 0.5).astype(np.uint8)
    image = Image.fromarray(rgba, "RGBA")
    if mode == "P":
        p = image.convert("RGB").quantize(16)
        p.info["transparency"] = 3
        return p
    return image.convert(mode)


PROCESSORS = {
    "clip": transformers.CLIPImageProcessorPil,
    "siglip": transformers.SiglipImageProcessorPil,
}


@pytest.fixture(params=[("clip", {}), ("siglip", {}),
                        ("clip", {"size": {"shortest_edge": 64}, "crop_size": 48,
                                  "resample": 2}),
                        ("siglip", {"size": {"height": 40, "width": 72}, "resample": 0})],
                ids=["clip", "siglip", "clip-small-bilinear", "siglip-oblong-nearest"])
def pair(request, tmp_path):
    """transformers' processor and ours, both read from the same preprocessor_config.json."""
    kind, overrides = request.param
    PROCESSORS[kind](**overrides).save_pretrained(tmp_path)
    theirs = transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    return theirs, Preprocessor.from_dir(tmp_path)


def their_pixels(processor, image: Image.Image) -> np.ndarray:
    return processor(images=[image], return_tensors="np")["pixel_values"]


@pytest.mark.parametrize("mode", MODES)
def test_equal_to_transformers_on_every_mode_and_size(pair, mode):
    theirs, ours = pair
    for seed, size in enumerate(SIZES):
        image = generated(mode, size, seed)
        expected = their_pixels(theirs, image)
        got = ours([image])
        assert got.dtype == np.float32 and got.shape == expected.shape, (mode, size)
        assert np.abs(got - expected).max() <= TOLERANCE, (mode, size)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_equal_after_each_exif_orientation(pair, orientation):
    """The decoder turns the image upright; transformers gets the same upright image."""
    theirs, ours = pair
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    generated("RGB", (90, 50), orientation).save(buf, "JPEG", exif=exif.tobytes())
    upright = decode_bytes(buf.getvalue())
    assert upright.size == ((50, 90) if orientation >= 5 else (90, 50))
    assert np.abs(ours([upright]) - their_pixels(theirs, upright)).max() <= TOLERANCE


def test_a_batch_is_nchw():
    images = [generated("RGB", (300, 200), 1), generated("L", (20, 20), 2)]
    assert Preprocessor()(images).shape == (2, 3, 224, 224)


def test_the_config_decides_the_steps(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": False, "do_rescale": False, "do_normalize": False, "do_center_crop": False}))
    image = generated("RGB", (7, 5), 0)
    got = Preprocessor.from_dir(tmp_path)([image])[0]
    np.testing.assert_array_equal(got, np.moveaxis(np.asarray(image), -1, 0).astype(np.float32))


@pytest.mark.parametrize("setting", [None, False])
def test_every_image_is_made_rgb_whatever_do_convert_rgb_says(tmp_path, setting):
    """SigLIP's configs written by transformers 4 carry ``"do_convert_rgb": null``: read as
    "do not convert", a grey, palette or transparent image kept its 1, 2 or 4 channels and
    its normalisation raised (a 500). The tower takes three channels whatever it says."""
    transformers.SiglipImageProcessorPil().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**config, "do_convert_rgb": setting}))
    ours, default = Preprocessor.from_dir(tmp_path), Preprocessor.from_config(config)
    for mode in MODES:
        image = generated(mode, (40, 30), 0)
        np.testing.assert_array_equal(ours([image]), default([image]))
        assert ours([image]).shape == (1, 3, *default.output_shape()[1:])
    # an RGB image is taken as it is, as transformers takes it: its colour key (tRNS) is
    # not composited over white where the config asks for no conversion
    rgb = np.zeros((40, 30, 3), np.uint8)
    rgb[:, :15] = (0, 255, 0)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, "PNG", transparency=(0, 255, 0))
    keyed = Image.open(io.BytesIO(buf.getvalue()))
    keyed.load()
    theirs = transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    assert np.abs(ours([keyed]) - their_pixels(theirs, keyed)).max() <= TOLERANCE


def test_a_long_strip_resizes_only_what_the_crop_keeps(monkeypatch):
    """A 1,000,000 x 1 PNG of a few KB resized whole to a shortest edge of 224 would be 224
    gigapixels; only the crop's region is resized, close to what resizing it whole gives."""
    import numpy as np
    from PIL import Image

    from embedsvc.image import preprocess

    clip = preprocess.Preprocessor()
    assert clip.kept_box((640, 480), clip.target_size((640, 480))) is None  # photos: whole
    assert clip.kept_box((10**6, 1), clip.target_size((10**6, 1))) is not None
    strip = Image.fromarray(np.random.default_rng(3).integers(0, 256, (90, 60000, 3),
                                                              dtype=np.uint8))
    assert clip.kept_box(strip.size, clip.target_size(strip.size)) is not None
    boxed = clip.one(strip)
    monkeypatch.setattr(preprocess, "_RESIZE_MOST", 10**12)
    whole = clip.one(strip)
    assert boxed.shape == whole.shape == (3, 224, 224)
    assert np.abs(boxed - whole).mean() < 0.02 and np.abs(boxed - whole).max() < 0.5


def test_a_long_strip_is_refused_where_nothing_is_cropped():
    import pytest

    from embedsvc.image.decode import InvalidImage
    from embedsvc.image.preprocess import Preprocessor

    uncropped = Preprocessor(crop=None)
    with pytest.raises(InvalidImage, match="less extreme shape"):
        uncropped.kept_box((10**6, 1), uncropped.target_size((10**6, 1)))
