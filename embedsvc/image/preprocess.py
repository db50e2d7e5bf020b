"""Image preprocessing without torch (Pillow + numpy), driven by ``preprocessor_config.json``.

The steps and their order are transformers' image processors' (``CLIPImageProcessor``,
``SiglipImageProcessor``, PIL backend): RGB conversion (transparency composited over white),
resize with the configured resample (``shortest_edge``: the short side to that length, the long
side ``int(size * long / short)``; ``height``/``width``: that fixed size), centre crop (zero
padding where the image is smaller than the crop), rescale, normalise. The output is float32
NCHW. Equal to transformers' processor within a max abs difference of 1e-5
(tests/unit/test_image_preprocess.py): the resize is Pillow's own in both, the rest is float
arithmetic done in another order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import require_pillow

if TYPE_CHECKING:
    from PIL.Image import Image

TOLERANCE = 1e-5  # max abs difference to transformers' processor, as the tests check it
# An image whose resize would be larger than this many pixels (4096 x 4096, 48 MiB as RGB)
# resizes only the part the centre crop keeps (``Preprocessor.kept_box``): the long strips of
# a few bytes that would otherwise take gigabytes. Every other image resizes whole, exactly as
# transformers' processor does (a 3 x 500 strip to a shortest edge of 224 is 8.4 megapixels).
_RESIZE_MOST = 1 << 24


@dataclass(frozen=True)
class Preprocessor:
    shortest_edge: int | None = 224  # None: resize to (height, width)
    height: int = 224
    width: int = 224
    crop: tuple[int, int] | None = (224, 224)  # (height, width); None: no centre crop
    resample: int = 3  # Pillow's BICUBIC
    scale: float | None = 1 / 255
    mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    std: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    convert_rgb: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Preprocessor:
        """The steps a ``preprocessor_config.json`` names, with transformers' defaults."""
        size = config.get("size", {}) if config.get("do_resize", True) else {}
        size = {"shortest_edge": size} if isinstance(size, int) else size
        crop = config.get("crop_size", {})
        crop = {"height": crop, "width": crop} if isinstance(crop, int) else crop
        on = config.get
        return cls(
            shortest_edge=size.get("shortest_edge"),
            height=size.get("height", 0), width=size.get("width", 0),
            crop=(crop["height"], crop["width"]) if on("do_center_crop", False) else None,
            resample=int(on("resample", 3)),
            scale=float(on("rescale_factor", 1 / 255)) if on("do_rescale", True) else None,
            mean=tuple(on("image_mean", ())) or None if on("do_normalize", True) else None,
            std=tuple(on("image_std", ())) or None if on("do_normalize", True) else None,
            convert_rgb=bool(on("do_convert_rgb", True)),  # null: no, as transformers reads it
        )

    @classmethod
    def from_dir(cls, path: Path) -> Preprocessor:
        return cls.from_config(json.loads((path / "preprocessor_config.json").read_text()))

    def __call__(self, images: Sequence[Image]) -> np.ndarray:
        """The float32 NCHW batch of ``images``."""
        return np.stack([self.one(image) for image in images])

    def one(self, image: Image) -> np.ndarray:
        """One image as float32 CHW. Where ``do_convert_rgb`` is off (SigLIP's configs carry
        ``null``), an RGB image is taken as it is, as transformers takes it; any other is
        made RGB still (transformers fails on it): the vision tower takes three channels,
        and a grey, palette or transparent image left as it is cannot be normalised."""
        if self.convert_rgb or image.mode != "RGB":
            image = to_rgb(image)
        target = self.target_size(image.size)
        if target is not None:
            box = self.kept_box(image.size, target)
            if box is None:
                image = image.resize((target[1], target[0]), resample=self.resample)
            else:  # only the part the centre crop keeps, straight to the crop's size
                assert self.crop is not None
                image = image.resize((self.crop[1], self.crop[0]), resample=self.resample,
                                     box=box)
        pixels = np.asarray(image)
        pixels = pixels[..., None] if pixels.ndim == 2 else pixels
        chw = np.moveaxis(pixels, -1, 0)
        if self.crop is not None:
            chw = centre_crop(chw, *self.crop)
        out = chw.astype(np.float32)
        if self.scale is not None:
            out *= np.float32(self.scale)
        if self.mean is not None and self.std is not None:
            out -= np.asarray(self.mean, np.float32)[:, None, None]
            out /= np.asarray(self.std, np.float32)[:, None, None]
        return out

    def kept_box(self, size: tuple[int, int], target: tuple[int, int]
                 ) -> tuple[float, float, float, float] | None:
        """For an image whose resize to ``target`` (height, width) would be larger than
        ``_RESIZE_MOST`` pixels (a 1,000,000 x 1 strip resized to a shortest edge of 224 is
        224 gigapixels; an image of 40 megapixels passes the decoder's bound), the region of
        the source image, in Pillow's (left, upper, right, lower), that the crop keeps; None
        for the others, which resize whole, as transformers' processor does. 400 for such
        an image where the model crops nothing."""
        height, width = target
        crop = self.crop
        if height * width <= _RESIZE_MOST:
            return None
        if crop is None or crop[0] > height or crop[1] > width:
            from .decode import InvalidImage

            raise InvalidImage(f"the image ({size[0]} x {size[1]}) would resize to {width} x "
                               f"{height} pixels for this model; send one of a less extreme "
                               "shape", code="image_shape")
        top, left = (height - crop[0]) // 2, (width - crop[1]) // 2
        sx, sy = size[0] / width, size[1] / height
        return (left * sx, top * sy, (left + crop[1]) * sx, (top + crop[0]) * sy)

    def output_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of every image's array: what the vision tower takes."""
        if self.crop is not None:
            return (3, *self.crop)
        if self.shortest_edge is None and self.height and self.width:
            return 3, self.height, self.width
        raise ValueError("this preprocessor neither crops nor resizes to a fixed size, so its "
                         "images have no one shape")

    def target_size(self, size: tuple[int, int]) -> tuple[int, int] | None:
        """(height, width) to resize an image of Pillow ``size`` (width, height) to."""
        width, height = size
        if self.shortest_edge is not None:
            short, long = (width, height) if width <= height else (height, width)
            new_long = int(self.shortest_edge * long / short)
            return ((new_long, self.shortest_edge) if width <= height
                    else (self.shortest_edge, new_long))
        if self.height and self.width:
            return self.height, self.width
        return None


def to_rgb(image: Image) -> Image:
    """RGB, any transparency composited over white (transformers' ``convert_to_rgb``), with
    as few full-size copies as that takes: none for an RGB image; for one with alpha, the
    RGBA form (unless it is one) and the white canvas it is pasted on through its alpha,
    which gives alpha_composite's pixels exactly (every value under every alpha)."""
    pil = require_pillow()
    if image.mode == "RGB" and image.info.get("transparency") is None:
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        out = pil.Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, (0, 0), rgba)
        return out
    return image.convert("RGB")


def centre_crop(chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre ``height`` x ``width`` of ``chw``, zero-padded where it is smaller."""
    _, h, w = chw.shape
    if h < height or w < width:
        padded = np.zeros((chw.shape[0], max(h, height), max(w, width)), chw.dtype)
        top, left = math.ceil((padded.shape[1] - h) / 2), math.ceil((padded.shape[2] - w) / 2)
        padded[:, top:top + h, left:left + w] = chw
        chw, h, w = padded, padded.shape[1], padded.shape[2]
    top, left = (h - height) // 2, (w - width) // 2
    return chw[:, top:top + height, left:left + width]
